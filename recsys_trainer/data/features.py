"""The feature API in one import: ``FeatureSpec`` and the features it declares.

``from recsys_trainer.data.features import FeatureSpec, DenseFeature, SparseFeature`` is the
documented way in. Each concern lives in its own module: ``spec`` (``FeatureSpec``: validation,
schema checks, decoding a table), ``inputs`` (``DenseFeature``, ``SparseFeature``,
``SequenceFeature``), ``decode`` (a feature's column(s) -> numpy ids or values), ``chunk``
(``DecodedChunk`` -> ``Batch``), ``hashing`` (the stable 64-bit hash), ``vocab``
(vocabularies: ``VocabFromData``, ``Vocabulary``) and ``errors`` (``DataError``).
"""

from recsys_trainer.data.chunk import DecodedChunk
from recsys_trainer.data.errors import DataError
from recsys_trainer.data.hashing import stable_hash_ints, stable_hash_strings
from recsys_trainer.data.inputs import DenseFeature, SequenceFeature, SparseFeature
from recsys_trainer.data.spec import FeatureSpec, check_features_fit_tables
from recsys_trainer.data.vocab import VocabFromData, Vocabulary

__all__ = [
    "DataError",
    "DecodedChunk",
    "DenseFeature",
    "FeatureSpec",
    "SequenceFeature",
    "SparseFeature",
    "VocabFromData",
    "Vocabulary",
    "check_features_fit_tables",
    "stable_hash_ints",
    "stable_hash_strings",
]
