"""The signed filesystem: what Tune reads back from a sweep's storage is what the sweep's driver wrote."""

from __future__ import annotations

import pickle
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from cluster.signed_fs import (
    KEY_ENV,
    TAG_SUFFIX,
    SigningKeyUnavailableError,
    UnverifiedFileError,
    key_from_hex,
    new_key,
    signed_filesystem,
)

KEY = key_from_hex(new_key())


@pytest.fixture
def base(tmp_path: Path) -> Path:
    base = tmp_path / "sweep"
    base.mkdir()
    return base


@pytest.fixture
def fs(base: Path) -> pafs.FileSystem:
    return signed_filesystem(pafs.LocalFileSystem(), str(base), KEY)


def write(fs: pafs.FileSystem, path: Path | str, data: bytes) -> None:
    with fs.open_output_stream(str(path)) as out:
        out.write(data)


def read(fs: pafs.FileSystem, path: Path | str) -> bytes:
    with fs.open_input_stream(str(path)) as f:
        return f.readall()


def test_a_written_file_reads_back_whole_through_both_kinds_of_open(fs, base):
    data = b"tuner state " * 10_000
    fs.create_dir(str(base / "tune"))
    write(fs, base / "tune" / "tuner.pkl", data)
    assert read(fs, base / "tune" / "tuner.pkl") == data
    with fs.open_input_file(str(base / "tune" / "tuner.pkl")) as f:
        assert f.size() == len(data) and f.read_at(6, 6) == b"state "
    assert (base / "tune" / ("tuner.pkl" + TAG_SUFFIX)).exists()


def test_a_byte_flipped_after_writing_is_refused(fs, base):
    path = base / "experiment_state-1.json"
    write(fs, path, b'{"trial_data": []}')
    raw = bytearray(path.read_bytes())
    raw[3] ^= 0x01  # same length, one byte changed
    path.write_bytes(bytes(raw))
    with pytest.raises(UnverifiedFileError, match=r"experiment_state-1\.json: was not written by this sweep's driver, "
                                                  r"or was changed since: not read \(signature does not match\)"):
        read(fs, path)


def test_a_planted_file_without_a_tag_is_refused(fs, base):
    (base / "tuner.pkl").write_bytes(pickle.dumps({"planted": True}))
    with pytest.raises(UnverifiedFileError, match=r"tuner\.pkl: was not written .* \(no signature file\)"):
        read(fs, base / "tuner.pkl")
    with pytest.raises(UnverifiedFileError):
        fs.open_input_file(str(base / "tuner.pkl"))


def test_a_tag_copied_from_another_file_is_refused(fs, base):
    write(fs, base / "a.pkl", b"honest")
    (base / "b.pkl").write_bytes(b"honest")  # even the same content: the tag names its path
    (base / ("b.pkl" + TAG_SUFFIX)).write_bytes((base / ("a.pkl" + TAG_SUFFIX)).read_bytes())
    with pytest.raises(UnverifiedFileError, match="signature does not match"):
        read(fs, base / "b.pkl")


def test_a_file_written_with_another_key_is_refused(fs, base):
    other = signed_filesystem(pafs.LocalFileSystem(), str(base), key_from_hex(new_key()))
    write(other, base / "searcher-state.pkl", b"state")
    assert read(other, base / "searcher-state.pkl") == b"state"
    with pytest.raises(UnverifiedFileError, match="signature does not match"):
        read(fs, base / "searcher-state.pkl")


def test_listings_hide_the_tag_files(fs, base):
    fs.create_dir(str(base / "trial_0"))
    write(fs, base / "tuner.pkl", b"t")
    write(fs, base / "trial_0" / "result.json", b"{}")
    top = fs.get_file_info(pafs.FileSelector(str(base)))
    assert sorted(Path(i.path).name for i in top) == ["trial_0", "tuner.pkl"]
    everything = fs.get_file_info(pafs.FileSelector(str(base), recursive=True))
    assert sorted(Path(i.path).name for i in everything) == ["result.json", "trial_0", "tuner.pkl"]
    assert fs.get_file_info(str(base / ("tuner.pkl" + TAG_SUFFIX))).type == pafs.FileType.NotFound
    with pytest.raises(UnverifiedFileError, match="signature file"):
        write(fs, base / ("tuner.pkl" + TAG_SUFFIX), b"forged")


def test_a_moved_file_or_folder_reads_back_at_its_new_path(fs, base):
    write(fs, base / "old.pkl", b"one")
    fs.move(str(base / "old.pkl"), str(base / "new.pkl"))
    assert read(fs, base / "new.pkl") == b"one"
    assert not (base / "old.pkl").exists() and not (base / ("old.pkl" + TAG_SUFFIX)).exists()

    fs.create_dir(str(base / "a" / "b"))
    write(fs, base / "a" / "b" / "c.json", b"two")
    fs.move(str(base / "a"), str(base / "z"))
    assert read(fs, base / "z" / "b" / "c.json") == b"two"


def test_a_move_does_not_launder_a_changed_file(fs, base):
    write(fs, base / "old.pkl", b"one")
    (base / "old.pkl").write_bytes(b"two")
    with pytest.raises(UnverifiedFileError, match="stay unreadable"):
        fs.move(str(base / "old.pkl"), str(base / "new.pkl"))
    with pytest.raises(UnverifiedFileError, match="no signature file"):
        read(fs, base / "new.pkl")


def test_copy_and_delete_keep_the_tags_consistent(fs, base):
    write(fs, base / "a.json", b"a")
    fs.copy_file(str(base / "a.json"), str(base / "b.json"))
    assert read(fs, base / "b.json") == b"a"
    fs.delete_file(str(base / "a.json"))
    assert not (base / ("a.json" + TAG_SUFFIX)).exists()
    (base / "c.json").write_bytes(b"planted")
    with pytest.raises(UnverifiedFileError):
        fs.copy_file(str(base / "c.json"), str(base / "d.json"))
    assert not (base / "d.json").exists()


def test_an_append_keeps_the_file_signed_and_refuses_a_changed_start(fs, base):
    write(fs, base / "log.txt", b"one\n")
    with fs.open_append_stream(str(base / "log.txt")) as out:
        out.write(b"two\n")
    assert read(fs, base / "log.txt") == b"one\ntwo\n"
    (base / "log.txt").write_bytes(b"ONE\ntwo\n")
    with pytest.raises(UnverifiedFileError):
        fs.open_append_stream(str(base / "log.txt"))


def test_copy_files_out_of_the_signed_fs_works_for_honest_files_and_fails_for_a_tampered_one(fs, base, tmp_path):
    fs.create_dir(str(base / "tune" / "trial_0"))
    write(fs, base / "tune" / "tuner.pkl", b"t" * 100_000)
    write(fs, base / "tune" / "trial_0" / "params.json", b"{}")
    out = tmp_path / "download"
    pafs.copy_files(str(base / "tune"), str(out), source_filesystem=fs)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "trial_0/params.json", "tuner.pkl"]  # no tag files come along
    assert (out / "tuner.pkl").read_bytes() == b"t" * 100_000

    (base / "tune" / "trial_0" / "params.json").write_bytes(b"[]")
    with pytest.raises(UnverifiedFileError, match=r"params\.json: was not written"):
        pafs.copy_files(str(base / "tune"), str(tmp_path / "again"), source_filesystem=fs)


def test_copy_files_into_the_signed_fs_signs_each_file(fs, base, tmp_path):
    src = tmp_path / "staging"
    (src / "sub").mkdir(parents=True)
    (src / "experiment_state-1.json").write_text("{}")
    (src / "sub" / "searcher-state-1.pkl").write_bytes(b"s")
    pafs.copy_files(str(src), str(base / "tune"), destination_filesystem=fs)
    assert read(fs, base / "tune" / "sub" / "searcher-state-1.pkl") == b"s"
    assert read(fs, base / "tune" / "experiment_state-1.json") == b"{}"


def test_paths_outside_the_base_are_neither_read_nor_written(fs, tmp_path):
    (tmp_path / "elsewhere.pkl").write_bytes(b"x")
    with pytest.raises(UnverifiedFileError, match="outside the signed storage folder"):
        read(fs, tmp_path / "elsewhere.pkl")
    with pytest.raises(UnverifiedFileError, match="outside the signed storage folder"):
        write(fs, tmp_path / "sweep" / ".." / "escape.pkl", b"x")


def test_a_subtree_filesystem_signs_paths_relative_to_its_base(tmp_path):
    (tmp_path / "root" / "sweeps" / "s1").mkdir(parents=True)
    inner = pafs.SubTreeFileSystem(str(tmp_path / "root"), pafs.LocalFileSystem())
    fs = signed_filesystem(inner, "sweeps/s1", KEY)
    write(fs, "sweeps/s1/tuner.pkl", b"t")
    assert read(fs, "sweeps/s1/tuner.pkl") == b"t"
    # The same tree seen from the base itself verifies: tags name paths relative to the base.
    moved = signed_filesystem(pafs.LocalFileSystem(), str(tmp_path / "root" / "sweeps" / "s1"), KEY)
    assert read(moved, tmp_path / "root" / "sweeps" / "s1" / "tuner.pkl") == b"t"


def test_the_key_stays_out_of_a_pickled_filesystem(fs, base, monkeypatch):
    import cluster.signed_fs as signed_fs

    write(fs, base / "tuner.pkl", b"t")
    blob = pickle.dumps(fs)
    assert KEY not in blob and KEY.hex().encode() not in blob
    assert read(pickle.loads(blob), base / "tuner.pkl") == b"t"  # this process holds the key

    # A process without it (a Ray worker) lists but neither reads nor writes, unless $ETRAIN_STATE_KEY has it.
    monkeypatch.setattr(signed_fs, "_KEYS", {})
    monkeypatch.delenv(KEY_ENV, raising=False)
    keyless = pickle.loads(blob)
    assert [Path(i.path).name for i in keyless.get_file_info(pafs.FileSelector(str(base)))] == ["tuner.pkl"]
    with pytest.raises(SigningKeyUnavailableError, match=KEY_ENV):
        read(keyless, base / "tuner.pkl")
    with pytest.raises(SigningKeyUnavailableError):
        write(keyless, base / "other.pkl", b"x")
    monkeypatch.setenv(KEY_ENV, new_key())  # another key does not stand in for it
    with pytest.raises(SigningKeyUnavailableError):
        read(pickle.loads(blob), base / "tuner.pkl")
    monkeypatch.setenv(KEY_ENV, KEY.hex())
    assert read(pickle.loads(blob), base / "tuner.pkl") == b"t"


def test_keys_are_checked(fs):
    assert len(key_from_hex(new_key())) == 32
    with pytest.raises(ValueError, match="at least 32"):
        key_from_hex("ab" * 16)
    with pytest.raises(ValueError, match="not hex"):
        key_from_hex("not a key")
    with pytest.raises(ValueError, match="at least 32"):
        signed_filesystem(pafs.LocalFileSystem(), "/tmp", b"short")
    assert pickle.loads(pickle.dumps(fs)).equals(fs)


def test_on_s3_a_planted_object_is_refused_and_a_written_one_reads_back(s3_server):
    import boto3

    from cluster.storage import s3_filesystem

    boto3.client("s3").create_bucket(Bucket="etrain-signed")
    fs = signed_filesystem(s3_filesystem(), "etrain-signed/tenant/sweeps/s1", KEY)
    write(fs, "etrain-signed/tenant/sweeps/s1/tune/tuner.pkl", b"t")
    assert read(fs, "etrain-signed/tenant/sweeps/s1/tune/tuner.pkl") == b"t"
    listed = fs.get_file_info(pafs.FileSelector("etrain-signed/tenant/sweeps/s1/tune"))
    assert [Path(i.path).name for i in listed] == ["tuner.pkl"]
    # The tenant's own keys can write its prefix directly.
    boto3.client("s3").put_object(Bucket="etrain-signed", Key="tenant/sweeps/s1/tune/tuner.pkl", Body=b"planted")
    with pytest.raises(UnverifiedFileError, match="signature does not match"):
        read(fs, "etrain-signed/tenant/sweeps/s1/tune/tuner.pkl")
    boto3.client("s3").put_object(Bucket="etrain-signed", Key="tenant/sweeps/s1/tune/searcher-state-1.pkl", Body=b"x")
    with pytest.raises(UnverifiedFileError, match="no signature file"):
        read(fs, "etrain-signed/tenant/sweeps/s1/tune/searcher-state-1.pkl")


def test_verify_folder_names_every_refused_state_file(fs, base):
    from cluster.signed_fs import verify_folder

    write(fs, base / "experiment_state-1.json", b"{}")
    write(fs, base / "tuner.pkl", b"t")
    (base / "notes.txt").write_bytes(b"not state: not checked")
    assert [Path(p).name for p in verify_folder(fs, str(base))] == ["experiment_state-1.json", "tuner.pkl"]
    (base / "searcher-state-2.pkl").write_bytes(b"planted")
    (base / "basic-variant-state-2.json").write_bytes(b"planted")
    with pytest.raises(UnverifiedFileError, match=r"2 file\(s\) refused.*basic-variant-state-2\.json.*"
                                                  r"searcher-state-2\.pkl"):
        verify_folder(fs, str(base))
