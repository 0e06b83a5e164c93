"""The tensor-parallel transformer MLP (Shoeybi et al. 2019, "Megatron-LM", sec. 3, eq. 3)."""
from __future__ import annotations

import torch
from torch import nn

from tensorpar.nn.dense import ACTIVATIONS, GATED, MLP, mlp_hidden
from tensorpar.nn.layers import ColumnParallelLinear, RowParallelLinear, enter_tp_region, tp_info
from tensorpar.architecture.tp_rules import divide
from tensorpar.nn.validation import (check_choice, check_dtype, check_last_dim,
                                     check_sequence_input)


class ParallelMLP(nn.Module):
    """``Y = act(X U) D + b`` with U (and the gate G) split by columns, D by rows.

    Rank i holds ``U_i, G_i: (H, F/p)`` and ``D_i: (F/p, H)``, and computes
    ``Y_i = act(X U_i) D_i`` (gated: ``(act(X G_i) * X U_i) D_i``), a partial sum of Y: the
    activation is elementwise, so it applies to each column shard without communication.

    - forward: one all-reduce of Y, ``N = B*T*H*e`` bytes, each rank sends 2(p-1)/p * N; the
      bias of D is added once after it.
    - backward: one all-reduce of dX (same N), issued once for the up and gate projections
      together since they share one input copy.
    - ``sequence_parallel``: X arrives as ``(B, T/p, H)``; the all-reduce pair becomes an
      all-gather of X before and a reduce-scatter of Y after (each (p-1)/p * N), mirrored in
      backward, plus an all-reduce of D's bias gradient.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, activation: str = "gelu",
                 bias: bool = True, tp_group=None, sequence_parallel: bool = False,
                 dtype=None, device=None):
        super().__init__()
        tp_size = tp_info(tp_group)[0]  # a non-member of tp_group is told so first
        check_choice(activation, "activation", tuple(ACTIVATIONS))
        divide(ffn_hidden_size, tp_size, "ffn_hidden_size")  # before allocating
        dense = MLP(hidden_size, ffn_hidden_size, activation=activation, bias=bias,
                    dtype=dtype, device=device)
        self._shard(dense, tp_group, sequence_parallel)

    @classmethod
    def from_dense(cls, mlp: MLP, *, tp_group=None, sequence_parallel: bool = False) -> "ParallelMLP":
        """This rank's shard of a dense ``tensorpar.nn.dense.MLP`` (or any module with the same
        ``activation``, ``gate_proj``, ``up_proj``, ``down_proj`` attributes)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._shard(mlp, tp_group, sequence_parallel)
        return self

    def _shard(self, mlp, tp_group, sequence_parallel):
        self.tp_size, self.tp_rank = tp_info(tp_group)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.activation = mlp.activation
        self.hidden_size = mlp.up_proj.in_features
        self.ffn_hidden_size = mlp.up_proj.out_features
        self.ffn_hidden_size_per_partition = divide(self.ffn_hidden_size, self.tp_size,
                                                    "ffn_hidden_size")
        gated = mlp.activation in GATED

        def column(linear):  # shares the block's single input copy / gather
            return ColumnParallelLinear.from_dense(linear, tp_group=tp_group, skip_input_comm=True)

        self.gate_proj = column(mlp.gate_proj) if gated else None
        self.up_proj = column(mlp.up_proj)
        self.down_proj = RowParallelLinear.from_dense(mlp.down_proj, tp_group=tp_group,
                                                      sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: (B, T, H)``, or ``(B, T/p, H)`` with sequence parallelism; same shape out."""
        check_last_dim(x, self.hidden_size, "hidden_size")
        check_dtype(x, self.up_proj.weight, type(self).__name__)
        if self.sequence_parallel:
            check_sequence_input(x, type(self).__name__)
        x = enter_tp_region(x, self.tp_group, self.sequence_parallel)  # (B, T, H)
        h_shard = mlp_hidden(x, self)  # (B, T, F/p)
        return self.down_proj(h_shard)  # (B, T, H) summed over ranks
