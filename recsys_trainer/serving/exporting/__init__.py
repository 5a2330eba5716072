"""The export side of serving: what the training job runs to turn a checkpoint into serving
artifacts and publish them, apart from what ``recsys-serve`` runs
(``recsys_trainer.serving.runtime``). ``export`` (``export_for_serving`` / ``export_delta``),
``model_parts`` (the model split into its tables and its dense program), ``artifact`` (writing
an artifact with its commit protocol), ``publisher`` (a committed checkpoint into a base or
delta at the published location, then ``LATEST``) and ``_publish_worker`` (the publisher
process ``PublishHook`` starts). They need the training stack (torchrec, FBGEMM); they write
the formats both sides share (``serving.manifest``, ``serving.delta``, ``serving.published``,
...).
"""
