"""Retrieval (candidate generation): two-tower and sequential models, their losses with
in-batch / mixed / sampled negatives and the logQ correction, a streaming item-frequency
estimator, exact full-corpus metrics and the item-corpus export. See docs/retrieval.md."""
