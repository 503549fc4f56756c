"""`etrain doctor` findings on this machine (no GPU, no cloud) and its exit code."""

from __future__ import annotations

from cluster.doctor import Finding, check_python, check_storage, check_torch, exit_code, render


def test_old_python_is_blocking():
    f = check_python((3, 8, 10))
    assert f.level == "error" and "3.10" in f.fix


def test_no_gpu_is_a_warning_not_a_crash():
    findings = check_torch()
    assert any(f.level == "warn" and "no GPU visible" in f.what for f in findings)
    assert exit_code(findings) == 0


def test_unwritable_storage_root_is_blocking(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    f = check_storage(str(blocker / "root"))
    assert f.level == "error" and "not writable" in f.what and "checkpoint.storage_root" in f.fix


def test_writable_storage_root(tmp_path):
    assert check_storage(str(tmp_path)).level == "ok"
    assert list(tmp_path.iterdir()) == [], "the probe is removed"


def test_render_and_exit_code():
    findings = [Finding("ok", "a"), Finding("warn", "b", "do b"), Finding("error", "c", "do c")]
    text = render(findings)
    assert "[FAIL] c" in text and "fix: do c" in text and "1 blocking problem(s)" in text
    assert exit_code(findings) == 1 and exit_code(findings[:2]) == 0


def test_doctor_says_which_way_use_gpu_auto_goes_and_why():
    from cluster.capacity import GpuCapacity
    from cluster.doctor import check_gpu_decision

    scale_from_zero = check_gpu_decision(GpuCapacity(0, 10, "/home/ubuntu/ray_bootstrap_config.yaml",
                                                     ("gpu_spot", "gpu_ondemand")))
    assert "train on GPUs with NCCL" in scale_from_zero.what
    assert "no GPU up now, but the autoscaler can launch 10 (gpu_spot, gpu_ondemand" in scale_from_zero.what
    cpu_only = check_gpu_decision(GpuCapacity(0, 0, "none"))
    assert "train on CPUs with gloo" in cpu_only.what and "no GPU node type" in cpu_only.what


def test_the_hf_packages_are_named_when_missing():
    from cluster.doctor import check_hf

    found = check_hf()
    assert found.level == "ok" and "transformers 5.23.0" in found.what
    missing = check_hf(find=lambda name: None if name == "transformers" else object())
    assert missing.level == "warn" and "transformers not installed: jobs with model.hf cannot run here" in missing.what
    assert "pip install transformers==" in missing.fix
