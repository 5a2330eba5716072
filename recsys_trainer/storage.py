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
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal
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


def exists(url: str, filesystem: pafs.FileSystem | None = None) -> bool:
    """Whether a file or directory exists at ``url``."""
    return file_info(resolve(url, filesystem)).type != pafs.FileType.NotFound


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
