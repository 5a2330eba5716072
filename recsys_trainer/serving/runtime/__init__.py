"""The serving runtime: what ``recsys-serve`` runs, apart from what the training job runs to
export and publish (``recsys_trainer.serving.exporting``). ``scorer`` (``Scorer``: an artifact
loaded and rows scored through the training code's own decoding), ``tables`` (its embedding
part in plain torch), ``follow`` (``Follower``: a scorer kept at the model a job publishes) and
``server`` (the HTTP server). None of them imports torchrec, FBGEMM or ``torch.distributed``'s
training machinery; they read the formats both sides share (``serving.manifest``,
``serving.delta``, ``serving.published``, ...).
"""
