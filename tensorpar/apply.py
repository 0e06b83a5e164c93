"""``tensorpar.parallelize`` (the implementation lives in :mod:`tensorpar.sharding.apply`)."""
from tensorpar.sharding.apply import parallelize

__all__ = ["parallelize"]
