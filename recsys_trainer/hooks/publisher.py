"""Moved: the publisher (build, upload, point, rotate) is serving code,
``recsys_trainer.serving.exporting.publisher``. Its names stay importable from here."""

from recsys_trainer.serving.exporting.publisher import Publisher

__all__ = ["Publisher"]
