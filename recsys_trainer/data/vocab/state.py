"""The Trainer's vocabularies as one checkpoint component (``Vocabularies``), and the decoding
of one feature's saved entry (``saved_vocabulary``, for exporting a checkpoint's vocabularies).

Both sides of the saved format (``_Config.saved`` / ``_Config.from_saved``) live here, so the
format a checkpoint holds is written and read in one place. ``recsys_trainer.data.vocab``
re-exports every public name.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from recsys_trainer.data.vocab.build import count_windows, merge_and_freeze
from recsys_trainer.data.vocab.features import vocabulary_capacity
from recsys_trainer.data.vocab.lookup import VocabFromData, Vocabulary

if TYPE_CHECKING:
    from recsys_trainer.distributed import Gang

logger = logging.getLogger("recsys_trainer.data")


class IdFeatureLike(Protocol):
    """What ``Vocabularies`` reads of a ``SparseFeature`` / ``SequenceFeature``."""

    @property
    def name(self) -> str: ...
    @property
    def vocab(self) -> object: ...
    @property
    def num_embeddings(self) -> int: ...
    @property
    def null_id(self) -> int | None: ...
    @property
    def sources(self) -> tuple[str, ...]: ...


class SpecLike(Protocol):
    @property
    def id_features(self) -> Sequence[IdFeatureLike]: ...


class VocabDataset(Protocol):
    """What ``Vocabularies`` needs of a dataset (``WindowedDataset`` provides it)."""

    @property
    def features(self) -> SpecLike | None: ...
    def window_ids(self) -> Iterator[str]: ...
    def read_columns(self, window_id: str, columns: Sequence[str]) -> Iterator[pa.Table]: ...
    def set_vocabularies(self, vocabularies: Mapping[str, Vocabulary]) -> None: ...


@dataclass(frozen=True)
class _Config:
    """How one feature maps ids: a fixed vocabulary, one built from the data, or none."""

    vocab: Vocabulary | VocabFromData | None
    capacity: int = 0
    """Most entries of a ``VocabFromData`` vocabulary."""

    @staticmethod
    def of(f: IdFeatureLike) -> _Config:
        v = f.vocab
        if isinstance(v, Vocabulary) and v.built_from is not None:
            v = v.built_from  # already installed: its configuration is how it was built
        if isinstance(v, VocabFromData):
            return _Config(v, vocabulary_capacity(v, f.num_embeddings, f.null_id))
        return _Config(v if isinstance(v, Vocabulary) else None)

    def same(self, other: _Config) -> bool:
        a, b = self.vocab, other.vocab
        if isinstance(a, Vocabulary) and isinstance(b, Vocabulary):
            return a.digest == b.digest
        return a == b and self.capacity == other.capacity

    def text(self) -> str:
        v = self.vocab
        if isinstance(v, VocabFromData):
            return f"a vocabulary built from the data ({v!r}, at most {self.capacity} values)"
        if isinstance(v, Vocabulary):
            return f"the vocabulary {v.source} ({len(v)} values, sha256 {v.digest[:12]})"
        return "no vocabulary (ids hashed or range-checked)"

    def saved(self, built: Vocabulary | None) -> dict[str, Any] | None:
        v = self.vocab
        if v is None:
            return None
        values = v if isinstance(v, Vocabulary) else built
        return {
            "from_data": dataclasses.asdict(v) if isinstance(v, VocabFromData) else None,
            "capacity": self.capacity,
            "source": None if values is None else values.source,
            "kind": None if values is None else values.kind,
            "values": None if values is None else list(values.values),
        }

    @staticmethod
    def from_saved(saved: Mapping[str, Any] | None) -> tuple[_Config, Vocabulary | None]:
        if saved is None:
            return _Config(None), None
        values = saved["values"]
        if saved["from_data"] is not None:
            cfg = VocabFromData(**saved["from_data"])
            built = None if values is None else Vocabulary(
                values, kind=saved["kind"], source=saved["source"], built_from=cfg)
            return _Config(cfg, int(saved["capacity"])), built
        fixed = Vocabulary(values, kind=saved["kind"], source=saved["source"])
        return _Config(fixed), None


class Vocabularies:
    """The vocabularies of a Trainer's datasets, as one checkpoint component (``Stateful``).

    ``attach(dataset)`` records how each of its id features maps ids (and refuses a feature
    mapped differently by another dataset or the restored checkpoint); ``build(train_dataset)``
    builds the pending ``VocabFromData`` vocabularies from its first windows, the same on every
    rank; every attached dataset then decodes with them. ``state_dict`` holds every id feature's
    configuration and vocabulary (the same on every rank); ``load_state_dict`` restores them
    after checking they match this run's configuration.
    """

    needed_for_scoring = True
    """A scoring restore (``resume(mode="scoring")``: ``run: evaluate`` / ``run: predict``)
    loads it with the model: the model's rows mean the values of these vocabularies."""

    def __init__(self, gang: Gang) -> None:
        self._gang = gang
        self._configs: dict[str, _Config] = {}
        self._origin: dict[str, str] = {}
        """Where each configuration came from, for messages."""
        self._sources: dict[str, tuple[str, ...]] = {}
        self._built: dict[str, Vocabulary] = {}
        """``VocabFromData`` features' vocabularies, built or restored."""
        self._datasets: list[VocabDataset] = []

    def __getitem__(self, feature: str) -> Vocabulary:
        """The vocabulary feature ``feature`` decodes with (KeyError if it has none yet)."""
        v = self._built.get(feature)
        if v is None:
            cfg = self._configs.get(feature)
            if cfg is None or not isinstance(cfg.vocab, Vocabulary):
                raise KeyError(f"feature {feature!r} has no vocabulary"
                               + (" yet (built when training starts)" if cfg is not None
                                  and isinstance(cfg.vocab, VocabFromData) else ""))
            v = cfg.vocab
        return v

    @property
    def pending(self) -> list[str]:
        """Features whose vocabulary is still to be built from the data."""
        return [n for n, c in self._configs.items()
                if isinstance(c.vocab, VocabFromData) and n not in self._built]

    def attach(self, dataset: VocabDataset, what: str = "a dataset") -> None:
        """Record ``dataset``'s id features and decode it with the vocabularies known so far."""
        spec = dataset.features
        if spec is None:
            return
        for f in spec.id_features:
            cfg = _Config.of(f)
            if f.name in self._configs:
                known = self._configs[f.name]
                if not known.same(cfg):
                    raise ValueError(
                        f"id feature {f.name!r} is mapped with {known.text()} by "
                        f"{self._origin[f.name]}, but with {cfg.text()} by {what}: every dataset "
                        "of a Trainer (train, eval, predict) and the checkpoint it resumes must "
                        "map ids to the same rows; declare the same `vocab` everywhere.")
            else:
                self._configs[f.name] = cfg
                self._origin[f.name] = what
            self._sources.setdefault(f.name, tuple(f.sources))
        self._share()
        if not any(d is dataset for d in self._datasets):
            self._datasets.append(dataset)
        self._install(dataset)

    def build(self, dataset: VocabDataset | None) -> None:
        """Build the pending ``VocabFromData`` vocabularies from ``dataset``'s first windows (all
        ranks call this together); a no-op when none is pending."""
        groups = {key: names for key, names in self._groups().items()
                  if any(n not in self._built for n in names)}
        if not groups:
            return
        names = sorted(n for ns in groups.values() for n in ns)
        unread = [n for n in names if not self._sources.get(n)]
        if unread:
            raise ValueError(f"feature(s) {unread} take their vocabulary from the data, but no "
                             "dataset of this Trainer declares them: nothing says which columns "
                             "to count.")
        if dataset is None:
            raise ValueError(
                f"feature(s) {names} take their vocabulary from the data (VocabFromData), built "
                "from the first training window(s), but this Trainer has no train_dataset and no "
                "restored checkpoint holds them: resume from a checkpoint of the training run "
                "(args.resume_from) first, give the Trainer its train_dataset, or give the "
                "vocabularies as lists or files.")
        cfgs = {key: self._configs[ns[0]] for key, ns in groups.items()}
        depth = {key: cfg.vocab.windows for key, cfg in cfgs.items()
                 if isinstance(cfg.vocab, VocabFromData)}
        windows = list(itertools.islice(dataset.window_ids(), max(depth.values())))
        columns = {key: sorted({c for n in ns for c in self._sources.get(n, ())})
                   for key, ns in groups.items()}
        payload: tuple[str, Any]
        try:
            payload = ("ok", count_windows(dataset, windows, depth, columns))
        except Exception as exc:  # noqa: BLE001 - raised on every rank below, after the gather
            payload = ("error", f"{type(exc).__name__}: {exc}")
            local_error: Exception | None = exc
        else:
            local_error = None
        gathered = self._gang.all_gather_object(payload)
        failed = [(r, p[1]) for r, p in enumerate(gathered) if p[0] == "error"]
        if failed:
            rank, message = failed[0]
            raise ValueError(
                f"building the vocabularies of feature(s) {names} from train window(s) {windows} "
                f"failed on rank {rank}: {message}") from local_error
        for key, ns in groups.items():
            cfg = cfgs[key]
            assert isinstance(cfg.vocab, VocabFromData)
            used = windows[:cfg.vocab.windows]
            vocab = merge_and_freeze([p[1][key] for p in gathered], cfg.vocab, cfg.capacity, used,
                                     ns)
            if len(used) < cfg.vocab.windows:
                logger.warning("the vocabulary of %s asked for %d window(s), but the train data "
                               "has %d", ns, cfg.vocab.windows, len(used))
            if self._gang.rank == 0:
                logger.info("vocabulary of %s: %d values, %s", ns, len(vocab), vocab.source)
            for n in ns:
                self._built[n] = vocab
        for ds in self._datasets:
            self._install(ds)

    def _groups(self) -> dict[tuple[str, str], list[str]]:
        """``VocabFromData`` features by the vocabulary they share; refuses a shared vocabulary
        declared differently by its features."""
        out: dict[tuple[str, str], list[str]] = {}
        for n, c in self._configs.items():
            if isinstance(c.vocab, VocabFromData):
                key = ("shared", c.vocab.name) if c.vocab.name else ("feature", n)
                out.setdefault(key, []).append(n)
        for key, ns in out.items():
            first = self._configs[ns[0]]
            for n in ns[1:]:
                if not self._configs[n].same(first):
                    raise ValueError(
                        f"features {ns[0]!r} and {n!r} share the vocabulary {key[1]!r} "
                        f"(VocabFromData(name={key[1]!r})) but declare it differently: "
                        f"{first.text()} vs {self._configs[n].text()}; give them the same "
                        "VocabFromData and num_embeddings (and null_id).")
        return out

    def _share(self) -> None:
        """A feature that joins a shared vocabulary already built (or restored) gets it too;
        refuses a shared vocabulary declared differently by its features."""
        for ns in self._groups().values():
            have = next((self._built[n] for n in ns if n in self._built), None)
            if have is not None:
                for n in ns:
                    self._built.setdefault(n, have)

    def _install(self, dataset: VocabDataset) -> None:
        spec = dataset.features
        if spec is None:
            return
        mine = {f.name: self._built[f.name] for f in spec.id_features
                if f.name in self._built and f.vocab is not self._built[f.name]}
        if mine:
            dataset.set_vocabularies(mine)

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "features": {
            n: c.saved(self._built.get(n)) for n, c in sorted(self._configs.items())}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"version", "features"} or state["version"] != 1:
            raise ValueError(f"vocabularies state must be {{'version': 1, 'features': ...}}, but "
                             f"has keys {sorted(state)} (version {state.get('version')!r}).")
        for n, saved in state["features"].items():
            cfg, built = _Config.from_saved(saved)
            if n in self._configs:
                mine = self._configs[n]
                if not mine.same(cfg):
                    raise ValueError(
                        f"cannot resume: the checkpoint maps feature {n!r} with {cfg.text()}, but "
                        f"this run ({self._origin[n]}) with {mine.text()}; its table's rows would "
                        "mean other values. Resume with the checkpoint's vocab configuration, or "
                        "start a new run in a new output_dir.")
            else:
                self._configs[n] = cfg
                self._origin[n] = "the restored checkpoint"
            if built is not None:
                self._built[n] = built
        self._share()
        for ds in self._datasets:
            self._install(ds)


def saved_vocabulary(saved: Mapping[str, Any] | None) -> Vocabulary | None:
    """The ``Vocabulary`` one feature's entry of a checkpoint's ``vocabularies`` state decodes
    with (None for a feature mapped by hashing). Used to export a checkpoint's vocabularies."""
    cfg, built = _Config.from_saved(saved)
    vocab = built if built is not None else cfg.vocab
    return vocab if isinstance(vocab, Vocabulary) else None


__all__ = ["IdFeatureLike", "SpecLike", "VocabDataset", "Vocabularies", "saved_vocabulary"]
