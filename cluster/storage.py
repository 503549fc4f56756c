"""One storage root, local directory or ``s3://bucket/prefix``, read and written through pyarrow.fs.

Every durable thing a job has (checkpoints, datasets converted on first use, summaries)
lives under a root, so the same code serves a laptop and a cluster.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import posixpath
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs

log = logging.getLogger(__name__)

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


S3_REQUEST_TIMEOUT_S = 15.0
S3_CONNECT_TIMEOUT_S = 10.0


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
    # The AWS SDK's default gives up on a request that moves no bytes for 3 s: a busy S3-compatible
    # server (or S3 throttling a large ranged read) stalls that long, and a streamed row group was lost.
    # 15 s keeps three tries of a just-in-time checkpoint inside a 2-minute spot notice.
    # Delayed open: a small file is one PUT when it is closed, not a multipart upload's three
    # requests; an error (a missing bucket) surfaces at close, which every write here waits for.
    return pafs.S3FileSystem(request_timeout=S3_REQUEST_TIMEOUT_S, connect_timeout=S3_CONNECT_TIMEOUT_S,
                             allow_delayed_open=True, **kwargs)


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

    def sub(self, *parts: str) -> "StorageRoot":
        """The root one level down: a sweep's trials are jobs under ``<root>/sweeps/<name>/jobs``."""
        return StorageRoot(uri=self.uri_of(*parts), fs=self.fs, base=self.path(*parts))

    def exists(self, *parts: str) -> bool:
        return self.fs.get_file_info(self.path(*parts)).type != pafs.FileType.NotFound

    def read_bytes(self, *parts: str) -> bytes:
        with self.fs.open_input_stream(self.path(*parts)) as f:
            return f.read()

    def write_bytes(self, data: bytes, *parts: str) -> None:
        write_whole(self.fs, self.path(*parts), data)

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


def write_whole(fs: pafs.FileSystem, target: str, data: bytes) -> None:
    """Write a file whole: locally via a temporary name and a rename, on S3 one PUT (atomic there;
    S3 has no folders, and creating their marker objects would cost requests at every write)."""
    if isinstance(fs, pafs.LocalFileSystem):
        fs.create_dir(posixpath.dirname(target), recursive=True)
        tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
        with fs.open_output_stream(tmp) as f:
            f.write(data)
        fs.move(tmp, target)
    else:
        with fs.open_output_stream(target) as f:
            f.write(data)


DELETE_BATCH = 1000  # keys in one S3 DeleteObjects request, S3's own limit


def delete_trees(fs: pafs.FileSystem, folders: list[str], listed: list[pafs.FileInfo]) -> None:
    """Delete each of ``folders`` with everything under it; ``listed``: a recursive listing that
    covers them (the caller has just made it). Raises OSError when they could not be deleted.

    On S3 one DeleteObjects request per thousand objects, for all the folders together. pyarrow's
    ``delete_dir`` costs five requests a folder (a HEAD, a listing, the delete, the folder's marker,
    and a marker PUT to keep the parent): at a checkpoint every fraction of a second that was most
    of retention's traffic. The client is boto3, set up from ``fs``'s own options (endpoint,
    region, timeouts, keys). pyarrow stays the reference: a filesystem boto3 cannot be set up
    like (an assumed role, anonymous, a proxy, a boto3 configuration error) deletes through it, and
    so does a round in which boto3 failed; when pyarrow then succeeds where boto3 was refused for a
    reason that does not pass (other credentials from boto3's own chain, a CA bundle or proxy of its
    own), every later round goes through pyarrow too, said once through ``say``.
    """
    client = s3_client_like(fs) if isinstance(fs, pafs.S3FileSystem) else None
    if client is None or client in _BATCH_REFUSED:
        _delete_each(fs, folders)
        return
    by_bucket: dict[str, list[str]] = {}
    for folder in folders:
        inside = [info for info in listed if info.path.startswith(folder + "/")]
        # An object per file; a marker per folder, where an older writer made one (deleting a
        # missing key succeeds): without it the folder would still show in a listing.
        paths = [i.path + "/" if i.type == pafs.FileType.Directory else i.path for i in inside] + [folder + "/"]
        for path in paths:
            bucket, _, key = path.partition("/")
            by_bucket.setdefault(bucket, []).append(key)
    try:
        _delete_objects(client, by_bucket)
    except _BatchFailed as failed:
        try:
            _delete_each(fs, folders)
        except OSError as exc:  # storage itself is in trouble: the caller tries again later
            raise OSError(f"{exc} (boto3's DeleteObjects: {failed})") from exc
        if not failed.transient:
            _BATCH_REFUSED.add(client)
            log.warning(f"retention deletes old checkpoints through pyarrow from now on (about five requests a "
                        f"checkpoint): boto3's DeleteObjects was refused where pyarrow's delete worked ({failed}). Check "
                        "boto3's own settings on this node: AWS_PROFILE and ~/.aws/config, AWS_CA_BUNDLE, HTTPS_PROXY.")


class _BatchFailed(Exception):
    def __init__(self, message: str, transient: bool):
        super().__init__(message)
        self.transient = transient


def _delete_objects(client, by_bucket: dict[str, list[str]]) -> None:
    """DeleteObjects, a thousand keys a request; _BatchFailed on any failure, a whole request's or a key's."""
    for bucket, keys in by_bucket.items():
        for start in range(0, len(keys), DELETE_BATCH):
            batch = keys[start:start + DELETE_BATCH]
            try:
                answer = client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch],
                                                                      "Quiet": True})
            except Exception as exc:  # boundary: whatever boto3 raises, pyarrow gets the round
                raise _BatchFailed(f"s3://{bucket}: {type(exc).__name__}: {exc}", transient_s3_error(exc)) from exc
            if errors := answer.get("Errors"):  # S3 answers a key it may not delete 200, with an entry here
                first = errors[0]
                raise _BatchFailed(f"{len(errors)} of {len(batch)} objects in s3://{bucket} not deleted, first "
                                   f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}",
                                   all(e.get("Code") in TRANSIENT_S3_CODES for e in errors))


def _delete_each(fs: pafs.FileSystem, folders: list[str]) -> None:
    for folder in folders:
        with contextlib.suppress(FileNotFoundError):  # gone already (a batch before a failed one)
            fs.delete_dir(folder)


S3_DELETE_ATTEMPTS = 3  # boto3's tries of one DeleteObjects (its standard back-off between them)
_BATCH_REFUSED: set = set()  # boto3 clients refused where pyarrow was not: pyarrow deletes from then on
TRANSIENT_S3_CODES = ("SlowDown", "RequestTimeout", "Throttling", "ThrottlingException", "TooManyRequests",
                      "InternalError", "ServiceUnavailable", "OperationAborted")


def transient_s3_error(exc: Exception) -> bool:
    """Whether a boto3 error may pass by itself (throttling, a 5xx, a dropped connection) past its
    retries. A certificate or proxy boto3 cannot get through does not: those are its own settings."""
    from botocore.exceptions import ClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError, ProxyConnectionError, SSLError

    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status in (429, 500, 502, 503, 504) or exc.response.get("Error", {}).get("Code", "") in TRANSIENT_S3_CODES
    if isinstance(exc, (SSLError, ProxyConnectionError)):
        return False
    return isinstance(exc, (BotoConnectionError, HTTPClientError))


@functools.lru_cache(maxsize=8)
def _s3_client_for(endpoint_url: str | None, region: str | None, connect_timeout_s: float, read_timeout_s: float,
                   access_key: str | None, secret_key: str | None, session_token: str | None, ca_file: str | None):
    """One boto3 client per configuration and process (clients are thread-safe; making one costs ~50 ms),
    or None where boto3 cannot make one (a missing AWS_PROFILE, a malformed ~/.aws/config, which the
    AWS C++ SDK behind pyarrow tolerates): pyarrow deletes then."""
    import boto3
    from botocore.config import Config

    config = Config(connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
                    retries={"mode": "standard", "max_attempts": S3_DELETE_ATTEMPTS},
                    s3={"addressing_style": "path"})  # works with every endpoint, AWS's included
    try:
        return boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url, region_name=region, config=config, aws_access_key_id=access_key,
            aws_secret_access_key=secret_key, aws_session_token=session_token, verify=ca_file or None)
    except Exception as exc:  # boundary: any of botocore's configuration errors; remembered by the cache
        logging.getLogger(__name__).warning("no boto3 S3 client here (%s: %s): old checkpoints are deleted "
                                            "through pyarrow", type(exc).__name__, exc)
        return None


def s3_client_like(fs: pafs.S3FileSystem):
    """A boto3 S3 client that talks to what ``fs`` talks to, or None where that cannot be promised."""
    _, (options,) = fs.__reduce__()
    if (options.get("anonymous") or options.get("role_arn") or options.get("proxy_options", {}).get("host")
            or options.get("force_virtual_addressing")):
        return None
    endpoint = options.get("endpoint_override") or None
    if endpoint:
        endpoint = f"{options.get('scheme') or 'https'}://{endpoint}"
    # pyarrow's -1 means its SDK's defaults; S3_REQUEST_TIMEOUT_S and S3_CONNECT_TIMEOUT_S are ours.
    connect_s = options.get("connect_timeout", -1)
    read_s = options.get("request_timeout", -1)
    return _s3_client_for(endpoint, fs.region or None, connect_s if connect_s > 0 else S3_CONNECT_TIMEOUT_S,
                          read_s if read_s > 0 else S3_REQUEST_TIMEOUT_S, options.get("access_key"),
                          options.get("secret_key"), options.get("session_token"),
                          options.get("tls_ca_file_path") or None)


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


# ---------------------------------------------------------------- bucket set-up (etrain storage init)

ABORT_MULTIPART_DAYS = 1
NONCURRENT_VERSION_DAYS = 30


class StorageInitError(Exception):
    """A bucket that cannot be used as it is; the message says what to do."""


def init_s3(uri: str, kms_key_id: str | None = None, create: bool = True, client=None) -> list[str]:
    """Create or check a bucket for checkpoints: encryption, versioning, multipart clean-up.

    Default encryption is SSE-S3 (AES-256, the guide's "encrypt training data") or SSE-KMS
    with ``kms_key_id``; versioning keeps an overwritten checkpoint recoverable; a lifecycle
    rule aborts multipart uploads that a killed writer left behind and expires old versions.
    Returns one line per thing done or found.
    """
    import boto3
    from botocore.exceptions import ClientError, NoCredentialsError

    parsed = urlparse(uri)
    problem = check_uri(uri)
    if parsed.scheme != "s3" or problem:
        raise StorageInitError(f"{uri}: {problem or 'not an s3:// URI'}: storage init sets up S3 buckets only")
    bucket = parsed.netloc
    s3 = client or boto3.client("s3")
    region = s3.meta.region_name or "us-east-1"
    done: list[str] = []
    try:
        head = s3.head_bucket(Bucket=bucket)
        actual = head.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")
        if actual and actual != region:
            raise StorageInitError(
                f"bucket {bucket} is in region {actual} but your AWS settings say {region}: "
                f"set AWS_REGION={actual}")
        done.append(f"bucket {bucket} exists ({region})")
    except NoCredentialsError:
        raise StorageInitError("no AWS credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                               "a profile, or an instance role") from None
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("404", "NoSuchBucket", "NotFound"):
            if not create:
                raise StorageInitError(f"bucket {bucket} does not exist: create it, or drop --no-create") from None
            kwargs = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
            s3.create_bucket(Bucket=bucket, **kwargs)
            done.append(f"created bucket {bucket} in {region}")
        elif code in ("403", "AccessDenied", "Forbidden"):
            raise StorageInitError(
                f"no permission to use bucket {bucket}: grant s3:ListBucket, s3:GetObject, s3:PutObject, "
                "s3:DeleteObject and s3:PutBucket* to this role, or pick a bucket you own") from None
        elif code in ("301", "PermanentRedirect"):
            raise StorageInitError(f"bucket {bucket} is in another region than {region}: set AWS_REGION") from None
        else:
            raise StorageInitError(f"bucket {bucket}: {code or exc}") from None
    rule = {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": kms_key_id} if kms_key_id else {"SSEAlgorithm": "AES256"}
    s3.put_bucket_encryption(Bucket=bucket, ServerSideEncryptionConfiguration={
        "Rules": [{"ApplyServerSideEncryptionByDefault": rule, "BucketKeyEnabled": bool(kms_key_id)}]})
    done.append(f"default encryption: {rule['SSEAlgorithm']}" + (f" (key {kms_key_id})" if kms_key_id else ""))
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    done.append("versioning: enabled")
    s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [{
        "ID": "etrain-cleanup", "Status": "Enabled", "Filter": {"Prefix": ""},
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": ABORT_MULTIPART_DAYS},
        "NoncurrentVersionExpiration": {"NoncurrentDays": NONCURRENT_VERSION_DAYS},
    }]})
    done.append(f"lifecycle: abort incomplete multipart uploads after {ABORT_MULTIPART_DAYS} day, "
                f"expire old versions after {NONCURRENT_VERSION_DAYS} days")
    return done
