"""Training from a Kafka topic: ``KafkaWindowDataset`` (event-time windows, offsets in the job's
checkpoints), its options, and the errors it names. See docs/kafka.md.

Modules: ``dataset`` (the dataset, the ranks' agreements on closed windows, and its following
view for ``train_and_evaluate``), ``positions`` (the checkpointed position, and what a new or
resumed run asks the broker), ``reading`` (a rank's share of a window into batches),
``options`` (``KafkaSourceOptions``), ``windowing`` (the window rules and the ranks' shares, no
Kafka), ``tracker`` (a rank's reading thread), ``formats`` (message formats), ``client`` (the
broker side: settings, errors, reading spans again, dead letters), ``mock_broker`` (librdkafka's
mock cluster as a process, for tests and examples). The names below are imported on first use
(PEP 562): the mock broker's process imports no training stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recsys_trainer.lazy import lazy_attributes

if TYPE_CHECKING:
    from recsys_trainer.data.kafka.client import (
        BrokerUnavailableError,
        KafkaSourceError,
        OffsetsOutOfRangeError,
        PartitionsChangedError,
        TopicMissingError,
    )
    from recsys_trainer.data.kafka.dataset import KafkaFollowingWindows, KafkaWindowDataset
    from recsys_trainer.data.kafka.options import KafkaSourceOptions
    from recsys_trainer.data.kafka.positions import KafkaStats

_CLIENT = "recsys_trainer.data.kafka.client"
_DATASET = "recsys_trainer.data.kafka.dataset"
_LAZY: dict[str, str] = {
    "BrokerUnavailableError": _CLIENT, "KafkaSourceError": _CLIENT,
    "OffsetsOutOfRangeError": _CLIENT, "PartitionsChangedError": _CLIENT,
    "TopicMissingError": _CLIENT, "KafkaFollowingWindows": _DATASET,
    "KafkaStats": "recsys_trainer.data.kafka.positions",
    "KafkaWindowDataset": _DATASET, "KafkaSourceOptions": "recsys_trainer.data.kafka.options",
}

__all__ = ["BrokerUnavailableError", "KafkaFollowingWindows", "KafkaSourceError",
           "KafkaSourceOptions", "KafkaStats", "KafkaWindowDataset", "OffsetsOutOfRangeError",
           "PartitionsChangedError", "TopicMissingError"]

__getattr__, __dir__ = lazy_attributes("recsys_trainer.data.kafka", _LAZY)
