"""Moved: the publisher (build, upload, point, rotate) is serving code,
``recsys_trainer.serving.exporting.publisher``. Its names stay importable from here."""

from recsys_trainer.serving.exporting.publisher import Publisher, worker_main

__all__ = ["Publisher", "worker_main"]
