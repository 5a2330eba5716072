"""Moved to ``recsys_trainer.serving.runtime.follow`` (the serving runtime lives apart from the
export side). This path keeps working: it re-exports the module's public names."""

from recsys_trainer.serving.runtime.follow import (
    ErrorKind,
    Follower,
    FollowError,
    NoModelError,
    Served,
    follow,
)

__all__ = ["ErrorKind", "FollowError", "Follower", "NoModelError", "Served", "follow"]
