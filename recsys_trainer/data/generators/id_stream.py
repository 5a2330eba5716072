"""A synthetic click stream over raw 64-bit ids with a planted per-id signal.

Each sparse feature draws ids from ``num_ids`` distinct raw ids spread over the int64 range
(``base + k * stride``, k Zipf-distributed so a few ids are frequent and most are rare, as in
real logs). Every id has its own effect on the click logit, drawn once; the label is Bernoulli
of the sigmoid of the sum of the row's id effects. A model can only learn an id's effect if the
id has its own row: that is what separates a hashed table that shares rows from a dynamic one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer.batch import Batch

_BASE = 1_000_000_007_000_000_000  # ids far above any table size: they must not be row numbers
_STRIDE = 7_919_000_003


@dataclass(frozen=True)
class IdStream:
    """``num_ids`` distinct ids per feature, Zipf exponent ``zipf``, effect scale ``strength``."""

    features: tuple[str, ...]
    num_ids: int
    num_dense: int = 4
    zipf: float = 1.05
    strength: float = 1.5
    seed: int = 0

    def _effects(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        return rng.normal(0.0, self.strength, size=(len(self.features), self.num_ids))

    def raw_id(self, k: np.ndarray) -> np.ndarray:
        """The raw id of the k-th id (any int64 in ``[0, 2**63 - 1)``)."""
        return (np.int64(_BASE) + k.astype(np.int64) * np.int64(_STRIDE)).astype(np.int64)

    def batches(self, num_batches: int, batch_size: int, seed: int) -> list[Batch]:
        """``num_batches`` batches, one id per feature per row; ``seed`` picks the rows."""
        rng = np.random.default_rng(seed)
        effects = self._effects()
        p = 1.0 / np.arange(1, self.num_ids + 1) ** self.zipf
        p /= p.sum()
        # A fixed random order so the frequent ids are not the smallest ones.
        order = np.random.default_rng(self.seed + 1).permutation(self.num_ids)
        out: list[Batch] = []
        nf = len(self.features)
        for _ in range(num_batches):
            k = order[rng.choice(self.num_ids, size=(nf, batch_size), p=p)]
            logit = effects[np.arange(nf)[:, None], k].sum(axis=0) - 0.5
            labels = rng.random(batch_size) < 1.0 / (1.0 + np.exp(-logit))
            ids = torch.from_numpy(self.raw_id(k).reshape(-1))
            sparse = KeyedJaggedTensor(
                keys=list(self.features), values=ids,
                lengths=torch.ones(nf * batch_size, dtype=torch.int32), stride=batch_size)
            out.append(Batch(
                dense=torch.from_numpy(rng.normal(size=(batch_size, self.num_dense)).astype(np.float32)),
                sparse=sparse, labels=torch.from_numpy(labels.astype(np.float32))))
        return out


@dataclass(frozen=True)
class ChurnStream:
    """A churny click stream over raw 63-bit ids, in windows (think hours), with a planted per-id
    signal and its oracle.

    - ``user``: ``num_users`` ids with power-law popularity (Zipf ``user_zipf`` over a random
      order), the same throughout;
    - ``item``: ``num_items`` ids that *appear and fade*: item ``i`` is born at a uniform time in
      ``[-1, windows)`` (in windows) and its popularity then decays as
      ``w_i * exp(-(t - born_i) / life_i)``, with ``w_i`` power-law (``item_zipf``) and
      ``life_i`` log-normal around ``item_life`` windows. So most items live for a few windows
      and a window brings new ones;
    - every id is a uniform random int64 in ``[0, 2**63 - 1)`` and has its own effect on the click
      logit, drawn once (``N(0, strength)``); the label is Bernoulli of
      ``sigmoid(bias + user effect + item effect)``, and ``Batch.passthrough["logit"]`` holds
      that true logit: the AUC of it is the oracle AUC (what a model that knew every effect
      would score);
    - 4 dense features of noise.

    ``window(w, batches, batch_size, seed)`` draws the rows of window ``w`` (row times uniform
    within it); a different ``seed`` draws different rows from the same distribution (a held-out
    sample of the same hour).
    """

    num_users: int = 20_000
    num_items: int = 20_000
    windows: int = 12
    user_zipf: float = 1.05
    item_zipf: float = 1.0
    item_life: float = 1.0
    strength: float = 1.0
    bias: float = -0.5
    num_dense: int = 4
    seed: int = 0
    features: tuple[str, str] = ("user", "item")

    def _world(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, 0xC4])
        hi = np.iinfo(np.int64).max - 1
        # 63-bit ids; the (astronomically unlikely) duplicate would only merge two ids' effects.
        users = rng.integers(0, hi, size=self.num_users, dtype=np.int64)
        items = rng.integers(0, hi, size=self.num_items, dtype=np.int64)
        user_p = 1.0 / np.arange(1, self.num_users + 1) ** self.user_zipf
        user_p = rng.permutation(user_p / user_p.sum())
        item_w = rng.permutation(1.0 / np.arange(1, self.num_items + 1) ** self.item_zipf)
        born = rng.uniform(-1.0, self.windows, size=self.num_items)
        life = self.item_life * np.exp(rng.normal(0.0, 0.5, size=self.num_items))
        return {"users": users, "items": items, "user_p": user_p, "item_w": item_w,
                "born": born, "life": life,
                "user_effect": rng.normal(0.0, self.strength, size=self.num_users),
                "item_effect": rng.normal(0.0, self.strength, size=self.num_items)}

    def window(self, w: int, batches: int, batch_size: int, seed: int) -> list[Batch]:
        """``batches`` batches of window ``w`` (one user and one item id per row)."""
        world = self._world()
        rng = np.random.default_rng([self.seed, w, seed])
        out: list[Batch] = []
        for b in range(batches):
            t = w + (b + 0.5) / batches
            age = t - world["born"]
            alive = (age >= 0) & (age < 8 * world["life"])
            idx = np.flatnonzero(alive)
            p = world["item_w"][idx] * np.exp(-age[idx] / world["life"][idx])
            items = idx[rng.choice(len(idx), size=batch_size, p=p / p.sum())]
            users = rng.choice(self.num_users, size=batch_size, p=world["user_p"])
            logit = self.bias + world["user_effect"][users] + world["item_effect"][items]
            labels = rng.random(batch_size) < 1.0 / (1.0 + np.exp(-logit))
            ids = np.concatenate([world["users"][users], world["items"][items]])
            sparse = KeyedJaggedTensor(
                keys=list(self.features), values=torch.from_numpy(ids),
                lengths=torch.ones(2 * batch_size, dtype=torch.int32), stride=batch_size)
            out.append(Batch(
                dense=torch.from_numpy(rng.normal(size=(batch_size, self.num_dense)).astype(np.float32)),
                sparse=sparse, labels=torch.from_numpy(labels.astype(np.float32)),
                passthrough={"logit": torch.from_numpy(logit.astype(np.float32))}))
        return out


__all__ = ["ChurnStream", "IdStream"]
