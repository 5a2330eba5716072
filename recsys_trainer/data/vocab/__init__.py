"""Vocabularies: categorical ids (strings, small integers) mapped to table rows by a list.

A hashed id column (the default for strings) maps values to rows by a stable hash modulo the
table size, so distinct values share rows even in tables larger than the column's cardinality
(73 distinct strings hashed into 74 rows land on 45 of them). A vocabulary maps its entry ``i``
to row ``i + 1`` and every other value to row ``OOV_ROW`` (0), the out-of-vocabulary row::

    SparseFeature(name="genre", vocab=["Action", "Comedy", ...])          # a list: rows 1..n
    SparseFeature(name="country", vocab="s3://bucket/vocab/country.txt")  # a file, one per line
    SparseFeature(name="year", num_embeddings=128,                        # built from the data
                  vocab=VocabFromData(windows=1, min_count=5))

The table then needs ``len(vocab) + 1`` rows; ``num_embeddings`` is derived from a list or file
when left unset. A ``VocabFromData`` vocabulary is built when training starts, from the first
``windows`` training windows, and keeps the ``num_embeddings - 1`` most frequent values seen at
least ``min_count`` times. A null value has no id (an empty bag), as without a vocabulary;
``null_id=0`` sends nulls to the OOV row, ``null_id=len(vocab) + 1`` (with a table one row
larger) gives them a row of their own.

* ``Vocabulary``: a frozen, duplicate-free list of strings or integers and its vectorised lookup
  (``pyarrow.compute.index_in`` up to ``INDEX_IN_MAX_SIZE`` entries; above that a search in a
  sorted array, because ``index_in`` rebuilds a hash table of the whole vocabulary per call).
* ``VocabFromData``: how to build one from the data.
* ``check_vocab``: the validation ``SparseFeature`` / ``SequenceFeature`` run at construction.
* ``Vocabularies``: the Trainer's checkpoint component. It builds the ``VocabFromData``
  vocabularies once, identically on every rank (each rank counts its own rows of the first
  windows, the counts are all-gathered and merged the same way everywhere), hands them to every
  dataset (train, eval, predict), and saves them, so a resumed run, ``evaluate`` and ``predict``
  use the same mapping; a resume with another vocabulary configuration is refused.

Where each part lives (this package re-exports every public name, so import from here):

* ``recsys_trainer.data.vocab.lookup``: ``Vocabulary``, ``VocabFromData`` and the lookup.
* ``recsys_trainer.data.vocab.features``: ``VocabArg``, ``check_vocab`` and the decoder's and
  planner's calls (``lookup_rows``, ``column_problem``, ``check_tables_share_vocabularies``).
* ``recsys_trainer.data.vocab.build``: counting the first windows and merging the counts.
* ``recsys_trainer.data.vocab.state``: ``Vocabularies`` and ``saved_vocabulary`` (the saved
  format, written and read).
"""

from __future__ import annotations

from recsys_trainer.data.vocab.features import (
    VocabArg,
    check_tables_share_vocabularies,
    check_vocab,
    column_problem,
    lookup_rows,
    vocabulary_capacity,
)

# INDEX_IN_MAX_SIZE is read where the lookup is made: changing it (a test lowering it) means
# setting recsys_trainer.data.vocab.lookup.INDEX_IN_MAX_SIZE, not this module's copy.
from recsys_trainer.data.vocab.lookup import INDEX_IN_MAX_SIZE, OOV_ROW, VocabFromData, Vocabulary
from recsys_trainer.data.vocab.state import VocabDataset, Vocabularies, saved_vocabulary

__all__ = [
    "INDEX_IN_MAX_SIZE",
    "OOV_ROW",
    "VocabArg",
    "VocabDataset",
    "VocabFromData",
    "Vocabularies",
    "Vocabulary",
    "check_tables_share_vocabularies",
    "check_vocab",
    "column_problem",
    "lookup_rows",
    "saved_vocabulary",
    "vocabulary_capacity",
]
