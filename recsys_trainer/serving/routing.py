"""Which row a dynamic table's *unknown* id reads when served: the routing rule, as data.

Training (``recsys_trainer.dynamic``, on torchrec's row-wise managed collision) sends a raw id
to the shard that owns its block of the (mixed) id space and, when the id has no row there,
reads one of that shard's fallback rows (its last ``rows_per_shard`` rows), chosen by the id's
position in the id space. The export writes the rule into the manifest as data::

    {"rule": "shard_fallback_rows", "id_mix": "mul-xorshift-mul/1", "mix_multipliers": [A, B],
     "input_size": 2**63 - 1, "shards": 2, "rows_per_shard": 1}

and the fallback rows beside the table (``default_rows``: shard-major, ``shards *
rows_per_shard`` rows, each shard's in id-space order). A server computes, for a raw id ``x``
in ``[0, 2**63 - 1)``: ``m = mix(x)`` (``(x * A) mod 2**63``, then ``m ^ (m >> 32)``, then
``(m * B) mod 2**63``), ``shard = m // ceil(input_size / shards)`` (FBGEMM's block
bucketization, which torchrec routes with); with one row per shard the id reads
``default_rows[shard]``, else ``g = floor(m * shards * rows_per_shard / 2**63)`` and it reads
``default_rows[shard * rows_per_shard + clamp(g - shard * rows_per_shard, 0,
rows_per_shard - 1)]`` (``DynamicMCHModule.fallback_slots``). Checked against the training
module's own ``fallback_slots`` and FBGEMM's bucketization, and end to end against
``trainer.predict`` on 2 ranks.

The mixing is written out here, not imported from ``recsys_trainer.dynamic``: serving imports
no torchrec. ``tests/test_serving.py`` checks it equals ``dynamic.mix_ids``. Another rule (a
table-wide hashed fallback table, say) is a new ``rule`` value with its branch in
``Routing.default_row``.
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
RULE = "shard_fallback_rows"
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
    shards: int
    rows_per_shard: int = 1
    input_size: int = ID_SPACE
    multipliers: tuple[int, int] = (_MUL_A, _MUL_B)

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown routing rule {self.rule!r} (this reader knows {RULES}); "
                             "read the artifact with the version that wrote it.")
        if self.shards < 1 or self.rows_per_shard < 1:
            raise ValueError(f"routing over {self.shards} shards x {self.rows_per_shard} rows: "
                             "both must be >= 1.")

    @property
    def rows(self) -> int:
        """Fallback rows of the table (``default_rows`` holds as many)."""
        return self.shards * self.rows_per_shard

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "id_mix": ID_MIX, "mix_multipliers": list(self.multipliers),
                "input_size": self.input_size, "shards": self.shards,
                "rows_per_shard": self.rows_per_shard}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Routing:
        if raw.get("id_mix") != ID_MIX:
            raise ValueError(f"unknown id mixing {raw.get('id_mix')!r} (this reader knows {ID_MIX!r}).")
        a, b = raw["mix_multipliers"]
        return cls(rule=raw["rule"], shards=int(raw["shards"]),
                   rows_per_shard=int(raw["rows_per_shard"]), input_size=int(raw["input_size"]),
                   multipliers=(int(a), int(b)))

    def default_row(self, ids: torch.Tensor) -> torch.Tensor:
        """Index into the table's ``default_rows`` for each raw id (int64)."""
        if self.rows == 1:
            return torch.zeros_like(ids)
        mixed = mix_ids(ids, self.multipliers)
        shard = torch.div(mixed, -(-self.input_size // self.shards), rounding_mode="floor")
        if self.rows_per_shard == 1:
            return shard
        f = self.rows_per_shard
        # floor(mixed * rows / 2**63) in exact integer arithmetic (rows < 2**31).
        hi = torch.bitwise_right_shift(mixed, 32)
        lo = torch.bitwise_and(mixed, 0xFFFFFFFF)
        g = torch.bitwise_right_shift(
            hi * self.rows + torch.bitwise_right_shift(lo * self.rows, 32), 31)
        return shard * f + (g - shard * f).clamp(0, f - 1)
