"""The service's settings: where its state may live, and what `etrain serve` reads from a --config file."""

from __future__ import annotations

import pytest

from service.settings import ServiceSettings


def test_settings_refuse_a_state_folder_inside_the_storage_root(tmp_path):
    with pytest.raises(ValueError, match="inside the storage root"):
        ServiceSettings(storage_root=str(tmp_path), state_dir=str(tmp_path / "service"), ray_dashboard_url="x")
    ServiceSettings(storage_root=str(tmp_path / "root"), state_dir=str(tmp_path / "state"), ray_dashboard_url="x")


def test_serve_reads_the_operators_settings_file(tmp_path):
    import argparse

    from service.cli import serve_settings

    config = tmp_path / "service.yaml"
    config.write_text("allowed_factories: ['acme_models:make']\nmax_sweep_trials: {user: 10}\ntenant_quotas: {a: 2}\n")
    args = argparse.Namespace(config=str(config), dashboard_url=None, quota=None, stop_wait_s=None,
                              state_dir=str(tmp_path / "state"))
    settings = serve_settings(args, str(tmp_path / "root"))
    assert settings.allowed_factories == ["acme_models:make"] and settings.tenant_quotas == {"a": 2}
    assert settings.max_sweep_trials == {"user": 10, "code": 256, "admin": 1024}  # the roles not given keep theirs
    args.state_dir = str(tmp_path / "root" / "state")
    with pytest.raises(ValueError, match="state_dir .* is inside the storage root, where jobs write"):
        serve_settings(args, str(tmp_path / "root"))
    config.write_text("max_sweep_trials: {root: 1}\n")
    args.state_dir = None
    with pytest.raises(ValueError, match="unknown roles \\['root'\\]"):
        serve_settings(args, str(tmp_path / "root"))
