"""Datasets: windows of batches, the cross-rank exit flag, and feature decoding.

The names below are imported on first use (PEP 562): decoding a table with
``recsys_trainer.data.spec`` (as the serving scorer does) does not import the datasets, the
synced exit flag or ``torch.distributed``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recsys_trainer.lazy import lazy_attributes

if TYPE_CHECKING:
    from recsys_trainer.data.base import IterableAsWindow, WindowedDataset, as_windowed
    from recsys_trainer.data.sync import SyncedIterator, SyncState

_LAZY: dict[str, str] = {
    "IterableAsWindow": "recsys_trainer.data.base",
    "SyncState": "recsys_trainer.data.sync",
    "SyncedIterator": "recsys_trainer.data.sync",
    "WindowedDataset": "recsys_trainer.data.base",
    "as_windowed": "recsys_trainer.data.base",
}

__all__ = ["IterableAsWindow", "SyncState", "SyncedIterator", "WindowedDataset", "as_windowed"]


__getattr__, __dir__ = lazy_attributes("recsys_trainer.data", _LAZY)


