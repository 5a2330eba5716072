"""The sequence KJTs the retrieval models assemble for their item-table lookups: the batch with
one more row of ids (uniform negatives, looked up in the same call as the batch), a KJT of
items outside a batch (the corpus), and the batch's keys that tables read (``table_input``). ``torch.fx`` leaves: their sizes depend on data.

``torch.fx.wrap`` patches the function in the globals of the module that calls it: a module
that calls these by name (``models.retrieval_base``) registers them again.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def with_extra_row(sequence: KeyedJaggedTensor, extra: Mapping[str, torch.Tensor]) -> KeyedJaggedTensor:
    """``sequence`` with one more row holding ``extra[key]`` ids for the keys given (none for
    the others): ids the model looks up in the same call as the batch (uniform negatives)."""
    values, lengths = [], []
    for key, jt in zip(sequence.keys(), sequence.split([1] * len(sequence.keys())), strict=True):
        ids = extra.get(key)
        v = jt.values()
        ln = jt.lengths()
        if ids is None:
            values.append(v)
            lengths.append(torch.cat([ln, ln.new_zeros(1)]))
        else:
            values.append(torch.cat([v, ids.to(v.dtype)]))
            lengths.append(torch.cat([ln, ln.new_full((1,), ids.numel())]))
    return KeyedJaggedTensor.from_lengths_sync(keys=sequence.keys(), values=torch.cat(values),
                                               lengths=torch.cat(lengths))


def items_only_input(keys: list[str], item_ids: Mapping[str, torch.Tensor]) -> KeyedJaggedTensor:
    """A sequence KJT with the model's ``keys`` where each key in ``item_ids`` holds one id per
    row and the others none: the item tower's input for items outside a batch (the corpus)."""
    first = next(iter(item_ids.values()))
    n, device = first.numel(), first.device
    # Built where the ids are (the model's device): no round trip through the host.
    values, lengths = [], []
    for key in keys:
        ids = item_ids.get(key)
        if ids is None:
            lengths.append(torch.zeros(n, dtype=torch.int32, device=device))
        else:
            values.append(ids.to(device, torch.int64))
            lengths.append(torch.ones(n, dtype=torch.int32, device=device))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values) if values else torch.zeros(0, dtype=torch.int64, device=device),
        lengths=torch.cat(lengths))


def table_input(sequence: KeyedJaggedTensor, num_table_keys: int) -> KeyedJaggedTensor:
    """The first ``num_table_keys`` keys of ``sequence``: what the model's tables read, without
    the keys after them that carry values (event times), not ids of a table. A slice of the
    key-major values, no copy of the ids; a sharded collection refuses keys it has no table for."""
    if num_table_keys == len(sequence.keys()):
        return sequence
    return sequence.split([num_table_keys, len(sequence.keys()) - num_table_keys])[0]


for _leaf in ("with_extra_row", "items_only_input", "table_input"):
    torch.fx.wrap(_leaf)


__all__ = ["items_only_input", "table_input", "with_extra_row"]
