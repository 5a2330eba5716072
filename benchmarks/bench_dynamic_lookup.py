"""A dynamic table's id lookup: binary search against the bucket index, by map and batch size.

    python benchmarks/bench_dynamic_lookup.py [--reps 5]

For each (slots, ids per batch): one dynamic table's id map (``DynamicMCHModule``, CPU) holding
ids in 3/4 of its slots; 40 batches of mixed ids, 3/4 of them resident. Timed, in alternating
rounds: ``torch.searchsorted`` over the sorted map (what batches below
``INDEXED_LOOKUP_MIN_IDS`` ids use) and ``DynamicMCHModule._indexed_positions`` (the bucket
index, rebuilt when the map changes: here once, outside the timing). Both give the same positions
(checked). Printed: ns per id, and the index's time as a multiple of the search's (median over
rounds).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from recsys_trainer.dynamic import DynamicEmbeddingBagCollection, DynamicTable, mc_modules
from recsys_trainer.dynamic.id_map import INDEXED_LOOKUP_MIN_IDS

CASES = ((1_600, 512), (1_600, 2_048), (100_000, 4_096), (1_000_000, 8_192))


def filled_map(slots: int, g: torch.Generator) -> Any:
    table = EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=slots,
                               feature_names=["f"])
    m: Any = mc_modules(DynamicEmbeddingBagCollection([table], DynamicTable(num_slots=slots)))["t"]
    ids = m._mch_sorted_raw_ids
    used = slots * 3 // 4
    ids[:used] = torch.randint(0, 2**63 - 1, (used,), generator=g).sort().values
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print(f"# bench_dynamic_lookup\n\n{platform.machine()}, {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}; batches of "
          f">= {INDEXED_LOOKUP_MIN_IDS} ids use the index in training\n")
    print("| slots | ids per batch | binary search ns/id | bucket index ns/id | index x search "
          "(median) |\n|---|---|---|---|---|")
    for slots, n in CASES:
        m = filled_map(slots, g)
        ids = m._mch_sorted_raw_ids
        used = slots * 3 // 4
        batches = [torch.cat([ids[torch.randint(0, used, (n * 3 // 4,), generator=g)],
                              torch.randint(0, 2**63 - 1, (n - n * 3 // 4,), generator=g)])
                   for _ in range(40)]
        for v in batches[:3]:
            assert torch.equal(m._indexed_positions(ids, v), torch.searchsorted(ids, v))
        times: dict[str, list[float]] = {"search": [], "index": []}
        for _ in range(a.reps):
            for k in times:
                t0 = time.perf_counter()
                for v in batches:
                    if k == "search":
                        torch.searchsorted(ids, v)
                    else:
                        m._indexed_positions(ids, v)
                times[k].append((time.perf_counter() - t0) / (len(batches) * n))
        ratio = statistics.median(i / s for i, s in zip(times["index"], times["search"], strict=True))
        print(f"| {slots:,} | {n:,} | {1e9 * statistics.median(times['search']):.1f} | "
              f"{1e9 * statistics.median(times['index']):.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
