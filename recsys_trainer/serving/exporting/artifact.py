"""Writing a serving artifact with its commit protocol: ``manifest.json`` first, then every
file, then ``COMMITTED`` last (as checkpoints commit); a directory without the marker is never
loaded, and the next export into it clears it only when it is provably an export of ours.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from recsys_trainer import storage
from recsys_trainer.serving import delta as dl
from recsys_trainer.serving import manifest as mf


def write_artifact(out_dir: str, manifest: dict[str, Any], files: Mapping[str, bytes],
                   filesystem: Any = None) -> int:
    """Write ``manifest.json``, then ``files``, then ``COMMITTED`` (the manifest's sha256) last.
    An existing committed artifact there is refused (artifacts are immutable); an export that
    never committed is removed first, but only one provably ours (``_uncommitted_export``).
    Returns the bytes written."""
    root = storage.resolve(out_dir, filesystem)
    if storage.exists(root.join(mf.MARKER)):
        raise FileExistsError(f"{root.url!r} already holds a committed serving artifact; export "
                              "into a new directory (artifacts are never overwritten).")
    if storage.is_dir(root):
        refusal = _uncommitted_export(root)
        if refusal is not None:
            raise FileExistsError(
                f"{root.url!r} exists and {refusal}; export into a new or empty directory (it "
                "is not cleared: it may hold your checkpoints, other artifacts or other files), "
                "or remove what is there yourself if it is an export that died.")
        storage.remove_tree(root)  # an export of ours that died before its marker
    body = dl.dumps(manifest)
    # A full or read-only disk: name the artifact (the OS error names no file, or a temporary
    # one); what was written stays uncommitted, and the next export clears it.
    with storage.errors_named(root.url, "write"):
        storage.make_dir(root)
        # The manifest first: a directory an export dies in then holds the manifest that lists
        # every file it may have written, which is what lets the next export clear it.
        storage.write_bytes(root.join(mf.MANIFEST), body)
        if any("/" in n for n in files):
            storage.make_dir(root.join(mf.VOCAB_DIR))
        total = 0
        for name, data in sorted(files.items()):
            storage.write_bytes(root.join(name), data)
            total += len(data)
        storage.write_bytes(root.join(mf.MARKER), json.dumps(
            {"manifest_sha256": mf.sha256_bytes(body), "time": time.time()}).encode())
    return total + len(body)


def _uncommitted_export(root: storage.Location) -> str | None:
    """None when the directory ``root`` (no marker) is empty or provably an export of ours that
    did not commit: its ``manifest.json`` parses as one (``schema_version``, ``kind``,
    ``files``) and every name there is the manifest or a file it lists (or their temporary
    files). Else what is there and why it is not cleared: names alone prove nothing (a user's
    ``manifest.json`` or ``vocab/words.json`` has the names an export writes)."""
    def final(name: str) -> str:  # the name a temporary file is renamed to
        return name.split(".tmp.", 1)[0]

    names = sorted(storage.list_names(root))
    if not names:
        return None
    found = list(names)
    if mf.VOCAB_DIR in names and storage.is_dir(root.join(mf.VOCAB_DIR)):
        found.remove(mf.VOCAB_DIR)
        found += [f"{mf.VOCAB_DIR}/{n}" for n in sorted(storage.list_names(root.join(mf.VOCAB_DIR)))]
    data = storage.read_bytes(root.join(mf.MANIFEST)) if mf.MANIFEST in names else None
    try:
        manifest = json.loads(data.decode()) if data is not None else None
    except (UnicodeDecodeError, ValueError):
        manifest = None
    ours = (isinstance(manifest, dict) and isinstance(manifest.get("schema_version"), int)
            and manifest.get("kind") in ("full", "delta") and isinstance(manifest.get("files"), dict))
    if not ours:
        why = ("no manifest.json" if data is None else
               "a manifest.json that is not a serving export's (no schema_version, kind, files)")
        return f"holds {found[:5]} with {why}, so it is not an unfinished serving export"
    assert isinstance(manifest, dict)
    listed = {mf.MANIFEST, *manifest["files"]}
    foreign = [n for n in found if final(n) not in listed]
    if foreign:
        return (f"holds {foreign[:5]}, which its manifest.json does not list, so it is not (only) "
                "an unfinished serving export")
    return None
