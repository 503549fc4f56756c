"""Checkpoint integrity: only verified checkpoints restore; the skipped ones are named."""

from __future__ import annotations

import json
import os

import pyarrow.fs as pafs
import pytest
import torch

from trainers import checkpoint_files as ckpt
from trainers.checkpoint_files import Candidate, choose_restore


def make(run: str, step: int) -> str:
    d = os.path.join(run, ckpt.dir_name(step))
    os.makedirs(d)
    ckpt.write(pafs.LocalFileSystem(), d, {"step": step, "w": torch.arange(1000.0) * step}, f"model_{step}.pt")
    return d


@pytest.mark.parametrize("candidates,chosen,skipped", [
    ([], None, []),
    ([Candidate(10, "a", None)], 10, []),
    ([Candidate(10, "a", None), Candidate(20, "b", "corrupt")], 10, [20]),
    ([Candidate(30, "c", "no manifest"), Candidate(20, "b", "corrupt"), Candidate(10, "a", None)], 10, [30, 20]),
    ([Candidate(30, "c", "x"), Candidate(20, "b", "y")], None, [30, 20]),
    ([Candidate(5, "a", None), Candidate(7, "b", None)], 7, []),
])
def test_choose_restore(candidates, chosen, skipped):
    c, s = choose_restore(candidates)
    assert (c.step if c else None) == chosen
    assert [x.step for x in s] == skipped


def test_roundtrip_and_newest_wins(tmp_path):
    run = str(tmp_path)
    make(run, 10)
    make(run, 20)
    chosen, skipped = ckpt.find_restore(pafs.LocalFileSystem(), run)
    assert chosen.step == 20 and skipped == []
    state = ckpt.load_state(pafs.LocalFileSystem(), chosen.path)
    assert state["step"] == 20 and torch.equal(state["w"], torch.arange(1000.0) * 20)


@pytest.mark.parametrize("damage,reason", [
    ("truncate", "truncated"),
    ("corrupt", "SHA-256"),
    ("no_manifest", "no manifest.json"),
    ("delete_state", "missing"),
    ("garbage_manifest", "unreadable manifest"),
])
def test_damaged_newest_is_skipped_with_reason(tmp_path, damage, reason):
    run = str(tmp_path)
    make(run, 10)
    bad = make(run, 20)
    state = os.path.join(bad, "model_20.pt")
    manifest = os.path.join(bad, ckpt.MANIFEST)
    if damage == "truncate":
        with open(state, "r+b") as f:
            f.truncate(100)
    elif damage == "corrupt":
        with open(state, "r+b") as f:
            f.seek(200)
            f.write(b"\x00\xff" * 8)
    elif damage == "no_manifest":
        os.remove(manifest)
    elif damage == "delete_state":
        os.remove(state)
    else:
        with open(manifest, "w") as f:
            f.write("{not json")
    chosen, skipped = ckpt.find_restore(pafs.LocalFileSystem(), run)
    assert chosen.step == 10
    assert [s.step for s in skipped] == [20] and reason in skipped[0].problem


def test_manifest_lists_sizes_and_hashes(tmp_path):
    d = make(str(tmp_path), 3)
    manifest = json.loads(open(os.path.join(d, ckpt.MANIFEST)).read())
    assert manifest["state_file"] == "model_3.pt"
    meta = manifest["files"]["model_3.pt"]
    assert meta["size"] == os.path.getsize(os.path.join(d, "model_3.pt")) and len(meta["sha256"]) == 64


def test_missing_run_folder_means_fresh_start(tmp_path):
    assert ckpt.find_restore(pafs.LocalFileSystem(), str(tmp_path / "nope")) == (None, [])


K = ckpt.Kept


@pytest.mark.parametrize("entries,keep,mode,deleted", [
    ([K(1, 0.9, True), K(2, 0.5, True), K(3, 0.7, True), K(4, 0.8, True)], 2, None, [1, 2]),
    ([K(1, 0.9, True), K(2, 0.5, True), K(3, 0.7, True), K(4, 0.8, True)], 2, "min", [1]),
    ([K(1, 0.9, True), K(2, 0.5, True), K(3, 0.7, True), K(4, 0.8, True)], 1, "max", [2, 3]),
    ([K(1, 0.9, True), K(2, None, False), K(3, 0.7, True)], 1, None, [1, 2]),  # a partial one goes too
    ([K(1, 0.9, True), K(2, 0.5, True), K(3, None, False)], 1, None, [1]),     # newer, maybe uploading: kept
    ([K(1, 0.9, True), K(2, 0.5, True)], None, "min", []),
    ([], 3, "min", []),
])
def test_retention_plan(entries, keep, mode, deleted):
    assert ckpt.retention_plan(entries, keep, mode) == deleted


def test_prune_keeps_newest_and_best(tmp_path):
    run = str(tmp_path)
    for step, loss in [(10, 0.3), (20, 0.1), (30, 0.4), (40, 0.5)]:
        d = os.path.join(run, ckpt.dir_name(step))
        os.makedirs(d)
        ckpt.write(pafs.LocalFileSystem(), d, {"step": step}, f"model_{step}.pt", {"loss": loss})
    os.makedirs(os.path.join(run, ckpt.dir_name(25)))  # a writer killed before its manifest
    assert ckpt.prune(pafs.LocalFileSystem(), run, 2, "loss", "min") == [10, 25]
    assert sorted(os.listdir(run)) == [ckpt.dir_name(s) for s in (20, 30, 40)]


def test_a_throttled_manifest_read_during_prune_deletes_nothing(s3_server, tmp_path, said):
    """S3 answers 503 SlowDown (past the client's retries) for the best checkpoint's manifest:
    that is not an incomplete checkpoint, so this round prunes nothing and says why."""
    import boto3
    from faulty_proxy import FaultyProxy

    boto3.client("s3").create_bucket(Bucket="prune-503")
    direct = pafs.S3FileSystem(endpoint_override=s3_server.removeprefix("http://"), scheme="http")
    run = "prune-503/job/checkpoints"
    for step, loss in [(10, 0.1), (20, 0.3), (30, 0.4), (40, 0.5)]:
        local = str(tmp_path / str(step))
        os.makedirs(local)
        ckpt.write(pafs.LocalFileSystem(), local, {"step": step}, f"model_{step}.pt", {"loss": loss})
        pafs.copy_files(local, f"{run}/{ckpt.dir_name(step)}", destination_filesystem=direct)
    best_manifest = f"/{run}/{ckpt.dir_name(10)}/{ckpt.MANIFEST}"
    proxy = FaultyProxy(s3_server, lambda method, path: path == best_manifest, times=20)
    try:
        # one try: the client's own retries, with their back-off, would only take the tier seconds
        through_proxy = pafs.S3FileSystem(endpoint_override=proxy.url.removeprefix("http://"), scheme="http",
                                          retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
        deleted = ckpt.prune(through_proxy, run, 1, "loss", "min")
    finally:
        proxy.close()
    assert proxy.failed, ("the proxy must have answered 503", proxy.passed)
    assert deleted == []
    steps = [ckpt.step_of(os.path.basename(p["path"])) for p in ckpt.list_checkpoints(direct, run)]
    assert steps == [10, 20, 30, 40]
    assert any("skipped this round" in line and ckpt.dir_name(10) in line for line in said), said
    assert ckpt.prune(direct, run, 1, "loss", "min") == [20, 30]  # the next round goes ahead


def s3_run(s3_server, tmp_path, bucket: str, losses: list[tuple[int, float]]) -> tuple[pafs.S3FileSystem, str]:
    """Checkpoints with these (step, loss) in ``bucket``/job/checkpoints of the moto server."""
    import boto3

    boto3.client("s3").create_bucket(Bucket=bucket)
    direct = pafs.S3FileSystem(endpoint_override=s3_server.removeprefix("http://"), scheme="http")
    run = f"{bucket}/job/checkpoints"
    for step, loss in losses:
        local = str(tmp_path / str(step))
        os.makedirs(local)
        ckpt.write(pafs.LocalFileSystem(), local, {"step": step}, f"model_{step}.pt", {"loss": loss})
        pafs.copy_files(local, f"{run}/{ckpt.dir_name(step)}", destination_filesystem=direct)
    return direct, run


def bucket_keys(bucket: str) -> list[str]:
    import boto3

    return sorted(o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket).get("Contents", []))


def test_a_retention_round_on_s3_is_one_listing_and_one_delete(s3_server, tmp_path):
    """Every doomed folder goes in one DeleteObjects request, folder marker included (pyarrow's
    delete_dir cost five requests a folder); a known checkpoint's manifest is not read again."""
    import boto3
    from faulty_proxy import FaultyProxy

    direct, run = s3_run(s3_server, tmp_path, "prune-batch", [(10, 0.5), (20, 0.4), (30, 0.3), (40, 0.2)])
    boto3.client("s3").put_object(Bucket="prune-batch", Key=f"job/checkpoints/{ckpt.dir_name(20)}/", Body=b"")
    known: dict = {}
    assert ckpt.prune(direct, run, 4, None, "min", known=known) == []  # reads all four manifests
    (tmp_path / "50").mkdir()
    ckpt.write(pafs.LocalFileSystem(), str(tmp_path / "50"), {"step": 50}, "model_50.pt", {"loss": 0.1})
    pafs.copy_files(str(tmp_path / "50"), f"{run}/{ckpt.dir_name(50)}", destination_filesystem=direct)
    proxy = FaultyProxy(s3_server, lambda method, path: False)
    try:
        through_proxy = pafs.S3FileSystem(endpoint_override=proxy.url.removeprefix("http://"), scheme="http")
        assert ckpt.prune(through_proxy, run, 1, None, "min", known=known) == [10, 20, 30, 40]
    finally:
        proxy.close()
    requests = [(method, path) for method, path, _ in proxy.passed]
    manifest_50 = f"/{run}/{ckpt.dir_name(50)}/{ckpt.MANIFEST}"
    # The listing, the new checkpoint's manifest (pyarrow opens a file with a HEAD), one delete.
    assert requests == [("GET", "/prune-batch"), ("HEAD", manifest_50), ("GET", manifest_50),
                        ("POST", "/prune-batch")], requests
    assert all(status < 300 for *_, status in proxy.passed), proxy.passed
    assert bucket_keys("prune-batch") == [f"job/checkpoints/{ckpt.dir_name(50)}/{name}"
                                          for name in (ckpt.MANIFEST, "model_50.pt")]


def test_a_failed_delete_is_said_and_the_next_round_deletes(s3_server, tmp_path, monkeypatch, said):
    """S3 refuses the delete past the client's retries: training goes on (retention is
    housekeeping), the round says what it could not delete, and the next round deletes it."""
    from faulty_proxy import FaultyProxy

    from cluster import storage

    # boto3's back-off would only add seconds here; the client is this test's own (the proxy's port)
    monkeypatch.setattr(storage, "S3_DELETE_ATTEMPTS", 1)

    direct, run = s3_run(s3_server, tmp_path, "prune-refused", [(10, 0.5), (20, 0.4), (30, 0.3)])
    proxy = FaultyProxy(s3_server, lambda method, path: method == "POST", times=20)
    known: dict = {}
    try:
        # pyarrow's own retries (it gets the round after boto3) would only add their back-off here
        through_proxy = pafs.S3FileSystem(endpoint_override=proxy.url.removeprefix("http://"), scheme="http",
                                          retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
        assert ckpt.prune(through_proxy, run, 1, None, "min", known=known) == []
    finally:
        proxy.close()
    assert proxy.failed, ("the proxy must have refused the delete", proxy.passed)
    assert len(said) == 1 and "could not delete" in said[0] and "the next round tries again" in said[0], said
    assert ckpt.dir_name(10) in said[0] and ckpt.dir_name(20) in said[0] and "SlowDown" in said[0], said
    assert len(bucket_keys("prune-refused")) == 6, "nothing was deleted"
    assert ckpt.prune(direct, run, 1, None, "min", known=known) == [10, 20]
    assert len(bucket_keys("prune-refused")) == 2


ACCESS_DENIED = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>'
# What S3 answers a DeleteObjects whose keys this identity may not delete: 200, an Error per key.
KEYS_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?><DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
               b"<Error><Key>job/checkpoints/checkpoint_000000010/manifest.json</Key><Code>AccessDenied</Code>"
               b"<Message>Access Denied</Message></Error></DeleteResult>")


@pytest.mark.parametrize("status,answer", [(403, ACCESS_DENIED), (200, KEYS_DENIED)], ids=["request", "per-key"])
def test_deletes_boto3_is_refused_go_through_pyarrow_from_then_on(s3_server, tmp_path, status, answer, said):
    """boto3's credential chain can find other credentials than pyarrow's (the AWS C++ SDK's), or
    none; S3 refuses a whole request (403) or each key (200, an Error per key). Old checkpoints must
    not pile up for it: that round deletes through pyarrow, and so do the rounds after it, without
    asking boto3 again; it is said once, with what to check."""
    from faulty_proxy import FaultyProxy

    bucket = f"prune-denied-{status}"
    direct, run = s3_run(s3_server, tmp_path, bucket, [(10, 0.5), (20, 0.4), (30, 0.3)])
    proxy = FaultyProxy(s3_server, lambda method, path: method == "POST", times=1, status=status, answer=answer)
    try:
        through_proxy = pafs.S3FileSystem(endpoint_override=proxy.url.removeprefix("http://"), scheme="http",
                                          region="eu-north-1")  # a client of its own, not the other tests'
        assert ckpt.prune(through_proxy, run, 1, None, "min") == [10, 20]
        assert proxy.failed == [("POST", f"/{bucket}")], "boto3 was refused once"
        (tmp_path / "40").mkdir()
        ckpt.write(pafs.LocalFileSystem(), str(tmp_path / "40"), {"step": 40}, "model_40.pt", {"loss": 0.2})
        pafs.copy_files(str(tmp_path / "40"), f"{run}/{ckpt.dir_name(40)}", destination_filesystem=direct)
        proxy.passed.clear()
        assert ckpt.prune(through_proxy, run, 1, None, "min") == [30]
    finally:
        proxy.close()
    # pyarrow's delete_dir starts with a HEAD of the folder; boto3's batch has none.
    assert ("HEAD", f"/{run}/{ckpt.dir_name(30)}", 404) in proxy.passed, proxy.passed
    # pyarrow keeps the parent folder's marker when it deletes the last folder in it
    assert bucket_keys(bucket) == ["job/checkpoints/"] + [f"job/checkpoints/{ckpt.dir_name(40)}/{name}"
                                                          for name in (ckpt.MANIFEST, "model_40.pt")]
    assert len(said) == 1 and "through pyarrow from now on" in said[0] and "AccessDenied" in said[0], said
    assert "AWS_PROFILE" in said[0] and "AWS_CA_BUNDLE" in said[0], said


def test_where_boto3_cannot_be_set_up_pyarrow_deletes(s3_server, tmp_path, monkeypatch):
    """A profile boto3 cannot find (the AWS C++ SDK behind pyarrow goes on without it) must not
    stop retention, nor the checkpointer that sets the client up before training."""
    from cluster.storage import s3_client_like

    direct, run = s3_run(s3_server, tmp_path, "prune-no-boto3", [(10, 0.5), (20, 0.4)])
    monkeypatch.setenv("AWS_PROFILE", "etrain-no-such-profile")
    fs = pafs.S3FileSystem(endpoint_override=s3_server.removeprefix("http://"), scheme="http", region="ap-south-2")
    assert s3_client_like(fs) is None
    assert ckpt.prune(fs, run, 1, None, "min") == [10]
    monkeypatch.delenv("AWS_PROFILE")  # for this test's own look at the bucket
    assert [k.split("/")[2] for k in bucket_keys("prune-no-boto3") if k.count("/") == 3] == [ckpt.dir_name(20)] * 2


def test_which_boto3_errors_may_pass_by_themselves():
    from botocore.exceptions import (ClientError, EndpointConnectionError, NoCredentialsError, ProxyConnectionError,
                                     ReadTimeoutError, SSLError)

    from cluster.storage import transient_s3_error

    def client_error(status: int, code: str) -> ClientError:
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "DeleteObjects")

    assert transient_s3_error(client_error(503, "SlowDown"))
    assert transient_s3_error(client_error(500, "InternalError"))
    assert transient_s3_error(client_error(429, "TooManyRequests"))
    assert transient_s3_error(client_error(409, "OperationAborted"))
    assert transient_s3_error(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert transient_s3_error(ReadTimeoutError(endpoint_url="http://127.0.0.1:1"))
    assert not transient_s3_error(client_error(403, "AccessDenied"))
    assert not transient_s3_error(client_error(501, "NotImplemented"))
    assert not transient_s3_error(NoCredentialsError())
    assert not transient_s3_error(SSLError(endpoint_url="https://minio.local", error="certificate verify failed"))
    assert not transient_s3_error(ProxyConnectionError(proxy_url="http://proxy:3128", error="refused"))


@pytest.mark.parametrize("options,endpoint", [
    ({"endpoint_override": "127.0.0.1:5", "scheme": "http", "region": "eu-west-1"}, "http://127.0.0.1:5"),
    ({"endpoint_override": "minio.local:9000", "region": "eu-west-1"}, "https://minio.local:9000"),
    ({"anonymous": True, "region": "eu-west-1"}, None),
    ({"role_arn": "arn:aws:iam::1:role/r", "region": "eu-west-1"}, None),
    ({"proxy_options": "http://proxy:3128", "region": "eu-west-1"}, None),
])
def test_retention_deletes_through_boto3_only_where_it_reaches_what_pyarrow_reaches(options, endpoint):
    """Where boto3 could not be set up exactly as the filesystem is (an assumed role, anonymous,
    a proxy), deletes go through pyarrow."""
    from cluster.storage import s3_client_like

    client = s3_client_like(pafs.S3FileSystem(**options))
    if endpoint is None:
        assert client is None
    else:
        assert client.meta.endpoint_url == endpoint and client.meta.region_name == "eu-west-1"


def test_an_uploading_newer_checkpoint_protects_the_verified_one(tmp_path):
    """Ray uploads a checkpoint file by file, so its manifest can land before its state file:
    until every file is there at its size it does not count as complete."""
    run = str(tmp_path)
    make(run, 10)
    uploading = make(run, 20)
    os.remove(os.path.join(uploading, "model_20.pt"))  # the manifest is there, the state file not yet
    assert ckpt.prune(pafs.LocalFileSystem(), run, 1, None, "min") == []
    assert sorted(os.listdir(run)) == [ckpt.dir_name(10), ckpt.dir_name(20)]
    with open(os.path.join(uploading, "model_20.pt"), "wb") as f:
        f.write(b"x" * 10)  # a part of the file
    assert ckpt.prune(pafs.LocalFileSystem(), run, 1, None, "min") == []


def test_prune_reads_a_complete_checkpoint_once_across_rounds(tmp_path, monkeypatch):
    """At every checkpoint retention runs again; a complete checkpoint does not change, so a
    round reads only folders it has not seen complete (S3: three requests per kept checkpoint)."""
    run = str(tmp_path)
    reads = []
    real = ckpt.retention_entry
    monkeypatch.setattr(ckpt, "retention_entry",
                        lambda fs, path, step, metric, sizes: reads.append(step) or real(fs, path, step, metric, sizes))
    known: dict = {}
    make(run, 10)
    uploading = make(run, 20)
    os.remove(os.path.join(uploading, "model_20.pt"))  # not complete yet: read again next round
    assert ckpt.prune(pafs.LocalFileSystem(), run, 1, None, "min", known=known) == []
    assert sorted(reads) == [10, 20]
    ckpt.write(pafs.LocalFileSystem(), uploading, {"step": 20}, "model_20.pt")  # its upload finished
    make(run, 30)
    reads.clear()
    assert ckpt.prune(pafs.LocalFileSystem(), run, 1, None, "min", known=known) == [10, 20]
    assert sorted(reads) == [20, 30]  # 10 was known complete
    reads.clear()
    make(run, 40)
    assert ckpt.prune(pafs.LocalFileSystem(), run, 1, None, "min", known=known) == [30]
    assert reads == [40]
    assert sorted(known) == [os.path.join(run, ckpt.dir_name(40))]  # deleted ones are forgotten


def test_a_checkpoint_streams_to_s3_as_two_objects_and_a_failed_state_upload_leaves_no_manifest(s3_server):
    """The state goes straight to the bucket (no local copy, no folder markers), then the manifest
    that vouches for it; when the state's upload fails, no manifest is written, so the folder
    can never be restored or counted complete."""
    import boto3
    from faulty_proxy import FaultyProxy

    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="stream")
    direct = pafs.S3FileSystem(endpoint_override=s3_server.removeprefix("http://"), scheme="http",
                               allow_delayed_open=True)  # as cluster.storage opens it: a small file is one PUT
    path = f"stream/job/checkpoints/{ckpt.dir_name(10)}"
    state = {"step": 10, "w": torch.arange(100_000.0)}
    manifest = ckpt.write(direct, path, state, "model_10.pt", {"loss": 0.5})
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="stream")["Contents"])
    assert keys == [f"job/checkpoints/{ckpt.dir_name(10)}/{name}" for name in (ckpt.MANIFEST, "model_10.pt")]
    verified, problem = ckpt.verify(direct, path)
    assert problem is None and verified["files"] == manifest["files"]
    assert ckpt.kept(manifest, "loss", 10) == ckpt.Kept(10, 0.5, True)
    assert torch.equal(ckpt.load_state(direct, path)["w"], state["w"])

    failing = f"stream/job/checkpoints/{ckpt.dir_name(20)}"
    proxy = FaultyProxy(s3_server, lambda method, p: method == "PUT" and p.endswith("model_20.pt"), times=50)
    try:
        through_proxy = pafs.S3FileSystem(endpoint_override=proxy.url.removeprefix("http://"), scheme="http",
                                          allow_delayed_open=True)
        with pytest.raises(OSError):
            ckpt.write(through_proxy, failing, {"step": 20}, "model_20.pt")
    finally:
        proxy.close()
    assert proxy.failed
    assert ckpt.verify(direct, failing) == (None, "no manifest.json (the checkpoint was never completed)")


def test_a_fresh_folder_is_written_in_two_puts_and_one_written_again_is_cleared_first(s3_server):
    """On S3 a write is the state's PUT and the manifest's; the old-manifest delete before them
    (pyarrow's delete starts with a HEAD) only where the caller does not know the folder is new."""
    import boto3
    from faulty_proxy import FaultyProxy

    boto3.client("s3").create_bucket(Bucket="fresh")
    proxy = FaultyProxy(s3_server, lambda method, path: False)
    try:
        fs = pafs.S3FileSystem(endpoint_override=proxy.url.removeprefix("http://"), scheme="http",
                               allow_delayed_open=True)
        folder = f"fresh/job/checkpoints/{ckpt.dir_name(10)}"
        ckpt.write(fs, folder, {"step": 10}, "model_10.pt", fresh=True)
        first = [(method, path) for method, path, _ in proxy.passed]
        proxy.passed.clear()
        ckpt.write(fs, folder, {"step": 10, "again": True}, "model_10.pt")
        again = [(method, path) for method, path, _ in proxy.passed]
    finally:
        proxy.close()
    state, manifest = f"/{folder}/model_10.pt", f"/{folder}/{ckpt.MANIFEST}"
    assert first == [("PUT", state), ("PUT", manifest)], first
    assert again[0] == ("HEAD", manifest) and ("DELETE", manifest) in again, again
    assert again.index(("DELETE", manifest)) < again.index(("PUT", state)), again
    assert ckpt.load_state(fs, folder)["again"] is True


def test_a_folder_written_again_loses_its_old_manifest_before_the_new_state(tmp_path, monkeypatch):
    """A retry writes checkpoint N again where a good one was skipped: the old manifest must not
    vouch for a new state file that never finished (retention checks sizes only)."""
    fs = pafs.LocalFileSystem()
    d = str(tmp_path / ckpt.dir_name(10))
    ckpt.write(fs, d, {"step": 10, "w": torch.ones(4)}, "model_10.pt")

    def failing_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt.write(fs, d, {"step": 10, "w": torch.zeros(4)}, "model_10.pt")
    assert ckpt.verify(fs, d) == (None, "no manifest.json (the checkpoint was never completed)")
