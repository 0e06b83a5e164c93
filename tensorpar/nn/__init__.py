"""tensorpar.nn: tensor-parallel layers, each checked against its dense counterpart.

Megatron-LM's partitions (Shoeybi et al. 2019): column- and row-parallel linears, the
vocab-parallel embedding and cross-entropy, the MLP and attention blocks split so that each
costs one all-reduce forward and one backward, and optional sequence parallelism between
blocks. Collectives go through :mod:`tensorpar.distributed`; the group is always passed as
``tp_group=`` (None: the world group). The partition math of each layer is in its docstring and
in docs/layers.md.
"""
from tensorpar.nn.attention import ParallelAttention, ReplicatedHeadLinear
from tensorpar.nn.attention_ops import KVCache
from tensorpar.nn.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.nn.dense import MLP, Attention
from tensorpar.nn.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tensorpar.nn.mlp import ParallelMLP
from tensorpar.nn.norm import SequenceParallelNorm, ShardedRMSNorm
from tensorpar.architecture.tp_rules import valid_attention_tp_sizes, valid_tp_sizes
from tensorpar.nn.random import ParallelDropout, RNGStatesTracker, model_parallel_seed

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "ParallelMLP", "ParallelAttention", "ReplicatedHeadLinear",
    "SequenceParallelNorm", "ShardedRMSNorm", "ParallelDropout", "RNGStatesTracker", "model_parallel_seed",
    "KVCache", "MLP", "Attention", "valid_tp_sizes", "valid_attention_tp_sizes",
]
