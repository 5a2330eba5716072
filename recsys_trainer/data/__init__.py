"""Datasets: windows of batches, the cross-rank exit flag, and feature decoding."""

from recsys_trainer.data.base import IterableAsWindow, WindowedDataset, as_windowed
from recsys_trainer.data.sync import SyncedIterator, SyncState

__all__ = ["IterableAsWindow", "SyncState", "SyncedIterator", "WindowedDataset", "as_windowed"]
