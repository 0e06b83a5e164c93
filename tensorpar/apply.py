"""``tensorpar.parallelize`` (the implementation lives in :mod:`tensorpar.sharding.pipeline`)."""
from tensorpar.sharding.pipeline import parallelize

__all__ = ["parallelize"]
