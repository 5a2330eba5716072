"""Where data and checkpoints live: a URL or local path -> a ``pyarrow.fs`` filesystem and path.

Every module that reads windows or writes checkpoints / predictions goes through ``resolve`` so
that ``s3://``, ``gs://``, ``hdfs://``, ``file://`` and plain paths behave alike. pyarrow's
native filesystems are used where they exist (their reads of parquet row groups are ranged);
any other scheme that fsspec knows is wrapped with ``pyarrow.fs.PyFileSystem(FSSpecHandler)``.
Credentials and endpoints come from each filesystem's standard environment and config, or from
an explicit ``filesystem=`` argument.

S3 (``s3://bucket/key``) without an explicit filesystem: credentials come from the AWS chain
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``~/.aws``, instance
metadata), the endpoint from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (pyarrow's
``S3FileSystem()`` constructor ignores these, apache/arrow#49643, so this module reads them), the
region from ``AWS_REGION``/``AWS_DEFAULT_REGION`` or, on AWS itself, from the bucket. Requests
time out (``S3_CONNECT_TIMEOUT_S``, ``S3_REQUEST_TIMEOUT_S``: no progress for that long) and
transient failures (throttling, 5xx, dropped connections) are retried by the AWS SDK's standard
strategy, ``S3_MAX_ATTEMPTS`` attempts in all with jittered exponential backoff: an unreachable
endpoint fails in ~2 s. Other schemes keep their filesystem's own defaults.

Failures of listing and opening are raised as ``StorageError`` naming the URL and the cause:
missing bucket, access denied, unreachable endpoint.

Files and directories at a location (``locate``, ``exists``, ``read_bytes``, ``write_bytes``,
``make_dir``, ``remove_tree``, ``digest``, ``probe_writable`` ...) are here too, for every
writer: checkpoints, serving artifacts, the published pointer, vocabularies and the generated
datasets. Every whole-file write goes through ``write_bytes`` (or, for a writer that streams a
local file, ``atomic_write``): locally a temporary file renamed into place, on object storage
one upload under the final name; a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import functools
import os
import posixpath
import secrets
import shutil
import socket
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal
from urllib.parse import urlparse

import fsspec
import pyarrow as pa
import pyarrow.fs as pafs

_NATIVE_SCHEMES = frozenset({"s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss"})

S3_MAX_ATTEMPTS = 3
"""Attempts per S3 request (first try included) under the SDK's standard retry strategy."""
S3_CONNECT_TIMEOUT_S = 5.0
S3_REQUEST_TIMEOUT_S = 60.0
"""An S3 request fails after this long without progress (curl's low-speed limit)."""

_S3_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION",
           "AWS_ACCESS_KEY_ID", "AWS_PROFILE")
"""Environment that selects the S3 filesystem (cached filesystems are keyed on it)."""

ErrorKind = Literal["missing_bucket", "denied", "unreachable", "not_found", "other"]


class StorageError(OSError):
    """Listing or opening ``url`` failed; ``kind`` says why (``missing_bucket``, ``denied``,
    ``unreachable``, ``not_found`` or ``other``)."""

    def __init__(self, message: str, *, url: str, kind: ErrorKind) -> None:
        super().__init__(message)
        self.url = url
        self.kind = kind


@dataclass(frozen=True)
class Location:
    """A resolved location: the filesystem, the path inside it, and the URL the user gave (for
    error messages)."""

    filesystem: pafs.FileSystem
    path: str
    url: str

    @property
    def is_local(self) -> bool:
        return isinstance(self.filesystem, pafs.LocalFileSystem)

    def join(self, *parts: str) -> Location:
        """A child location; ``url`` is extended the same way so errors still name it."""
        path = "/".join([self.path.rstrip("/"), *parts])
        url = "/".join([self.url.rstrip("/"), *parts])
        return Location(self.filesystem, path, url)


def scheme_of(url: str) -> str:
    """``"s3"`` for ``s3://b/k``; ``""`` for a plain local path (Windows drives included)."""
    parsed = urlparse(url)
    return parsed.scheme if len(parsed.scheme) > 1 else ""


def resolve(url: str | os.PathLike[str], filesystem: pafs.FileSystem | None = None) -> Location:
    """Resolve ``url`` to a filesystem and a path inside it.

    ``filesystem`` given: ``url`` is taken as a path in it (a scheme prefix is stripped).
    Filesystems built from the environment are cached per scheme, bucket/host and environment,
    so resolving every file of a window does not build a client per file.
    """
    text = os.fspath(url)
    scheme = scheme_of(text)
    if filesystem is not None:
        path = text.split("://", 1)[1] if scheme else text
        return Location(filesystem, path, text)
    if scheme in ("", "file"):
        local = urlparse(text).path if scheme == "file" else text
        return Location(pafs.LocalFileSystem(), os.path.abspath(local), text)
    parsed = urlparse(text)
    if scheme == "s3" and not parsed.query:
        fs = _s3_filesystem(parsed.netloc, tuple(os.environ.get(k) for k in _S3_ENV))
        return Location(fs, f"{parsed.netloc}{parsed.path}".rstrip("/"), text)
    if scheme in _NATIVE_SCHEMES:
        with errors_named(text):
            fs, path = pafs.FileSystem.from_uri(text)
        return Location(fs, path, text)
    fs_spec, path = fsspec.core.url_to_fs(text)
    return Location(_wrapped_fsspec(fs_spec), path, text)


@functools.lru_cache(maxsize=64)
def _wrapped_fsspec(fs_spec: fsspec.AbstractFileSystem) -> pafs.FileSystem:
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs_spec))


@functools.lru_cache(maxsize=64)
def _s3_filesystem(bucket: str, env: tuple[str | None, ...]) -> pafs.S3FileSystem:
    """The S3 filesystem for ``bucket`` as the standard AWS environment configures it, with this
    module's timeouts and bounded retry (``env`` is only the cache key)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region is None and endpoint is None and bucket:
        # On AWS a request to another region's bucket is redirected, which the SDK does not
        # follow; ask the bucket (as pyarrow's own from_uri does).
        with errors_named(f"s3://{bucket}"):
            region = pafs.resolve_s3_region(bucket)
    return pafs.S3FileSystem(
        endpoint_override=endpoint, region=region,
        connect_timeout=S3_CONNECT_TIMEOUT_S, request_timeout=S3_REQUEST_TIMEOUT_S,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=S3_MAX_ATTEMPTS),
    )


# Substrings of pyarrow / AWS SDK / fsspec messages, by what the user must fix.
_KINDS: tuple[tuple[ErrorKind, tuple[str, ...]], ...] = (
    ("missing_bucket", ("NO_SUCH_BUCKET", "NoSuchBucket", "bucket does not exist")),
    ("denied", ("ACCESS_DENIED", "AccessDenied", "INVALID_ACCESS_KEY_ID", "InvalidAccessKeyId",
                "SIGNATURE_DOES_NOT_MATCH", "SignatureDoesNotMatch", "Forbidden",
                "PermissionError", "Permission denied")),
    ("unreachable", ("NETWORK_CONNECTION", "Could not connect", "Could not resolve",
                     "Timeout was reached", "Connection refused", "ConnectionError")),
)

_ADVICE: dict[ErrorKind, str] = {
    "missing_bucket": "the bucket does not exist: check the URL's bucket name (and the endpoint, "
                      "AWS_ENDPOINT_URL), or create the bucket",
    "denied": "access denied: check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
              "AWS_PROFILE, or the filesystem= given) and their permissions on this bucket/prefix",
    "unreachable": "the storage endpoint cannot be reached (after {attempts} attempts for S3): "
                   "check the endpoint (AWS_ENDPOINT_URL for S3) and the network",
    "not_found": "it does not exist",
    "other": "",
}


def classify(exc: BaseException) -> ErrorKind:
    """What an exception from a filesystem means for the user."""
    if isinstance(exc, StorageError):
        return exc.kind
    text = f"{type(exc).__name__}: {exc}"
    for kind, needles in _KINDS:
        if any(n in text for n in needles):
            return kind
    if isinstance(exc, FileNotFoundError):
        return "not_found"
    return "other"


def is_access_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the storage itself failed (missing bucket, denied, unreachable),
    not the file: such errors are never skipped as a corrupt file would be."""
    return classify(exc) in ("missing_bucket", "denied", "unreachable")


def storage_error(exc: BaseException, url: str, action: str = "access") -> StorageError:
    """``exc`` (from listing/opening ``url``) as a ``StorageError`` naming the URL and cause."""
    if isinstance(exc, StorageError):
        return exc
    kind = classify(exc)
    advice = _ADVICE[kind].format(attempts=S3_MAX_ATTEMPTS)
    detail = f"{advice} ({type(exc).__name__}: {exc})" if advice else f"{type(exc).__name__}: {exc}"
    return StorageError(f"cannot {action} {url}: {detail}", url=url, kind=kind)


@contextmanager
def errors_named(url: str, action: str = "access") -> Iterator[None]:
    """Re-raise filesystem errors (``OSError``, fsspec's) as ``StorageError`` naming ``url``."""
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        raise storage_error(exc, url, action) from exc


def check_bucket(loc: Location) -> None:
    """For an S3/GCS location, raise ``StorageError(kind="missing_bucket")`` if its bucket does
    not exist (a missing key in a missing bucket otherwise just reads as "not found")."""
    if loc.filesystem.type_name not in ("s3", "gcs"):
        return
    bucket = loc.path.split("/", 1)[0]
    with errors_named(loc.url, "list"):
        info = loc.filesystem.get_file_info(bucket)
    if info.type == pafs.FileType.NotFound:
        raise StorageError(f"cannot list {loc.url}: {_ADVICE['missing_bucket']} (bucket {bucket!r})",
                           url=loc.url, kind="missing_bucket")


def file_info(loc: Location) -> pafs.FileInfo:
    """``get_file_info`` of the location, errors naming its URL."""
    with errors_named(loc.url):
        return loc.filesystem.get_file_info(loc.path)


def list_tree(loc: Location) -> list[pafs.FileInfo]:
    """Everything under the directory ``loc`` (recursive), errors naming its URL."""
    with errors_named(loc.url, "list"):
        return loc.filesystem.get_file_info(pafs.FileSelector(loc.path, recursive=True))


def open_input_file(loc: Location) -> pa.NativeFile:
    """A random-access handle on the file (reads through it are ranged requests)."""
    with errors_named(loc.url, "open"):
        return loc.filesystem.open_input_file(loc.path)


def open_input_stream(loc: Location) -> pa.NativeFile:
    """A sequential handle on the file, decompressed by its extension (``.gz`` ...)."""
    with errors_named(loc.url, "open"):
        return loc.filesystem.open_input_stream(loc.path, compression="detect")


# ---------------------------------------------------------------------- files and directories

Where = str | os.PathLike[str] | Location
"""A local path, a URL (``s3://bucket/prefix``), or a resolved ``Location``."""

_DIGEST_CHUNK = 8 << 20


def locate(where: Where) -> Location:
    """``where`` as a ``Location`` (paths and URLs are resolved with ``resolve``)."""
    if isinstance(where, Location):
        return where
    return resolve(where)  # resolve caches the S3 clients it builds


def parent(loc: Location) -> Location:
    """The directory that holds ``loc``."""
    return Location(loc.filesystem, posixpath.dirname(loc.path.rstrip("/")),
                    loc.url.rstrip("/").rsplit("/", 1)[0])


def basename(loc: Location) -> str:
    """The last component of ``loc``'s path."""
    return posixpath.basename(loc.path.rstrip("/"))


def same_place(a: Location, b: Location) -> bool:
    """Whether two locations name the same directory (same filesystem type, same path)."""
    return a.filesystem.type_name == b.filesystem.type_name and \
        a.path.rstrip("/") == b.path.rstrip("/")


def is_dir(where: Where) -> bool:
    """Whether ``where`` is a directory."""
    loc = locate(where)
    return loc.filesystem.get_file_info(loc.path).type == pafs.FileType.Directory


def exists(where: Where, filesystem: pafs.FileSystem | None = None) -> bool:
    """Whether a file or directory exists at ``where`` (``filesystem``: as for ``resolve``, for
    a path or URL); a failure to ask raises ``StorageError`` naming it."""
    loc = where if isinstance(where, Location) else resolve(where, filesystem)
    return file_info(loc).type != pafs.FileType.NotFound


def list_names(where: Where) -> list[str]:
    """Names of the entries directly under ``where`` (empty if it does not exist)."""
    loc = locate(where)
    sel = pafs.FileSelector(loc.path, allow_not_found=True, recursive=False)
    return sorted(posixpath.basename(i.path.rstrip("/")) for i in loc.filesystem.get_file_info(sel))


def read_bytes(where: Where) -> bytes | None:
    """The content of a file, or None if there is none."""
    loc = locate(where)
    try:
        with loc.filesystem.open_input_stream(loc.path) as f:
            return bytes(f.read())
    except FileNotFoundError:
        return None


@contextmanager
def atomic_write(path: str, *, durable: bool = True, tmp: str | None = None) -> Iterator[BinaryIO]:
    """Write the local file ``path`` whole or not at all: the block writes to the file it is
    given (a temporary file beside ``path``); when the block returns, the file is fsynced (if
    ``durable``), renamed onto ``path`` (atomic) and the directory fsynced (if ``durable``).
    When the block raises, the temporary file is removed and ``path`` is left as it was.
    ``tmp``: the temporary file's name (default ``<path>.tmp.<pid>.<6 hex>``, which concurrent
    writers of one file never share)."""
    tmp = tmp if tmp is not None else f"{path}.tmp.{os.getpid()}.{secrets.token_hex(3)}"
    try:
        with open(tmp, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # A full disk: the partial temporary file would keep its space and stay behind.
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(path) or ".")


def write_bytes(where: Where, data: bytes, durable: bool = True) -> None:
    """Publish ``data`` at ``where`` whole or not at all. Locally: ``atomic_write`` (a temporary
    file, fsync if ``durable``, atomic rename, directory fsync). On object storage: one upload
    under the final name (an object becomes visible only once its upload completes)."""
    loc = locate(where)
    if loc.is_local:
        with atomic_write(loc.path, durable=durable) as f:
            f.write(data)
        return
    with loc.filesystem.open_output_stream(loc.path) as out:
        out.write(data)


def make_dir(where: Where) -> None:
    """Create a directory (locally; object stores have none to create)."""
    loc = locate(where)
    if loc.is_local:
        os.makedirs(loc.path, exist_ok=True)


def remove_tree(where: Where) -> None:
    """Delete a directory and everything under it (missing is fine)."""
    loc = locate(where)
    if loc.is_local:
        shutil.rmtree(loc.path, ignore_errors=True)
    elif exists(loc):
        loc.filesystem.delete_dir(loc.path)


def file_digest(path: str) -> tuple[int, int]:
    """``(size, crc32)`` of a local file. zlib releases the GIL on large buffers, so several
    files can be hashed in parallel threads."""
    with open(path, "rb") as f:
        return _digest_stream(f)


def digest(where: Where) -> tuple[int, int]:
    """``(size, crc32)`` of a file on any filesystem (read in 8 MiB pieces)."""
    loc = locate(where)
    if loc.is_local:
        return file_digest(loc.path)
    with loc.filesystem.open_input_stream(loc.path) as f:
        return _digest_stream(f)


def _digest_stream(f: Any) -> tuple[int, int]:
    crc = 0
    size = 0
    while True:
        buf = f.read(_DIGEST_CHUNK)
        if not buf:
            break
        crc = zlib.crc32(buf, crc)
        size += len(buf)
    return size, crc


def fsync_dir(path: str) -> None:
    """Make a rename/creation in ``path`` durable (best effort: not every FS supports it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def probe_writable(where: Where) -> str | None:
    """None if this process can create ``where`` and write, (fsync) and remove a file in it;
    else what failed (e.g. "OSError: [Errno 30] Read-only file system: '...'"). Run at the start
    of a job, so a directory that cannot take its output fails the job before any work is
    lost rather than at the first write. On object storage the bucket must already exist (some
    servers create a bucket on the first upload, which would hide a mistyped name)."""
    loc = locate(where)
    name = f".write_probe.{socket.gethostname()}.{os.getpid()}"
    try:
        if not loc.is_local:
            bucket = loc.path.strip("/").split("/", 1)[0]
            if loc.filesystem.get_file_info(bucket).type == pafs.FileType.NotFound:
                return (f"the bucket {bucket!r} of {loc.url!r} does not exist (or these "
                        "credentials cannot see it); create it or fix the URL")
            write_bytes(loc.join(name), b"probe\n")
            loc.filesystem.delete_file(loc.join(name).path)
            return None
        os.makedirs(loc.path, exist_ok=True)
        probe = os.path.join(loc.path, name)
        with open(probe, "wb") as f:
            f.write(b"probe\n")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None
