"""The Open Bandit sample comes from the obp wheel that scripts/setup fetched (never from a
folder beside the repository), and a sample that cannot be had is a named error saying how to
provide one (issue 19, item 13)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import zipfile

import pyarrow.parquet as pq
import pytest

from recsys_trainer.data.generators import open_bandit
from recsys_trainer.data.generators.open_bandit import (
    OBP_WHEEL,
    OpenBanditSampleError,
    cache_dir,
    convert,
    fetch_sample,
    main,
    read_sample_csv,
)
from recsys_trainer.data.windows import partitioned_windows

# sha256 of random/men/men.csv as published in zr-obp's obd/ (the same bytes in the wheel).
RANDOM_MEN_SHA256 = "ede6d08c6877f99cd3770f7d09e26c738e6aa6de4445ccccfb1356ba5d06b1eb"


def _offline_pip(monkeypatch: pytest.MonkeyPatch, find_links: str) -> None:
    """pip sees no index and no configuration: only the wheels in ``find_links``."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", find_links)


def test_the_sample_is_read_from_the_fetched_obp_wheel_without_installing_obp() -> None:
    data = read_sample_csv("random_men")  # from the wheel scripts/setup put in cache_dir()
    assert hashlib.sha256(data).hexdigest() == RANDOM_MEN_SHA256
    lines = data.decode().splitlines()
    assert len(lines) == 10_001 and "timestamp,item_id,position,click,propensity_score" in lines[0]
    assert importlib.util.find_spec("obp") is None  # read from the zip: obp is not installed
    with pytest.raises(ValueError, match=r"`source` must be one of \['random_men', "):
        read_sample_csv("random_all")


def test_fetch_downloads_the_wheel_through_pip_and_a_missing_registry_says_how_to_pass_source(
        tmp_path, monkeypatch) -> None:
    links = tmp_path / "links"
    links.mkdir()
    shutil.copy(cache_dir() / OBP_WHEEL, links / OBP_WHEEL)
    _offline_pip(monkeypatch, str(links))
    got = fetch_sample(tmp_path / "cache")  # pip download, from the find-links directory
    assert got == tmp_path / "cache" / OBP_WHEEL
    assert hashlib.sha256(got.read_bytes()).hexdigest() == open_bandit.OBP_WHEEL_SHA256
    assert fetch_sample(tmp_path / "cache") == got  # cached: pip is not asked again

    (links / OBP_WHEEL).unlink()  # now no registry has it
    with pytest.raises(OpenBanditSampleError) as e:
        fetch_sample(tmp_path / "other")
    assert "could not download obp==0.4.1 (the Open Bandit sample) from the package registry" in str(e.value)
    assert "pass `--source DIR` with the four CSVs" in str(e.value) and "`--wheel FILE`" in str(e.value)
    assert list((tmp_path / "other").iterdir()) == []  # nothing half-fetched is left behind

    got.write_bytes(got.read_bytes()[:-10])  # a damaged cache is refused, not read
    with pytest.raises(OpenBanditSampleError, match=r"is not the obp 0.4.1 wheel .* delete it and fetch it again"):
        fetch_sample(tmp_path / "cache")


def test_the_converter_without_a_fetched_sample_is_a_named_error_and_takes_source_or_wheel(
        tmp_path, monkeypatch, capsys) -> None:
    wheel = cache_dir() / OBP_WHEEL
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("OpenBanditSampleError: the Open Bandit sample has not been fetched")
    assert "run scripts/setup" in err and "pass `--source DIR`" in err

    # --source DIR: the CSVs as files (named as in a flat copy); --wheel FILE: the wheel.
    flat = tmp_path / "csv"
    flat.mkdir()
    with zipfile.ZipFile(wheel) as z:
        (flat / "random_men_men.csv").write_bytes(z.read("obp/dataset/obd/random/men/men.csv"))
    n = convert(str(tmp_path / "from_dir"), flat, sources=["random_men"])
    assert n == convert(str(tmp_path / "from_wheel"), wheel, sources=["random_men"]) == 168
    a, b = partitioned_windows(str(tmp_path / "from_dir")), partitioned_windows(str(tmp_path / "from_wheel"))
    assert [w.id for w in a] == [w.id for w in b] and len(a) == 168
    assert all(pq.read_table(x.files[0]).equals(pq.read_table(y.files[0])) for x, y in zip(a, b, strict=True))
    assert sum(pq.ParquetFile(w.files[0]).metadata.num_rows for w in a) == 10_000
    # The license travels with data converted from the wheel.
    assert "Apache License" in (tmp_path / "from_wheel" / "LICENSE.obp.txt").read_text()
    with pytest.raises(OpenBanditSampleError, match=r"the Open Bandit CSV of 'bts_men' is not in .*csv"):
        convert(str(tmp_path / "x"), flat, sources=["bts_men"])
