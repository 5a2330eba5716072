"""Where data and checkpoints live: a URL or local path -> a ``pyarrow.fs`` filesystem and path.

Every module that reads windows or writes checkpoints / predictions goes through ``resolve`` so
that ``s3://``, ``gs://``, ``hdfs://``, ``file://`` and plain paths behave alike. pyarrow's
native filesystems are used where they exist (their reads of parquet row groups are ranged);
any other scheme that fsspec knows is wrapped with ``pyarrow.fs.PyFileSystem(FSSpecHandler)``.
Credentials and endpoints come from each filesystem's standard environment and config, or from
an explicit ``filesystem=`` argument.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlparse

import fsspec
import pyarrow.fs as pafs

_NATIVE_SCHEMES = frozenset({"s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss"})


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
    """
    text = os.fspath(url)
    scheme = scheme_of(text)
    if filesystem is not None:
        path = text.split("://", 1)[1] if scheme else text
        return Location(filesystem, path, text)
    if scheme in ("", "file"):
        local = urlparse(text).path if scheme == "file" else text
        return Location(pafs.LocalFileSystem(), os.path.abspath(local), text)
    if scheme in _NATIVE_SCHEMES:
        fs, path = pafs.FileSystem.from_uri(text)
        return Location(fs, path, text)
    fs_spec, path = fsspec.core.url_to_fs(text)
    return Location(pafs.PyFileSystem(pafs.FSSpecHandler(fs_spec)), path, text)
