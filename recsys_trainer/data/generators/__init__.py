"""Data for the examples, tests and benchmarks, apart from the reader: the synthetic logs with
planted signals (``criteo_synthetic``, ``interactions_synthetic``, ``churn_dataset`` over the
``id_stream`` ids, in-memory ``synthetic`` batches), a click stream landed while a job trains
(``stream_writer``), the Open Bandit converter (``open_bandit``), and how each generated file and
dataset is written (``generated``). The reader (``recsys_trainer.data``) never imports them.

Each generator with a command runs as ``python -m recsys_trainer.data.generators.<name>``.
"""
