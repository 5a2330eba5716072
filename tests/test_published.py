"""The published location's format (recsys_trainer/serving/published.py): the LATEST pointer
round-trips and is validated field by field, is written whole, only names committed artifacts,
and rotation keeps the last K bases and the deltas their chains need; on a local directory and
on the real S3 server (tests/s3_server.py)."""

from __future__ import annotations

import json
import os

import pytest
from s3_server import S3Server

from recsys_trainer import storage
from recsys_trainer.serving import published as pub
from recsys_trainer.serving.manifest import ArtifactError

H1, H2 = "a" * 64, "b" * 64


def _pointer(seq: int = 1, base: str = "bases/b0", deltas: tuple[str, ...] = (), **kw: object
             ) -> pub.Pointer:
    args: dict[str, object] = {"sequence": seq, "base": base, "deltas": deltas, "step": 10 * seq,
                               "content_hash": H1, "window": "hour=3", "window_time": 1.5e9,
                               "published_at": 1.7e9}
    args.update(kw)
    return pub.Pointer(**args)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_pointer_round_trips_and_its_json_has_the_documented_fields() -> None:
    p = _pointer(3, deltas=("deltas/d1", "deltas/d2"), window=None, window_time=None)
    raw = json.loads(p.to_json())
    assert raw == {"format": "recsys_trainer.published", "version": 1, "sequence": 3,
                   "base": "bases/b0", "deltas": ["deltas/d1", "deltas/d2"], "step": 30,
                   "content_hash": H1, "window": None, "window_time": None,
                   "published_at": 1.7e9}
    assert pub.Pointer.from_json(p.to_json()) == p
    assert pub.Pointer.from_json(raw) == p
    assert pub.Pointer.from_json(p.to_json().encode()) == p
    assert issubclass(pub.PublishedError, ArtifactError)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("field", "value", "named"), [
    ("format", "other", "format"),
    ("version", 2, "newer writer"),
    ("sequence", -1, "'sequence'"),
    ("sequence", True, "'sequence'"),
    ("base", "deltas/x", "'base'"),
    ("base", "bases/../x", "'base'"),
    ("base", "bases/a/b", "'base'"),
    ("deltas", "deltas/x", "'deltas'"),
    ("deltas", ["bases/x"], "'deltas'"),
    ("deltas", ["deltas/x", "deltas/x"], "'deltas'"),
    ("step", 1.5, "'step'"),
    ("content_hash", "xyz", "'content_hash'"),
    ("window", 3, "'window'"),
    ("window_time", "now", "'window_time'"),
    ("published_at", None, "'published_at'"),
])
def test_a_pointer_with_a_bad_field_is_refused_naming_the_location_and_the_field(
        field: str, value: object, named: str) -> None:
    raw = json.loads(_pointer().to_json())
    raw[field] = value
    with pytest.raises(pub.PublishedError, match=named) as info:
        pub.Pointer.from_json(raw, "s3://b/p/LATEST")
    assert "s3://b/p/LATEST" in str(info.value)


@pytest.mark.timeout(30)
def test_a_pointer_missing_a_field_or_not_json_is_refused() -> None:
    raw = json.loads(_pointer().to_json())
    del raw["window_time"]
    with pytest.raises(pub.PublishedError, match="lacks the field.*window_time"):
        pub.Pointer.from_json(raw, "here")
    with pytest.raises(pub.PublishedError, match="'here' is not JSON"):
        pub.Pointer.from_json(b'{"format": "recsys_trai', "here")
    with pytest.raises(pub.PublishedError, match="not a JSON object"):
        pub.Pointer.from_json("[1]", "here")


def _commit(root: storage.Location, ref: str) -> None:
    """A stand-in committed artifact (the marker is what the pointer's check reads)."""
    loc = pub.artifact_location(root, ref)
    if root.is_local:
        os.makedirs(loc.path, exist_ok=True)
    with root.filesystem.open_output_stream(loc.join("manifest.json").path) as f:
        f.write(b"{}")
    with root.filesystem.open_output_stream(loc.join("COMMITTED").path) as f:
        f.write(b"{}")


def _locations(tmp_path: object, request: pytest.FixtureRequest, kind: str) -> storage.Location:
    if kind == "local":
        return storage.resolve(os.path.join(str(tmp_path), "pub"))
    server: S3Server = request.getfixturevalue("s3_server")
    return storage.resolve(server.url(f"published/{request.node.name}"), server.filesystem())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_read_write_pointer_and_rotation_on_a_location(tmp_path: object,
                                                       request: pytest.FixtureRequest,
                                                       kind: str) -> None:
    root = _locations(tmp_path, request, kind)
    assert pub.read_pointer(root) is None
    b1 = pub.artifact_name(1, 10)
    p1 = _pointer(1, base=f"bases/{b1}")
    with pytest.raises(pub.PublishedError, match="not a committed artifact"):
        pub.write_pointer(root, p1)
    assert pub.read_pointer(root) is None  # the refused pointer left nothing
    _commit(root, p1.base)
    pub.write_pointer(root, p1)
    assert pub.read_pointer(root) == p1
    if kind == "local":
        assert sorted(os.listdir(root.path)) == ["LATEST", "bases"]  # no temporary file left

    history = [p1]
    # Three deltas on b1, then b2 with one delta, then b3: keep_bases=2 keeps b2, b3.
    deltas: list[str] = []
    for seq in (2, 3, 4):
        d = f"deltas/{pub.artifact_name(seq, 10 * seq, b1)}"
        _commit(root, d)
        deltas.append(d)
        history.append(_pointer(seq, base=p1.base, deltas=tuple(deltas)))
        pub.write_pointer(root, history[-1])
    b2 = pub.artifact_name(5, 50)
    d2 = f"deltas/{pub.artifact_name(6, 60, b2)}"
    orphan = f"deltas/{pub.artifact_name(7, 70, b2)}"  # committed, its pointer never written
    for ref in (f"bases/{b2}", d2, orphan):
        _commit(root, ref)
    history += [_pointer(5, base=f"bases/{b2}"), _pointer(6, base=f"bases/{b2}", deltas=(d2,))]
    foreign = "bases/my-own-export"
    _commit(root, foreign)
    assert pub.rotate(root, 2, history[-1], history=history) == [orphan]
    b3 = pub.artifact_name(8, 80)
    _commit(root, f"bases/{b3}")
    p8 = _pointer(8, base=f"bases/{b3}", content_hash=H2)
    pub.write_pointer(root, p8)
    deleted = pub.rotate(root, 2, p8, history=history)
    assert sorted(deleted) == sorted([p1.base, *deltas])
    assert pub.list_artifacts(root) == sorted([f"bases/{b2}", f"bases/{b3}", d2, foreign])
    assert pub.read_pointer(root) == p8
    base, chain = pub.chain(root, history[-1])
    assert base.url.endswith(f"/bases/{b2}") and [c.url.rsplit("/", 2)[-2:] for c in chain] == [
        d2.split("/")]

    # A corrupt LATEST is named.
    with root.filesystem.open_output_stream(root.join("LATEST").path) as f:
        f.write(b"garbage")
    with pytest.raises(pub.PublishedError, match="LATEST"):
        pub.read_pointer(root)


@pytest.mark.timeout(30)
def test_plan_rotation_after_a_restart_keeps_older_bases_by_their_names_and_all_their_deltas(
) -> None:
    """Only the current pointer is known (a restarted job): older bases of this writer's
    naming count by their sequence, and a kept older base keeps every delta of its name."""
    b1, b2, b3, b4 = (pub.artifact_name(s, s) for s in (1, 4, 7, 9))
    listed = [f"bases/{b}" for b in (b1, b2, b3, b4)] + [
        f"deltas/{pub.artifact_name(s, s, b)}" for b, s in ((b1, 2), (b2, 5), (b2, 6), (b3, 8),
                                                             (b4, 10))]
    current = _pointer(9, base=f"bases/{b3}", deltas=(listed[-2],))
    doomed = pub.plan_rotation(listed, [current], keep_bases=2)
    # b4 (named after the current base, never pointed to) and b1 go, with their deltas.
    assert doomed == sorted([f"bases/{b1}", f"bases/{b4}", listed[4], listed[-1]])
    assert pub.plan_rotation(listed, [current], keep_bases=1) == sorted(
        [f"bases/{b1}", f"bases/{b2}", f"bases/{b4}", listed[4], listed[5], listed[6],
         listed[-1]])
    assert pub.plan_rotation(listed, [], keep_bases=1) == []
    with pytest.raises(ValueError, match="keep_bases"):
        pub.plan_rotation(listed, [current], keep_bases=0)
    # Whatever the names say, the current pointer's artifacts stay.
    odd = _pointer(3, base=f"bases/{b4}", deltas=(listed[4],))
    kept = set(listed) - set(pub.plan_rotation(listed, [odd], keep_bases=1))
    assert {f"bases/{b4}", listed[4]} <= kept
