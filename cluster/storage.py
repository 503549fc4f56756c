"""One storage root, local directory or ``s3://bucket/prefix``, read and written through pyarrow.fs.

Every durable thing a job has (checkpoints, datasets converted on first use, summaries)
lives under a root, so the same code serves a laptop and a cluster.
"""

from __future__ import annotations

import json
import os
import posixpath
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs

DEFAULT_ROOT_ENV = "ETRAIN_STORAGE_ROOT"
SUPPORTED_SCHEMES = ("", "file", "s3")


def default_root() -> str:
    """The storage root used when a spec names none: $ETRAIN_STORAGE_ROOT or ~/etrain-storage."""
    return os.environ.get(DEFAULT_ROOT_ENV) or str(Path.home() / "etrain-storage")


def check_uri(uri: str) -> str | None:
    """Return what is wrong with a storage URI, or None. Pure: touches nothing."""
    parsed = urlparse(uri)
    if parsed.scheme not in SUPPORTED_SCHEMES:
        return f"scheme {parsed.scheme!r} is not supported: use a local path, file:// or s3://bucket/prefix"
    if parsed.scheme == "s3":
        if not parsed.netloc:
            return "an s3:// URI needs a bucket: s3://bucket/prefix"
        if len(parsed.netloc) < 3:
            return "S3 bucket names have at least 3 characters"
    elif not uri.strip():
        return "empty path"
    return None


def s3_filesystem() -> pafs.S3FileSystem:
    """An S3 filesystem configured from the standard AWS settings.

    Region and credentials come from the usual AWS variables and files (pyarrow reads them);
    ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` points at an S3-compatible server (MinIO,
    moto) and may carry an http:// scheme.
    """
    kwargs: dict = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        parsed = urlparse(endpoint)
        if parsed.scheme:
            kwargs["scheme"] = parsed.scheme
            kwargs["endpoint_override"] = parsed.netloc + parsed.path.rstrip("/")
        else:
            kwargs["endpoint_override"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    return pafs.S3FileSystem(**kwargs)


@dataclass(frozen=True)
class StorageRoot:
    """A root URI with its filesystem; paths given to methods are relative to the root."""

    uri: str
    fs: pafs.FileSystem
    base: str  # the root as a path inside ``fs`` (no scheme)

    def path(self, *parts: str) -> str:
        """The filesystem path of ``parts`` under the root (what pyarrow and Ray take)."""
        return posixpath.join(self.base, *parts) if parts else self.base

    def uri_of(self, *parts: str) -> str:
        """A URI a person can paste: s3://... or a local absolute path."""
        p = self.path(*parts)
        return f"s3://{p}" if isinstance(self.fs, pafs.S3FileSystem) else p

    def exists(self, *parts: str) -> bool:
        return self.fs.get_file_info(self.path(*parts)).type != pafs.FileType.NotFound

    def read_bytes(self, *parts: str) -> bytes:
        with self.fs.open_input_stream(self.path(*parts)) as f:
            return f.read()

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Write whole: locally via a temporary name and a rename, on S3 one PUT (atomic there)."""
        target = self.path(*parts)
        self.fs.create_dir(posixpath.dirname(target), recursive=True)
        if isinstance(self.fs, pafs.LocalFileSystem):
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            with self.fs.open_output_stream(tmp) as f:
                f.write(data)
            self.fs.move(tmp, target)
        else:
            with self.fs.open_output_stream(target) as f:
                f.write(data)

    def write_json(self, obj: object, *parts: str) -> None:
        self.write_bytes(json.dumps(obj, indent=2, sort_keys=True).encode(), *parts)

    def read_json(self, *parts: str) -> object:
        return json.loads(self.read_bytes(*parts))

    def list_dirs(self, *parts: str) -> list[str]:
        """Names of the folders directly under ``parts`` (empty when it does not exist)."""
        if not self.exists(*parts):
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(*parts), recursive=False))
        return sorted(posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.Directory)


def open_root(uri: str) -> StorageRoot:
    """Open a storage root. Local roots are made absolute so Ray workers agree on them."""
    problem = check_uri(uri)
    if problem:
        raise ValueError(f"storage root {uri!r}: {problem}")
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        base = (parsed.netloc + parsed.path).rstrip("/")
        return StorageRoot(uri=f"s3://{base}", fs=s3_filesystem(), base=base)
    local = parsed.path if parsed.scheme == "file" else uri
    base = str(Path(local).expanduser().resolve())
    return StorageRoot(uri=base, fs=pafs.LocalFileSystem(), base=base)
