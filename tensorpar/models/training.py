"""Training a parallelized causal LM: the loss from vocab-sharded logits, global-norm clipping.

Any torch optimizer steps the sharded parameters as they are: each rank updates its own shard,
and every replicated parameter receives the same gradient on every rank (the f/g operators
make the gradients entering replicated regions whole), so the copies stay equal. What needs
the group is the gradient norm used for clipping (Megatron-LM's ``clip_grad_norm``,
Shoeybi et al. 2019): with ``r_p`` the number of ranks holding an identical copy of ``p``
(``p.tp_replicas``, set by ``parallelize``: 1 for a shard, tp for a replicated tensor,
tp / n_kv_heads for a replicated KV head),

    ||g||^2 = all_reduce_sum( sum_p ||g_p||^2 / r_p )

counts every parameter exactly once with one all-reduce of one number. A fused projection's shard
that holds a replicated KV head beside its own query heads (``p.tp_row_replicas = (rows, r)``)
counts those rows ``1 / r`` each. Under data parallelism (``parallelize(mesh=...)``): with DDP every
dp rank holds the same (averaged) gradients, so the tp sum is already the norm; with FSDP each dp
rank holds other rows of its tp shard, and a second all-reduce over dp adds them.
"""
from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

from tensorpar import distributed as dist
from tensorpar.nn import ColumnParallelLinear, vocab_parallel_cross_entropy
from tensorpar.sharding.audit import ReplicaDriftError, check_same_inputs
from tensorpar.sharding.audit import audit as audit_replicas
from tensorpar.sharding.commit import restore_tags
from tensorpar.sharding.pipelined import PipelinedModel


def _group(model):
    report = getattr(model, "tp_report", None)
    return (report.tp_group, report.tp_size) if report is not None else (None, 1)


def causal_lm_loss(model, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of a Hugging Face causal LM (``labels`` default ``input_ids``).

    On a parallelized model the output head's logits stay sharded by vocabulary
    (``(B, T, ceil(V/tp))`` per rank, never gathered) and go into
    ``vocab_parallel_cross_entropy``: three all-reduces of ``B*T`` numbers instead of an
    all-gather of ``B*T*V``. ``-100`` labels are ignored.
    """
    labels = input_ids if labels is None else labels
    target = labels[:, 1:]  # (B, T-1): token t+1 is predicted at position t
    head = model.get_output_embeddings()
    if isinstance(head, ColumnParallelLinear) and head.tp_size > 1:
        head.gather_output = False
        try:
            logits_shard = model(input_ids=input_ids, use_cache=False).logits  # (B, T, V/p)
        finally:
            head.gather_output = True
        return vocab_parallel_cross_entropy(logits_shard[:, :-1], target, tp_group=head.tp_group,
                                            vocab_size=head.out_features)
    logits = model(input_ids=input_ids, use_cache=False).logits  # (B, T, V)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1))


@torch.no_grad()
def clip_grad_norm_(model, max_norm: float, *, eps: float = 1e-6) -> torch.Tensor:
    """Scale all gradients by ``min(1, max_norm / (||g|| + eps))``; return ``||g||``.

    ``||g||`` is the 2-norm over the whole (unsharded) model, as
    ``torch.nn.utils.clip_grad_norm_`` on the dense model computes it.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm!r}")

    restore_tags(model)  # a deep copy of a parallelized model: its parameters' replica counts
    group, tp_size = _group(model)
    report = getattr(model, "tp_report", None)
    fsdp = getattr(report, "data_parallel", None) == "fsdp"
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        raise ValueError("no parameter has a gradient; call backward() before clip_grad_norm_")
    first_row = fsdp_first_row(report) if fsdp else None
    sq = sum(_share_of_square(p, first_row) for p in params).reshape(1)  # (1,)
    if tp_size > 1:
        dist.all_reduce(sq, group=group, module="clip_grad_norm")  # sum of every rank's share
    if fsdp:  # each dp rank holds other rows of the same tp shard: their squares add up
        dist.all_reduce(sq, group=report.dp_group, module="clip_grad_norm")
    if getattr(report, "pp_size", 1) > 1:  # each pipeline rank holds other stages
        dist.all_reduce(sq, group=report.pp_group, module="clip_grad_norm")
    total = sq.sqrt()[0]
    coef = (max_norm / (total + eps)).clamp(max=1.0)
    for p in params:
        _local(p.grad).mul_(coef.to(p.grad.dtype))
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a gradient (FSDP's are DTensors sharded over dp)."""
    return t.to_local() if hasattr(t, "to_local") else t


def fsdp_first_row(report):
    """``rows -> first row this dp rank holds`` of a tensor of ``rows`` rows: FSDP2 splits dim 0 as
    ``torch.chunk`` does (``ceil(rows / dp)`` per rank; the last ranks may hold none)."""
    d, dp = dist.get_rank(report.dp_group), report.dp_size
    return lambda rows: min(rows, d * -(-rows // dp))


def _square(g: torch.Tensor) -> torch.Tensor:
    """``sum(g^2)`` accumulated in float64 without a float64 copy of ``g`` (a copy of every gradient
    cost ~8x torch's own norm on the benchmark's 25M model)."""
    return torch.linalg.vector_norm(g, dtype=torch.float64).square()


def _share_of_square(p, first_row=None) -> torch.Tensor:
    """This rank's share of ``||g_p||^2``: divided by the ranks holding the same values (under
    FSDP, of the rows of its tp shard that this dp rank holds)."""
    g = _local(p.grad)
    sq = _square(g) / (getattr(p, "tp_replicas", 1) * getattr(p, "tp_pp_replicas", 1))
    rows = getattr(p, "tp_row_replicas", None)
    if rows is not None:
        pieces, r = rows
        start = first_row(p.shape[0]) if first_row is not None else 0  # p.shape: the whole tp shard
        local = [(max(a - start, 0), min(b - start, g.shape[0])) for a, b in pieces]
        shared = sum(_square(g[a:b]) for a, b in local if a < b)
        sq = sq - shared * (1 - 1 / r)
    return sq


def _digest(tensors) -> int:
    """A 62-bit number from the shapes, dtypes and bytes of ``tensors`` (SHA-256): equal on two
    ranks only for equal tensors (a collision aside, 2**-62)."""
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            data = t.detach().cpu().contiguous()
            h.update(f"{tuple(data.shape)}{data.dtype}".encode())
            h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return int.from_bytes(h.digest()[:8], "little") >> 2  # 62 bits: -h fits int64 too


def check_same_batch(model, input_ids: torch.Tensor, labels=None) -> None:
    """Refuse ranks of one tensor-parallel group given different batches (each would train the
    shared weights on its own rows: the split model then matches no unsplit one, silently). One
    all-reduce (max) of ``[h, -h]``, two int64s, over the tp group: its ranks agree exactly when
    the largest digest equals the smallest. On a difference every rank sees it, and
    :class:`~tensorpar.sharding.audit.ReplicaDriftError` names the ranks (one all-gather more)."""
    group, tp_size = _group(model)
    if tp_size == 1:
        return
    h = _digest((input_ids, labels))
    both = torch.tensor([h, -h], dtype=torch.int64, device=input_ids.device)  # (2,)
    dist.all_reduce(both, group=group, op="max", module="train_step")
    if both[0].item() != -both[1].item():  # max(h) != min(h): the same verdict on every rank
        _name_different_batches(group, input_ids, h)


def _name_different_batches(group, input_ids, h: int) -> None:
    """Every rank's batch shape and digest (one all-gather), then ReplicaDriftError naming the
    ranks whose batch is not rank 0's."""
    everyone = dist.all_gather_object((tuple(input_ids.shape), h), group)
    ranks = [r for r, other in enumerate(everyone) if other != everyone[0]]
    raise ReplicaDriftError(
        f"the ranks of a tensor-parallel group were given different batches: ranks {ranks} of the group differ "
        f"from rank 0 (input_ids {everyone[0][0]} there, {[everyone[r][0] for r in ranks]} on them); every tp "
        f"rank must train on the same rows (dp ranks on their own: slice the global batch by the mesh's dp rank)")


def train_step(model, optimizer, input_ids: torch.Tensor, *, labels=None,
               max_norm: float | None = None, audit: bool = False, check_batch: bool = True) -> dict:
    """One step: loss, backward, optional clipping, optimizer step; ``{"loss", "grad_norm"}``.

    ``check_batch`` (on by default): the ranks of the tensor-parallel group hold the same batch
    (:func:`check_same_batch`: a hash and one all-reduce of 16 bytes; measured in the report of
    issue 20). ``audit``: also, after the step, that every replicated parameter is still
    bit-identical across the group (:func:`tensorpar.audit`):
    :class:`~tensorpar.sharding.audit.ReplicaDriftError` names what drifted (ranks seeded or fed
    differently, an optimizer configured differently on one rank). Costs a hash of every
    replicated tensor and one small all-gather: worth it every few hundred steps, or in a test.
    """
    if isinstance(model, PipelinedModel):
        model.check_batch(input_ids)
    if audit:
        check_same_inputs(model.tp_report.tp_group, input_ids=input_ids, labels=labels)
    elif check_batch:
        check_same_batch(model, input_ids, labels)
    optimizer.zero_grad(set_to_none=True)
    if isinstance(model, PipelinedModel):  # every microbatch's forward and backward, under the schedule
        loss = model.run_step(input_ids, input_ids if labels is None else labels)
    else:
        loss = causal_lm_loss(model, input_ids, labels)
        loss.backward()
    norm = clip_grad_norm_(model, max_norm) if max_norm is not None else None
    optimizer.step()
    if audit:
        audit_replicas(model, raise_on_drift=True)
    return {"loss": _global_mean(model, loss), "grad_norm": None if norm is None else float(norm)}


def _global_mean(model, loss: torch.Tensor) -> float:
    """The loss over the global batch: this dp rank's batch mean averaged over the dp ranks (one
    all-reduce of 8 bytes; equal slices, as the gradients DDP and FSDP average)."""
    value = loss.detach().to(torch.float64).reshape(1)  # (1,)
    report = getattr(model, "tp_report", None)
    if getattr(report, "dp_size", 1) > 1:
        dist.all_reduce(value, group=report.dp_group, module="train_step")
        value = value / report.dp_size
    return float(value[0])


def saved_activation_bytes(model, run) -> tuple[dict, object]:
    """``({module name: bytes}, run())``: the bytes autograd keeps for backward while ``run()``
    executes (a forward of ``model`` that takes gradients), each under the innermost module of
    ``model`` running when the tensor was saved (``""``: the model itself or code outside any
    module). A storage is counted once, at its full size (a view keeps all of it alive), and the
    model's parameters, which are not activations, not at all. Under FSDP the unsharded
    parameters a forward gathers are counted, as they stay alive until backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack, seen, per = [""], set(), {}

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in seen and key not in params:
            seen.add(key)
            per[stack[-1]] = per.get(stack[-1], 0) + storage.nbytes()
        return t

    def enter(name):
        def hook(module, args):
            stack.append(name)
        return hook

    def leave(module, args, output):  # returns None: the output is left as it is
        stack.pop()

    handles = []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(enter(name)))
        handles.append(mod.register_forward_hook(leave, always_call=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
    finally:
        for h in handles:
            h.remove()
    return per, out
