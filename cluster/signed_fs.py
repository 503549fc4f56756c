"""A pyarrow filesystem that signs what it writes and reads back only what it signed.

Ray Tune keeps a sweep's state (``tuner.pkl``, ``experiment_state-*.json`` with cloudpickled
parts, searcher and callback pickles, trial error pickles) in the sweep's storage and
unpickles it on ``Tuner.restore``. A ``user`` tenant can write its own storage prefix
directly, so a file planted there would be code run by the service's Ray. Wrapping the
storage filesystem given to Tune (``RunConfig(storage_filesystem=...)`` and
``Tuner.restore(..., storage_filesystem=...)``) in :func:`signed_filesystem` makes every
file Tune reads back one the sweep's driver wrote: each write leaves an HMAC-SHA256 tag
beside the file (``<file>.etrain-sig``, one per file, so concurrent writers of different
files never race on a shared manifest); each read is read whole, checked, and only then
handed out.

The tag binds the file's path relative to ``base_path`` and the SHA-256 of its content, so
a tag cannot be reused for another file, another path or changed content. It does not bind a
version: a tenant can put back an older file that the driver wrote at the same path (still
driver-written data, never the tenant's).

The key never travels with the filesystem: pickled (Tune pickles its ``RunConfig`` into
``tuner.pkl`` and each trial's storage context into the experiment state, both of which the
tenant can read), the handler carries only the key's fingerprint, and the unpickled copy
finds the key again in its process (keys given to :func:`signed_filesystem` there) or in
``$ETRAIN_STATE_KEY``. A copy without its key lists and deletes but refuses to read or write.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import os
import posixpath
import secrets
import threading
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.fs as pafs

logger = logging.getLogger(__name__)

TAG_SUFFIX = ".etrain-sig"
KEY_ENV = "ETRAIN_STATE_KEY"  # hex; how a process that did not build the filesystem (a Ray worker) gets the key
MIN_KEY_BYTES = 32
_DOMAIN = b"etrain/signed-fs/v1"
_TAG_HEADER = b"etrain-sig v1 "
_MAX_TAG_BYTES = 256  # a tag file is one short line; anything longer is not ours

_KEYS: dict[str, bytes] = {}  # fingerprint -> key, for the copies Ray and Tune unpickle in this process
_KEYS_LOCK = threading.Lock()


class UnverifiedFileError(PermissionError):
    """A file the signed filesystem will not hand out: no tag, a wrong tag, or outside its base."""


class SigningKeyUnavailableError(RuntimeError):
    """A signed filesystem unpickled in a process that does not hold its key."""


def new_key() -> str:
    """A fresh signing key as hex (what a sweep's record keeps, where no tenant can read it)."""
    return secrets.token_hex(MIN_KEY_BYTES)


def key_from_hex(text: str) -> bytes:
    """The key bytes from :func:`new_key`'s hex; refuses short or malformed keys."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError as e:
        raise ValueError(f"signing key: not hex ({e}); make one with cluster.signed_fs.new_key()") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"signing key: {len(key)} bytes, at least {MIN_KEY_BYTES} needed; "
                         "make one with cluster.signed_fs.new_key()")
    return key


def key_fingerprint(key: bytes) -> str:
    """A public name for a key (safe to store): which key a pickled filesystem needs."""
    return hmac.new(key, _DOMAIN + b"\0key-id", hashlib.sha256).hexdigest()[:32]


def signed_filesystem(fs: pafs.FileSystem, base_path: str, key: bytes) -> pafs.FileSystem:
    """``fs`` with every file written tagged and every file read checked against its tag.

    ``base_path`` is the folder (in ``fs``'s own path form) that tags are relative to: the
    sweep's storage folder, so the same tree verifies wherever it is mounted from. Paths
    outside it are refused for reading and writing.
    """
    if not isinstance(key, bytes | bytearray) or len(key) < MIN_KEY_BYTES:
        raise ValueError(f"signing key: bytes of at least {MIN_KEY_BYTES} needed (cluster.signed_fs.key_from_hex)")
    key = bytes(key)
    fingerprint = key_fingerprint(key)
    with _KEYS_LOCK:
        _KEYS[fingerprint] = key
    return pafs.PyFileSystem(SignedHandler(fs, base_path, key, fingerprint))


def verify_folder(fs: pafs.FileSystem, folder: str, suffixes: tuple[str, ...] = (".json", ".pkl"),
                  recursive: bool = False) -> list[str]:
    """Read every file in ``folder`` ending in ``suffixes`` through ``fs``; raise naming all that are refused.

    Tune's controller catches a failed resume and starts the sweep over ("Failed to restore the
    run state ... Restarting experiment", unless ``fail_fast``), so a refused searcher or callback
    state would pass unnoticed: a sweep driver checks the files Tune will read (the experiment
    folder's ``.json`` and ``.pkl``, as its resume copies them) before ``Tuner.restore``.
    Returns the paths checked.
    """
    selector = pafs.FileSelector(folder, recursive=recursive)
    paths = sorted(i.path for i in fs.get_file_info(selector)
                   if i.type == pafs.FileType.File and i.path.endswith(suffixes))
    refused = []
    for path in paths:
        try:
            with fs.open_input_stream(path):
                pass
        except UnverifiedFileError as e:
            refused.append(str(e))
    if refused:
        raise UnverifiedFileError(f"{folder}: {len(refused)} file(s) refused, the sweep's state cannot be trusted: "
                                  + "; ".join(refused[:5]))
    return paths


def _key_for(fingerprint: str) -> bytes | None:
    """The key a pickled handler names: this process's, else ``$ETRAIN_STATE_KEY`` if it matches."""
    with _KEYS_LOCK:
        key = _KEYS.get(fingerprint)
    if key is not None:
        return key
    text = os.environ.get(KEY_ENV)
    if not text:
        return None
    try:
        key = key_from_hex(text)
    except ValueError:
        logger.warning("$%s is set but is not a signing key: signed storage stays unreadable here", KEY_ENV)
        return None
    if key_fingerprint(key) != fingerprint:
        return None
    with _KEYS_LOCK:
        _KEYS[fingerprint] = key
    return key


def _unpickle_handler(fs: pafs.FileSystem, base_path: str, fingerprint: str) -> SignedHandler:
    return SignedHandler(fs, base_path, _key_for(fingerprint), fingerprint)


def _norm(path: str) -> str:
    """A path with ``..``, ``.`` and doubled or trailing slashes resolved, so a tag's path is one spelling."""
    if path in ("", "."):
        return ""
    normed = posixpath.normpath(path)
    return "" if normed == "." else normed


def _is_tag(path: str) -> bool:
    return path.endswith(TAG_SUFFIX)


class _SigningSink(io.RawIOBase):
    """What a write goes through: streams to the inner file, hashing, and tags it on close.

    The tag is written after the data is closed, so a reader in between finds no tag (or the
    old one) and is refused rather than handed half a file.
    """

    def __init__(self, handler: SignedHandler, path: str, metadata, prefix: bytes = b""):
        super().__init__()
        self._handler, self._path = handler, path
        self._out = handler.fs.open_output_stream(path, metadata=metadata)
        self._sha = hashlib.sha256()
        self._written = 0
        if prefix:
            self.write(prefix)

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._sha.update(view)
        self._out.write(view)
        self._written += len(view)
        return len(view)

    def tell(self) -> int:
        return self._written

    def flush(self) -> None:
        if not self._out.closed:  # io's close() flushes after the inner file is closed
            self._out.flush()

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._out.close()
            self._handler._write_tag(self._path, self._sha.digest())
        finally:
            super().close()


class SignedHandler(pafs.FileSystemHandler):
    """The handler behind :func:`signed_filesystem`; see the module's docstring for why."""

    def __init__(self, fs: pafs.FileSystem, base_path: str, key: bytes | None, fingerprint: str):
        self.fs = fs
        self.base_path = _norm(base_path)
        self._key = key
        self.fingerprint = fingerprint

    def __reduce__(self):
        # The key stays out of every pickle: Tune writes this handler into storage the tenant reads.
        return _unpickle_handler, (self.fs, self.base_path, self.fingerprint)

    def __eq__(self, other) -> bool:
        return (isinstance(other, SignedHandler) and self.fs.equals(other.fs)
                and self.base_path == other.base_path and self.fingerprint == other.fingerprint)

    def __ne__(self, other) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((self.base_path, self.fingerprint))

    # --- tags

    def _relative(self, path: str) -> str:
        """``path`` relative to the base; a path outside it has no tag that could vouch for it."""
        normed, base = _norm(path), self.base_path
        if base in ("", "/"):
            return normed.lstrip("/")
        if normed.startswith(base + "/"):
            return normed[len(base) + 1:]
        raise UnverifiedFileError(f"{path}: outside the signed storage folder {base!r}: not read or written "
                                  "through the signed filesystem")

    def _need_key(self) -> bytes:
        if self._key is None:
            raise SigningKeyUnavailableError(
                f"the signing key {self.fingerprint} for {self.base_path!r} is not in this process: build the "
                f"filesystem with cluster.signed_fs.signed_filesystem(...) here, or set ${KEY_ENV}")
        return self._key

    def _tag(self, path: str, content_sha256: bytes) -> bytes:
        rel = self._relative(path).encode()
        message = _DOMAIN + b"\0" + rel + b"\0" + content_sha256
        return hmac.new(self._need_key(), message, hashlib.sha256).hexdigest().encode()

    def _write_tag(self, path: str, content_sha256: bytes) -> None:
        with self.fs.open_output_stream(path + TAG_SUFFIX) as out:
            out.write(_TAG_HEADER + self._tag(path, content_sha256) + b"\n")

    def _read_verified(self, path: str, tag_path: str | None = None, as_path: str | None = None) -> bytes:
        """The whole of ``path``, once its tag (``tag_path``, bound to ``as_path``) vouches for it."""
        if _is_tag(path):
            raise UnverifiedFileError(f"{path}: a signature file, not read through the signed filesystem")
        as_path = as_path or path
        self._relative(as_path)
        self._need_key()
        with self.fs.open_input_stream(path) as f:
            data = f.readall()
        refusal = f"{path}: was not written by this sweep's driver, or was changed since: not read"
        try:
            with self.fs.open_input_stream(tag_path or path + TAG_SUFFIX) as f:
                stored = f.read(_MAX_TAG_BYTES + 1)
        except FileNotFoundError:
            logger.warning("refused %s: no signature beside it", path)
            raise UnverifiedFileError(f"{refusal} (no signature file)") from None
        expected = _TAG_HEADER + self._tag(as_path, hashlib.sha256(data).digest()) + b"\n"
        if len(stored) > _MAX_TAG_BYTES or not hmac.compare_digest(stored, expected):
            logger.warning("refused %s: its signature does not match", path)
            raise UnverifiedFileError(f"{refusal} (signature does not match)")
        return data

    def _write_signed(self, path: str, data: bytes, metadata=None) -> None:
        self._check_writable(path)
        sink = _SigningSink(self, path, metadata)
        sink.write(data)
        sink.close()

    def _check_writable(self, path: str) -> None:
        if _is_tag(path):
            raise UnverifiedFileError(f"{path}: names a signature file; the signed filesystem writes those itself")
        self._relative(path)
        self._need_key()

    def _delete_tag(self, path: str) -> None:
        try:
            self.fs.delete_file(path + TAG_SUFFIX)
        except FileNotFoundError:
            pass

    # --- FileSystemHandler

    def get_type_name(self) -> str:
        return f"etrain-signed+{self.fs.type_name}"

    def normalize_path(self, path: str) -> str:
        return self.fs.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        infos = self.fs.get_file_info(list(paths))
        return [pafs.FileInfo(i.path, pafs.FileType.NotFound) if _is_tag(i.path) else i for i in infos]

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return [i for i in self.fs.get_file_info(selector) if not _is_tag(i.path)]

    def create_dir(self, path: str, recursive: bool) -> None:
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.fs.delete_dir(path)  # the tags are inside it

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        self.fs.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        self.fs.delete_file(path)
        self._delete_tag(path)

    def move(self, src: str, dest: str) -> None:
        """Move, then re-tag each moved file for its new path once its old tag vouches for it.

        A file whose old tag does not match keeps no valid tag (so it stays unreadable) and the
        move raises: moving never launders a planted or changed file.
        """
        self._check_writable(dest)
        self._relative(src)
        info = self.fs.get_file_info(src)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"{src}: no such file or folder to move")
        self.fs.move(src, dest)
        if info.type == pafs.FileType.File:
            try:
                self.fs.move(src + TAG_SUFFIX, dest + TAG_SUFFIX)
            except FileNotFoundError:
                pass  # refused just below
            moved = [(dest, src)]
        else:
            selector = pafs.FileSelector(dest, recursive=True)
            moved = [(i.path, posixpath.join(_norm(src), posixpath.relpath(_norm(i.path), _norm(dest))))
                     for i in self.fs.get_file_info(selector) if i.type == pafs.FileType.File and not _is_tag(i.path)]
        refused = self._retag(moved)
        if refused:
            raise UnverifiedFileError(f"moved {src} to {dest}, but {len(refused)} file(s) in it were not written "
                                      f"by this sweep's driver, or were changed since, and stay unreadable: "
                                      f"{', '.join(refused[:5])}")

    def _retag(self, moved: Iterable[tuple[str, str]]) -> list[str]:
        refused = []
        for new, old in moved:
            try:
                data = self._read_verified(new, tag_path=new + TAG_SUFFIX, as_path=old)
            except UnverifiedFileError:
                self._delete_tag(new)
                refused.append(new)
                continue
            self._write_tag(new, hashlib.sha256(data).digest())
        return refused

    def copy_file(self, src: str, dest: str) -> None:
        self._check_writable(dest)
        self._write_signed(dest, self._read_verified(src))

    def open_input_stream(self, path: str) -> pa.NativeFile:
        return pa.BufferReader(self._read_verified(path))

    def open_input_file(self, path: str) -> pa.NativeFile:
        return pa.BufferReader(self._read_verified(path))

    def open_output_stream(self, path: str, metadata) -> pa.NativeFile:
        self._check_writable(path)
        return pa.PythonFile(_SigningSink(self, path, metadata), mode="w")

    def open_append_stream(self, path: str, metadata) -> pa.NativeFile:
        """An append rewrites the file whole (old content checked first): the tag covers all of it."""
        self._check_writable(path)
        exists = self.fs.get_file_info(path).type == pafs.FileType.File
        prefix = self._read_verified(path) if exists else b""
        return pa.PythonFile(_SigningSink(self, path, metadata, prefix=prefix), mode="w")
