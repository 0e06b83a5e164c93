"""Norms on sequence-parallel activations (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", sec. 4.2.2).

With sequence parallelism the activations between blocks are ``(B, T/p, H)`` chunks of the
sequence. LayerNorm and RMSNorm normalise each token on its own, so they run on the chunk
unchanged; but each rank's weight (and bias) gradient then sums over its T/p tokens only, and
the ranks' gradients must be added to get the dense gradient.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar import distributed as dist
from tensorpar.nn.layers import tp_info
from tensorpar.nn.validation import check_choice, check_dtype, check_last_dim


class SequenceParallelNorm(nn.Module):
    """LayerNorm or RMSNorm over the last dim of a ``(B, T/p, H)`` sequence chunk.

    Parameters are replicated (``weight``, ``bias`` named as in ``nn.LayerNorm`` / ``nn.RMSNorm``).

    - forward: no communication (per-token normalisation).
    - backward: all-reduce of each parameter's gradient over the tp group,
      2(p-1)/p * H*e bytes per parameter (the parameter passes through ``copy_to_tp_region``).
    """

    def __init__(self, hidden_size: int, *, kind: str = "rmsnorm", eps: float | None = 1e-5,
                 bias: bool = True, tp_group=None, dtype=None, device=None):
        super().__init__()
        tp_info(tp_group)  # a non-member of tp_group is told so before anything else
        check_choice(kind, "kind", ("rmsnorm", "layernorm"))
        dense = (nn.RMSNorm(hidden_size, eps=eps, dtype=dtype, device=device) if kind == "rmsnorm"
                 else nn.LayerNorm(hidden_size, eps=eps, bias=bias, dtype=dtype, device=device))
        self._load(dense, tp_group)

    @classmethod
    def from_dense(cls, norm: nn.Module, *, tp_group=None) -> "SequenceParallelNorm":
        """A copy of ``norm`` (``nn.LayerNorm`` or ``nn.RMSNorm`` over one dim, with weights)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._load(norm, tp_group)
        return self

    def _load(self, norm, tp_group):
        self.tp_size, self.tp_rank = tp_info(tp_group)
        if not isinstance(norm, (nn.LayerNorm, nn.RMSNorm)) or len(norm.normalized_shape) != 1 \
                or not norm.elementwise_affine:
            raise ValueError(f"SequenceParallelNorm wraps an affine nn.LayerNorm or nn.RMSNorm over "
                             f"one dim; got {norm!r}")
        self.kind = "layernorm" if isinstance(norm, nn.LayerNorm) else "rmsnorm"
        self.hidden_size, self.eps = norm.normalized_shape[0], norm.eps
        self.tp_group = tp_group
        with torch.no_grad():
            self.weight = nn.Parameter(norm.weight.detach().clone(), norm.weight.requires_grad)
            bias = getattr(norm, "bias", None)
            self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                               bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_last_dim(x, self.hidden_size, "hidden_size")
        check_dtype(x, self.weight, type(self).__name__)
        weight = dist.copy_to_tp_region(self.weight, group=self.tp_group)  # dW all-reduced
        shape = (self.hidden_size,)
        if self.kind == "rmsnorm":
            return F.rms_norm(x, shape, weight, self.eps)  # (B, T/p, H)
        bias = None if self.bias is None else dist.copy_to_tp_region(self.bias, group=self.tp_group)
        return F.layer_norm(x, shape, weight, bias, self.eps)  # (B, T/p, H)

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.hidden_size}, eps={self.eps}, tp_size={self.tp_size}"


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a dimension that is split over the ranks (OLMo-2 normalises all query heads
    together, ``q_norm`` over ``n_heads * head_dim`` features, after a column split of q).

    ``y = x / sqrt(mean(x^2) + eps) * w`` with the mean over the full dimension ``N``: each rank
    holds ``x_i`` and ``w_i`` (its features), computes ``s_i = sum(x_i^2)`` per token and the ranks
    add them, so every rank divides by the same full statistic.

    - forward: one all-reduce of the per-token sums, ``B*T*4`` bytes (float32).
    - backward: one all-reduce of their gradient: each rank's part of the loss reaches ``s`` only
      through its own features, and every ``s_i`` moves all of them.

    Like Hugging Face's RMSNorms it computes in float32 and returns the input's dtype.
    ``replicas``: ranks holding the same features (a KV head replicated because there are fewer KV
    heads than ranks): the summed statistic counts them ``replicas`` times and is divided back.
    """

    def __init__(self, weight_shard: torch.Tensor, eps: float, full_size: int, *, tp_group=None,
                 requires_grad: bool = True, replicas: int = 1):
        super().__init__()
        self.tp_size, self.tp_rank = tp_info(tp_group)
        self.tp_group, self.eps, self.full_size, self.replicas = tp_group, eps, full_size, replicas
        self.weight = nn.Parameter(weight_shard.detach().clone(), requires_grad)

    @classmethod
    def from_dense(cls, norm: nn.Module, pieces: tuple, *, tp_group=None, replicas: int = 1) -> "ShardedRMSNorm":
        """This rank's features ``pieces`` (``((start, end), ...)``) of an RMSNorm's weight."""
        eps = getattr(norm, "variance_epsilon", None)
        eps = getattr(norm, "eps", None) if eps is None else eps
        if not isinstance(eps, float) or norm.weight.dim() != 1:
            raise ValueError(f"{type(norm).__name__} is not an RMSNorm with a 1-D weight and an eps "
                             f"(variance_epsilon or eps); it cannot be split")
        shard = torch.cat([norm.weight[a:b] for a, b in pieces])
        return cls(shard, eps, norm.weight.shape[0], tp_group=tp_group, requires_grad=norm.weight.requires_grad,
                   replicas=replicas)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_last_dim(x, self.weight.shape[0], "normalized features per partition")
        dtype = x.dtype
        h = x.to(torch.float32)
        ss = h.pow(2).sum(-1, keepdim=True)  # (..., 1) this rank's features
        ss = dist.reduce_from_tp_region(dist.copy_to_tp_region(ss, group=self.tp_group), group=self.tp_group)
        if self.replicas > 1:
            ss = ss / self.replicas  # each replicated feature was summed once per rank holding it
        h = h * torch.rsqrt(ss / self.full_size + self.eps)  # (..., N/p)
        return (self.weight * h).to(dtype)

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[0]} of {self.full_size}, eps={self.eps}, tp_size={self.tp_size}"
                + (f", replicas={self.replicas}" if self.replicas > 1 else ""))
