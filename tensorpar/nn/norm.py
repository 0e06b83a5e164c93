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

from tensorpar import dist
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
