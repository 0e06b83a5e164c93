"""Column-, row- and vocab-parallel layers (Shoeybi et al. 2019, "Megatron-LM", sec. 3).

Row-vector convention ``Y = X A``, ``A: (in, out)``; modules store ``weight = A.T: (out, in)`` as
``nn.Linear`` does, so a shard is a slice of a Hugging Face weight. Every layer initialises the
full master weight from the torch RNG and slices it (tp=1 and tp=p give the same model from one
seed), or slices an existing dense module with ``from_dense``. Collectives go through
``tensorpar.distributed``; ``N`` below is the byte size of the named tensor, ``p`` the tp size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar import distributed as dist
from tensorpar.architecture.tp_rules import divide, padded_range, padded_size
from tensorpar.nn.validation import (check_dtype, check_ids, check_last_dim, check_positive,
                                     check_seq_divisible, check_sequence_input)


def tp_info(tp_group) -> tuple[int, int]:
    """``(tp_size, tp_rank)`` of this process in ``tp_group`` (None: the world group).

    torch answers rank -1 (and size -1) for a group this process does not belong to; building
    a shard from that would slice with negative sizes far from the cause, so it is refused here.
    """
    tp_rank = dist.get_rank(group=tp_group)
    if tp_rank < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of tp_group; build a "
                         f"tensor-parallel layer only on the ranks of its group (every rank calls "
                         f"dist.new_group(ranks), but only the ranks in `ranks` may use the group)")
    return dist.get_world_size(group=tp_group), tp_rank


def enter_tp_region(x: torch.Tensor, tp_group, sequence_parallel: bool) -> torch.Tensor:
    """The input of column-parallel work, replicated on every rank of the group.

    Without sequence parallelism X is already replicated: identity forward, all-reduce of dX
    backward (Megatron's f). With it X arrives as ``(B, T/p, H)``: all-gather to ``(B, T, H)``
    forward, reduce-scatter of dX backward.
    """
    if sequence_parallel:
        return dist.gather_from_sequence_parallel_region(x, group=tp_group, dim=1)
    return dist.copy_to_tp_region(x, group=tp_group)


def trains(linear: nn.Linear) -> tuple[bool, bool]:
    """Whether the weight and the bias of ``linear`` train: a shard keeps each one's own flag."""
    return linear.weight.requires_grad, linear.bias is not None and linear.bias.requires_grad


def _param(t: torch.Tensor | None, requires_grad: bool = True) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t.detach().clone().contiguous(), requires_grad)


def _rows(t: torch.Tensor, start: int, end: int, per_partition: int) -> torch.Tensor:
    """Rows ``[start, end)`` of ``t`` zero-padded to ``per_partition`` rows."""
    shard = t.new_zeros((per_partition, *t.shape[1:]))
    shard[: end - start] = t[start:end]
    return shard


def _master_linear(in_features, out_features, bias, init_method, dtype, device) -> nn.Linear:
    """The full dense layer, drawn from the torch RNG exactly as ``nn.Linear`` draws it.

    With ``init_method`` (a callable filling a tensor in place, as Megatron's), the weight comes
    from it and the bias is zero.
    """
    check_positive(in_features, "in_features")
    check_positive(out_features, "out_features")
    master = nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)
    if init_method is not None:
        with torch.no_grad():
            init_method(master.weight)
            if master.bias is not None:
                master.bias.zero_()
    return master


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b``, ``A = [A_1 ... A_p]`` split along out_features.

    Rank i holds ``A_i: (in, out/p)`` (``weight: (out/p, in)``) and ``b_i``, and computes
    ``Y_i = X A_i + b_i: (..., out/p)``.

    - forward: no communication unless ``gather_output`` (all-gather of Y, sends (p-1)/p * N_Y);
      with ``sequence_parallel`` X arrives split along the sequence and is all-gathered first
      ((p-1)/p * N_X).
    - backward: all-reduce of dX (2(p-1)/p * N_X), since rank i only has the partial
      ``dY_i A_i^T``, issued as soon as dX exists and waited for after dW is computed (the
      overlap of Megatron-LM's async all-reduce); with ``sequence_parallel`` a reduce-scatter
      of dX instead ((p-1)/p * N_X).

    ``fuse_grad_allreduce`` (an attribute, True by default): the input copy and the linear are
    one autograd node, whose backward overlaps dX's all-reduce with dW; False keeps them two nodes,
    for a backward split into an input pass and a weight pass (the zero-bubble pipeline schedules),
    whose weight pass would otherwise run the fused node, all-reduce included, a second time.

    ``skip_input_comm=True``: the caller has already entered the tensor-parallel region (one
    copy or sequence gather shared by several column-parallel linears, as in ParallelMLP) and
    owns the backward reduction. ``pad_out_features=True`` pads an out_features that does not
    divide by p (docs/architecture.md rule); padded outputs are zero and a gathered output is
    trimmed back to out_features.
    """

    fuse_grad_allreduce = True  # see the class docstring

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, tp_group=None,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 skip_input_comm: bool = False, pad_out_features: bool = False,
                 init_method=None, dtype=None, device=None):
        super().__init__()
        self._configure(in_features, out_features, tp_group, gather_output, sequence_parallel,
                        skip_input_comm, pad_out_features)
        master = _master_linear(in_features, out_features, bias, init_method, dtype, device)
        self._load(master.weight, master.bias, (True, True))

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, tp_group=None, gather_output: bool = False,
                   sequence_parallel: bool = False, skip_input_comm: bool = False,
                   pad_out_features: bool = False, rows: tuple | None = None) -> "ColumnParallelLinear":
        """This rank's shard of ``linear``: weight rows (output features) of this rank.

        ``rows``: this rank's output features as ``((start, end), ...)`` pieces of a fused
        projection (``tensorpar.sharding.spec.segment_pieces``: its block of every segment),
        instead of one contiguous block; the output is then this rank's pieces side by side
        (no ``gather_output``: a gather would interleave the segments)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._configure(linear.in_features, linear.out_features, tp_group, gather_output,
                        sequence_parallel, skip_input_comm, pad_out_features)
        if rows is not None:
            if gather_output or pad_out_features:
                raise ValueError("ColumnParallelLinear.from_dense(rows=...) shards a fused projection; "
                                 "it takes neither gather_output nor pad_out_features")
            self.rows = tuple(rows)
            self.out_features_per_partition = sum(end - start for start, end in self.rows)
        self._load(linear.weight, linear.bias, trains(linear))
        return self

    def _configure(self, in_features, out_features, tp_group, gather_output, sequence_parallel,
                   skip_input_comm, pad_out_features):
        self.tp_size, self.tp_rank = tp_info(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.tp_group = tp_group
        if not pad_out_features:
            divide(out_features, self.tp_size, "out_features")
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.skip_input_comm, self.pad_out_features = skip_input_comm, pad_out_features
        start, end, self.out_features_per_partition = padded_range(
            out_features, self.tp_rank, self.tp_size)
        self.output_start_index, self.output_end_index = start, end
        self.rows = None  # contiguous [start, end); a fused projection's pieces otherwise

    def _load(self, weight, bias, requires_grad):
        if self.rows is not None:
            def take(t):
                return torch.cat([t[a:b] for a, b in self.rows])  # (sum of pieces, ...)
        else:
            start, end = self.output_start_index, self.output_end_index

            def take(t):
                return _rows(t, start, end, self.out_features_per_partition)
        with torch.no_grad():
            self.weight = _param(take(weight), requires_grad[0])                        # (out/p, in)
            self.bias = _param(None if bias is None else take(bias), requires_grad[1])  # (out/p,)

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        if self.skip_input_comm:
            return x
        return enter_tp_region(x, self.tp_group, self.sequence_parallel)  # (B, T, in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_last_dim(x, self.in_features, "in_features")
        check_dtype(x, self.weight, type(self).__name__)
        if self.sequence_parallel and not self.skip_input_comm:
            check_sequence_input(x, type(self).__name__)
        # (getattr: a subclass's forward built from this one may run on a module of another class)
        if self.skip_input_comm or self.sequence_parallel or not getattr(self, "fuse_grad_allreduce", True):
            y_shard = F.linear(self._enter(x), self.weight, self.bias)  # (..., out/p)
        else:  # f fused in: backward overlaps the all-reduce of dX with dW
            y_shard = dist.linear_with_grad_allreduce(x, self.weight, self.bias, self.tp_group)
        if not self.gather_output:
            return y_shard
        y = dist.gather_from_tp_region(y_shard, group=self.tp_group)  # (..., padded out)
        return y[..., : self.out_features] if self.pad_out_features else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"out_features_per_partition={self.out_features_per_partition}, "
                f"tp_size={self.tp_size}, bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``Y = X A + b``, ``A = [A_1; ...; A_p]`` split along in_features, ``X = [X_1 ... X_p]``.

    Rank i holds ``A_i: (in/p, out)`` (``weight: (out, in/p)``) and computes the partial sum
    ``Y_i = X_i A_i: (..., out)``; ``Y = sum_i Y_i + b``, the bias added once, after the sum.

    - forward: all-reduce of the partial Y (2(p-1)/p * N_Y); with ``sequence_parallel`` a
      reduce-scatter along the sequence instead ((p-1)/p * N_Y), output ``(B, T/p, out)``.
      ``input_is_parallel=False``: X is full and each rank keeps its slice (no communication).
    - backward: dX_i = dY A_i^T needs no communication (dY is replicated), except an all-gather
      of dX when ``input_is_parallel=False``; with ``sequence_parallel`` an all-gather of dY
      ((p-1)/p * N_Y), and the bias gradient (partial over this rank's tokens) is all-reduced.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, tp_group=None,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 init_method=None, dtype=None, device=None):
        super().__init__()
        self._configure(in_features, out_features, tp_group, input_is_parallel, sequence_parallel)
        master = _master_linear(in_features, out_features, bias, init_method, dtype, device)
        self._load(master.weight, master.bias, (True, True))

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, tp_group=None, input_is_parallel: bool = True,
                   sequence_parallel: bool = False, reduce_output: bool = True) -> "RowParallelLinear":
        """This rank's shard of ``linear``: weight columns (input features) of this rank.

        ``reduce_output=False``: return the partial sum, for an enclosing block that adds several
        partial sums and reduces them once (a mixture-of-experts layer's shared experts next to
        its routed experts); the bias is then added on rank 0 only, and its gradient
        all-reduced so that every rank's copy steps alike."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._configure(linear.in_features, linear.out_features, tp_group, input_is_parallel,
                        sequence_parallel, reduce_output)
        self._load(linear.weight, linear.bias, trains(linear))
        return self

    def _configure(self, in_features, out_features, tp_group, input_is_parallel,
                   sequence_parallel, reduce_output=True):
        self.tp_size, self.tp_rank = tp_info(tp_group)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True (the input of "
                             "a sequence-parallel row linear is the column linear's shard)")
        if sequence_parallel and not reduce_output:
            raise ValueError("sequence_parallel=True reduce-scatters the output; it needs reduce_output=True")
        self.reduce_output = reduce_output
        self.in_features, self.out_features = in_features, out_features
        self.tp_group = tp_group
        self.in_features_per_partition = divide(in_features, self.tp_size, "in_features")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel

    def _load(self, weight, bias, requires_grad):
        start = self.tp_rank * self.in_features_per_partition
        end = start + self.in_features_per_partition
        with torch.no_grad():
            self.weight = _param(weight[:, start:end], requires_grad[0])  # (out, in/p)
            self.bias = _param(bias, requires_grad[1])                    # (out,) replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.in_features_per_partition if self.input_is_parallel else self.in_features
        name = "in_features_per_partition" if self.input_is_parallel else "in_features"
        check_last_dim(x, width, name)
        check_dtype(x, self.weight, type(self).__name__)
        if self.sequence_parallel:
            check_seq_divisible(x, 1, self.tp_size, type(self).__name__)
        if not self.input_is_parallel:
            x = dist.scatter_to_tp_region(x, group=self.tp_group)  # (..., in/p)
        y_partial = F.linear(x, self.weight)                        # (..., out), a partial sum
        if not self.reduce_output:  # the enclosing block sums the partials once
            if self.bias is None:
                return y_partial
            bias = dist.copy_to_tp_region(self.bias, group=self.tp_group)  # dbias all-reduced
            return y_partial + (bias if self.tp_rank == 0 else bias * 0)   # bias once over the ranks
        if self.sequence_parallel:
            # (B, T, out) partial -> (B, T/p, out) summed
            y = dist.reduce_scatter_to_sequence_parallel_region(y_partial, group=self.tp_group,
                                                                dim=1)
            bias = None if self.bias is None else dist.copy_to_tp_region(self.bias,
                                                                         group=self.tp_group)
        else:
            # (..., out): y_partial is this layer's own matmul output, summed in place
            y = dist.reduce_from_tp_region(y_partial, group=self.tp_group, in_place=True)
            return y if self.bias is None else y.add_(self.bias)  # still this layer's own tensor
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"in_features_per_partition={self.in_features_per_partition}, "
                f"tp_size={self.tp_size}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}, reduce_output={self.reduce_output}")


class VocabParallelEmbedding(nn.Module):
    """``E[ids]`` with the table ``E: (V, H)`` split along the vocabulary.

    Rank i holds rows ``[vocab_start_index, vocab_end_index)`` of E, zero-padded to
    ``num_embeddings_per_partition = ceil(V/p)`` rows (the padding rule of
    docs/architecture.md; padded rows are never looked up, so padding never changes a result).
    Each rank looks up the ids it owns, writes zero rows for the others, and the partial
    outputs are summed: exactly one rank contributes each token's row.

    - forward: all-reduce of the (B, T, H) output (2(p-1)/p * N); with ``sequence_parallel``
      a reduce-scatter along the sequence instead ((p-1)/p * N), output ``(B, T/p, H)``.
    - backward: none (the output gradient is replicated; each rank keeps its rows' gradient).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group=None,
                 padding_idx: int | None = None, sequence_parallel: bool = False,
                 init_method=None, dtype=None, device=None):
        super().__init__()
        tp_info(tp_group)  # a non-member of tp_group is told so before anything else
        check_positive(num_embeddings, "num_embeddings")
        check_positive(embedding_dim, "embedding_dim")
        self._configure(num_embeddings, embedding_dim, padding_idx, tp_group, sequence_parallel)
        master = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx,
                              dtype=dtype, device=device)
        if init_method is not None:
            with torch.no_grad():
                init_method(master.weight)
        self._load(master.weight, requires_grad=True)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, *, tp_group=None,
                   sequence_parallel: bool = False) -> "VocabParallelEmbedding":
        """This rank's rows of ``embedding`` (max_norm / sparse are not supported)."""
        tp_info(tp_group)
        if embedding.max_norm is not None or embedding.sparse:
            raise ValueError("VocabParallelEmbedding.from_dense: max_norm and sparse embeddings "
                             "are not supported; valid: max_norm=None, sparse=False")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._configure(embedding.num_embeddings, embedding.embedding_dim,
                        embedding.padding_idx, tp_group, sequence_parallel)
        self._load(embedding.weight, embedding.weight.requires_grad)
        return self

    def _configure(self, num_embeddings, embedding_dim, padding_idx, tp_group, sequence_parallel):
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.tp_size, self.tp_rank = tp_info(tp_group)
        start, end, per = padded_range(num_embeddings, self.tp_rank, self.tp_size)
        self.vocab_start_index, self.vocab_end_index = start, end
        self.num_embeddings_per_partition = per
        self.padded_num_embeddings = padded_size(num_embeddings, self.tp_size)
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.padding_idx = padding_idx
        local = None if padding_idx is None else padding_idx - start
        self._local_padding_idx = local if local is not None and 0 <= local < end - start else None

    def _load(self, weight, requires_grad):
        start, end = self.vocab_start_index, self.vocab_end_index
        with torch.no_grad():
            self.weight = _param(_rows(weight, start, end, self.num_embeddings_per_partition),
                                 requires_grad)  # (V/p, H)

    def partial_lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``E[ids]``, zeros for the ids other ranks hold: ``(B, T, H)``, a
        partial sum (ids not checked: :meth:`forward` checks them first)."""
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)  # (B, T)
        local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        out_partial = F.embedding(local_ids, self.weight, self._local_padding_idx)  # (B, T, H)
        return out_partial.masked_fill_(outside.unsqueeze(-1), 0.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.num_embeddings)
        if self.sequence_parallel:
            check_seq_divisible(ids, 1, self.tp_size, type(self).__name__)
        # named on the class: a rebased embedding subclass (tensorpar.nn.rebase) borrows this forward
        out_partial = VocabParallelEmbedding.partial_lookup(self, ids)  # (B, T, H)
        if self.sequence_parallel:
            return dist.reduce_scatter_to_sequence_parallel_region(out_partial,
                                                                   group=self.tp_group, dim=1)
        # the lookup's own fresh output, which its backward does not read: summed in place
        return dist.reduce_from_tp_region(out_partial, group=self.tp_group, in_place=True)  # (B, T, H)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"vocab=[{self.vocab_start_index}, {self.vocab_end_index}), "
                f"num_embeddings_per_partition={self.num_embeddings_per_partition}, "
                f"tp_size={self.tp_size}, sequence_parallel={self.sequence_parallel}")
