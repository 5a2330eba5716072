"""Which row a dynamic table's *unknown* id reads when served: the routing rule, as data.

Training (``recsys_trainer.dynamic``, torchrec's row-wise managed collision) sends a raw id to
the shard that owns its bucket and, when the id has no slot there, reads that shard's default
row (its last slot). The export writes the rule into the manifest as data::

    {"rule": "bucket_shard_default_row", "id_mix": "mul-xorshift-mul/1",
     "mix_multipliers": [A, B], "input_size": 2**63 - 1, "buckets": 2, "shards": 2}

and the default rows (one per shard, in shard order) beside the table. A server computes, for
a raw id ``x`` in ``[0, 2**63 - 1)``: ``m = mix(x)`` (``(x * A) mod 2**63``, then ``m ^ (m >>
32)``, then ``(m * B) mod 2**63``), ``bucket = m // ceil(input_size / buckets)``, ``shard =
bucket // (buckets / shards)``; the id reads ``default_rows[shard]``. (Checked against FBGEMM's
``block_bucketize_sparse_features``, which torchrec routes with, and end to end against
``trainer.predict`` on 2 ranks.)

The mixing is written out here, not imported from ``recsys_trainer.dynamic``: serving imports
no torchrec. ``tests/test_serving.py`` checks it equals ``dynamic.mix_ids``. A new rule (e.g. a
hashed fallback table) is a new ``rule`` value with its own branch in ``Routing.rows``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

ID_SPACE = 2**63 - 1
_MASK = 2**63 - 1
_MUL_A = 0x9E3779B97F4A7C15 & _MASK | 1
_MUL_B = 0xBF58476D1CE4E5B9 & _MASK | 1
ID_MIX = "mul-xorshift-mul/1"
RULE = "bucket_shard_default_row"
RULES = (RULE,)


def _mul_mod63(x: torch.Tensor, c: int) -> torch.Tensor:
    return torch.bitwise_and(x * c, _MASK)


def mix_ids(ids: torch.Tensor, multipliers: tuple[int, int] = (_MUL_A, _MUL_B)) -> torch.Tensor:
    """The bijection of ``[0, 2**63)`` dynamic tables apply before routing (int64 wraps)."""
    x = _mul_mod63(ids, multipliers[0])
    x = torch.bitwise_xor(x, torch.bitwise_right_shift(x, 32))
    return _mul_mod63(x, multipliers[1])


def check_ids(ids: torch.Tensor, table: str) -> None:
    """Training refuses a negative raw id (it would wrap onto another id's row): so do we."""
    if ids.numel() and bool((ids < 0).any()):
        bad = int(ids[ids < 0][0])
        raise ValueError(f"dynamic table {table!r} got the negative id {bad}; raw ids must be in "
                         "[0, 2**63) (hash or offset signed ids before they reach the table).")


@dataclass(frozen=True)
class Routing:
    """The rule an unknown id of one dynamic table follows (see the module docstring)."""

    rule: str
    buckets: int
    shards: int
    input_size: int = ID_SPACE
    multipliers: tuple[int, int] = (_MUL_A, _MUL_B)

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown routing rule {self.rule!r} (this reader knows {RULES}); "
                             "read the artifact with the version that wrote it.")
        if self.shards < 1 or self.buckets % self.shards:
            raise ValueError(f"routing with {self.buckets} buckets over {self.shards} shards: "
                             "buckets must be a positive multiple of shards.")

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "id_mix": ID_MIX, "mix_multipliers": list(self.multipliers),
                "input_size": self.input_size, "buckets": self.buckets, "shards": self.shards}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Routing:
        if raw.get("id_mix") != ID_MIX:
            raise ValueError(f"unknown id mixing {raw.get('id_mix')!r} (this reader knows {ID_MIX!r}).")
        a, b = raw["mix_multipliers"]
        return cls(rule=raw["rule"], buckets=int(raw["buckets"]), shards=int(raw["shards"]),
                   input_size=int(raw["input_size"]), multipliers=(int(a), int(b)))

    def default_row(self, ids: torch.Tensor) -> torch.Tensor:
        """Index into the table's default rows for each raw id (int64)."""
        if self.shards == 1:
            return torch.zeros_like(ids)
        block = -(-self.input_size // self.buckets)
        bucket = torch.div(mix_ids(ids, self.multipliers), block, rounding_mode="floor")
        return torch.div(bucket, self.buckets // self.shards, rounding_mode="floor")
