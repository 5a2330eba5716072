"""A dynamic table's id lookup: binary search against the bucket index, by map and batch size.

    python benchmarks/bench_dynamic_lookup.py [--reps 5] [--bits-below 2 3]

For each (slots, ids per batch): one dynamic table's id map (``DynamicMCHModule``, CPU) holding
ids in 3/4 of its slots; 40 batches of mixed ids, 3/4 of them resident. Timed, in alternating
rounds: ``torch.searchsorted`` over the sorted map (what batches below
``INDEXED_LOOKUP_MIN_IDS`` ids use) and ``DynamicMCHModule._indexed_positions`` (the bucket
index, rebuilt when the map changes: here once, outside the timing), its buckets as
``id_map.index_bits`` sets them and, for each ``--bits-below b``, ``2**(bit_length(slots - 1) -
b)`` buckets instead (a bucket per ``2**(b-1)`` to ``2**b`` slots; b = 2 was the rule before
``index_bits``): the same map, one index each, timed in the same rounds. All give the same
positions (checked). Printed: ns per id, each index's time as a multiple of the search's
(median over rounds), and its bytes a slot.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from typing import Any

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from recsys_trainer.dynamic import DynamicEmbeddingBagCollection, DynamicTable, id_map, mc_modules
from recsys_trainer.dynamic.id_map import INDEXED_LOOKUP_MIN_IDS

CASES = ((1_600, 512), (1_600, 1_024), (1_600, 2_048), (4_097, 2_048), (100_000, 4_096),
         (1_000_000, 8_192))


def filled_map(slots: int, g: torch.Generator) -> Any:
    table = EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=slots,
                               feature_names=["f"])
    m: Any = mc_modules(DynamicEmbeddingBagCollection([table], DynamicTable(num_slots=slots)))["t"]
    ids = m._mch_sorted_raw_ids
    used = slots * 3 // 4
    ids[:used] = torch.randint(0, 2**63 - 1, (used,), generator=g).sort().values
    return m


def indexed_map(m: Any, bits_below: int | None, v: torch.Tensor) -> Any:
    """A copy of map ``m`` with its bucket index built now (by a lookup of ``v``): as
    ``id_map.index_bits`` sets it, or with ``2**(bit_length(slots - 1) - bits_below)`` buckets."""
    twin: Any = copy.deepcopy(m)
    in_use = id_map.index_bits
    if bits_below is not None:
        id_map.index_bits = lambda slots: max(1, (slots - 1).bit_length() - bits_below)
    try:
        twin._indexed_positions(twin._mch_sorted_raw_ids, v)
    finally:
        id_map.index_bits = in_use
    return twin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bits-below", type=int, nargs="*", default=[],
                    help="also time an index of 2**(bit_length(slots - 1) - b) buckets for each b")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print(f"# bench_dynamic_lookup\n\n{platform.machine()}, {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}; batches of "
          f">= {INDEXED_LOOKUP_MIN_IDS} ids use the index in training\n")
    rules: list[int | None] = [None, *a.bits_below]
    heads = ["index_bits" if b is None else f"bits below {b}" for b in rules]
    print("| slots | ids per batch | binary search ns/id | "
          + " | ".join(f"index ({h}) ns/id | x search | bytes a slot" for h in heads)
          + " |\n|---|---|---|" + "---|---|---|" * len(heads))
    for slots, n in CASES:
        m = filled_map(slots, g)
        used = slots * 3 // 4
        ids = m._mch_sorted_raw_ids
        batches = [torch.cat([ids[torch.randint(0, used, (n * 3 // 4,), generator=g)],
                              torch.randint(0, 2**63 - 1, (n - n * 3 // 4,), generator=g)])
                   for _ in range(40)]
        maps = {h: indexed_map(m, b, batches[0]) for h, b in zip(heads, rules, strict=True)}
        for twin in maps.values():
            for v in batches[:3]:
                assert torch.equal(twin._indexed_positions(twin._mch_sorted_raw_ids, v),
                                   torch.searchsorted(ids, v))
        times: dict[str, list[float]] = {"search": [], **{h: [] for h in heads}}
        for _ in range(a.reps):
            for k in times:
                twin = maps.get(k)
                t0 = time.perf_counter()
                for v in batches:
                    if twin is None:
                        torch.searchsorted(ids, v)
                    else:
                        twin._indexed_positions(twin._mch_sorted_raw_ids, v)
                times[k].append((time.perf_counter() - t0) / (len(batches) * n))
        cells = []
        for h in heads:
            ratio = statistics.median(i / s for i, s in zip(times[h], times["search"],
                                                             strict=True))
            cells.append(f"{1e9 * statistics.median(times[h]):.1f} | {ratio:.2f}x | "
                         f"{maps[h]._lookup_index.nbytes / slots:.2f}")
        print(f"| {slots:,} | {n:,} | {1e9 * statistics.median(times['search']):.1f} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
