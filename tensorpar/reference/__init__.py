"""The numpy reference of tensor parallelism: the oracle the torch runtime is checked against.

numpy and the standard library only; it shares no code with the torch runtime. Row-vector
convention ``Y = X @ W``, ``W: (in, out)``, unless a name says otherwise (``rowwise_matvec``,
``colwise_matvec`` use ``y = W x``). See ``docs/reference.md``.
"""
from .advice import AxisAdvice, Collective, SplitOption, advise_matmul, advise_mlp, feasible_axes
from .bounds import gamma, matmul_error_bound, mlp_error_bound
from .collectives import OPS, CommLog, CommRecord, all_gather, all_reduce, broadcast, reduce_scatter
from .contraction import AXES, split_matmul
from .costs import (ring_allgather_bytes, ring_allreduce_bytes, ring_broadcast_bytes,
                    ring_reduce_scatter_bytes, shard_bytes)
from .demo import MLPDemoResult, run_mlp_demo
from .matvec import colwise_matvec, rowwise_matvec
from .partition import MODES, partition, partition_bounds, per_partition, unpartition
from .seed import column_parallel, mlp_tensor_parallel, row_parallel

__all__ = [
    # the seed API (also importable from the top level, ``tensorpar.column_parallel``, ...)
    "column_parallel", "row_parallel", "mlp_tensor_parallel", "shard_bytes", "ring_allreduce_bytes",
    # the column-vector convention y = W x
    "rowwise_matvec", "colwise_matvec",
    # N-d partition and a contraction split along a chosen axis
    "MODES", "partition", "partition_bounds", "per_partition", "unpartition", "AXES", "split_matmul",
    # simulated collectives and their byte log
    "OPS", "CommLog", "CommRecord", "all_reduce", "all_gather", "reduce_scatter", "broadcast",
    "ring_allgather_bytes", "ring_reduce_scatter_bytes", "ring_broadcast_bytes",
    # axis advice
    "AxisAdvice", "SplitOption", "Collective", "advise_matmul", "advise_mlp", "feasible_axes",
    # rounding bounds and the demo
    "gamma", "matmul_error_bound", "mlp_error_bound", "MLPDemoResult", "run_mlp_demo",
]
