"""A training step on a ``("dp", "tp")`` mesh, planned from the inventory: every collective a
rank issues and the bytes of parameters, gradients and optimizer state it holds, for
``parallelize(model, mesh=..., data_parallel=..., sequence_parallel=...)`` (standard library only).

Tensor parallel, per dp rank: the inventory's sites at the dp rank's ``batch / dp`` sequences
(:func:`.runtime.step_items`). With sequence parallelism (:mod:`tensorpar.sharding.sequence`)
the sites change as the runtime changes them:

- each region entry (``dX`` all-reduced in backward) becomes an all-gather of the sequence chunks
  in forward and a reduce-scatter of ``dX`` in backward, at the region's module;
- each row-parallel exit (all-reduce in forward) becomes a reduce-scatter in forward and an
  all-gather of ``dY`` in backward; its bias gradient (added to a chunk) is all-reduced;
- every replicated parameter of a block outside its regions (the norms) has its gradient
  all-reduced (``numel`` elements, at its module);
- the hidden states are cut into chunks at the first block (its backward all-gathers ``dX``, at
  the first block) and joined after the last (an all-gather in forward, at the blocks' parent).

Data parallel, per step (PyTorch's engines, as the shared-memory backend records them):

- ``ddp`` (``replicate``, ZeRO-0): one all-reduce per gradient bucket in backward. Buckets fill
  in reverse registration order, the first up to 1 MiB, the others up to 25 MiB (DDP's
  defaults; a bucket closes once it reaches its cap), over this rank's tensor-parallel shards;
- ``fsdp`` (FSDP2 ``fully_shard`` on every block and on the root, ZeRO-3): each unit's
  parameters are sharded on dim 0 into ``ceil(rows / dp)`` rows per dp rank, zero-padded; in
  forward each unit is all-gathered (``dp x`` the padded shard), the blocks again in backward
  (they reshard after forward; the root does not), and each unit's gradients are
  reduce-scattered in backward. Gradient clipping adds an all-reduce of one float over dp.

Under either engine ``train_step`` averages the loss it returns over dp: an all-reduce of 8 bytes.

Model states per rank (Rajbhandari et al. 2020): the parameters this rank holds, as many
gradients, and AdamW's two moments (``exp_avg``, ``exp_avg_sq``), in the model's dtype; under
FSDP the rank's own rows only (the padding is not stored in its shard).
"""
from __future__ import annotations

from dataclasses import replace

from .collectives import ring_bytes_sent
from tensorpar.architecture.split_model import CollectiveSite, ModelInventory
from .layout import check_size
from .predict import PredictedCollective, _merge, _Step
from .runtime import generic_name, step_items

DATA_PARALLEL = ("ddp", "fsdp")
DDP_FIRST_BUCKET_BYTES = 1 << 20  # DDP's _DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 << 20  # DistributedDataParallel(bucket_cap_mb=25)
REGION_STYLES = ("attention", "mlp")


def block_of(name: str) -> str | None:
    """``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3`` (None outside the blocks)."""
    parts = name.split(".")
    i = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return None if i is None else ".".join(parts[:i + 1])


def sequence_sites(inv: ModelInventory) -> list[CollectiveSite]:
    """The inventory's sites as the runtime issues them under sequence parallelism."""
    anchors = {s.module for s in inv.sites if s.style in REGION_STYLES}
    params = {p.name: p for p in inv.params}
    rows = {s.module for s in inv.sites if _row_exit(s)}
    out = []
    for s in inv.sites:
        if s.style in REGION_STYLES and s.op == "all_reduce" and s.phase == "backward":
            out += [replace(s, op="all_gather", phase="forward", when="always", note="sequence chunks gathered in"),
                    replace(s, op="reduce_scatter", note="dX of the gather")]
        elif _row_exit(s):
            out += [replace(s, op="reduce_scatter", note="partial sums into sequence chunks"),
                    replace(s, op="all_gather", phase="backward", when="train", note="dY of the reduce-scatter")]
            bias = params.get(f"{s.module}.bias")
            if bias is not None and _replicated(bias):
                out.append(CollectiveSite(s.module, "all_reduce", "backward", fixed=_numel(bias.shape), when="train",
                                          style="sequence", note="row bias gradient (added to sequence chunks)"))
        elif _column_entry(s):  # a column split outside any region gathers the chunks itself
            out += [replace(s, op="all_gather", phase="forward", when="always", note="sequence chunks gathered in"),
                    replace(s, op="reduce_scatter", note="dX of the gather")]
        else:
            out.append(s)
    blocks = sorted({b for b in (block_of(p.name) for p in inv.params) if b is not None},
                    key=lambda b: int(b.rsplit(".", 1)[1]))
    for p in inv.params:
        module = p.name.rpartition(".")[0]
        parts = module.split(".")
        inside = any(".".join(parts[:k]) in anchors for k in range(1, len(parts) + 1))
        if block_of(p.name) is not None and not inside and module not in rows and _replicated(p):
            out.append(CollectiveSite(module, "all_reduce", "backward", fixed=_numel(p.shape), when="train",
                                      style="sequence", note="gradient of a replicated parameter that sees "
                                                             "one sequence chunk"))
    if blocks:
        first, parent = blocks[0], blocks[0].rsplit(".", 2)[0]
        out += [CollectiveSite(first, "all_gather", "backward", per_token=inv.hidden, when="train", style="sequence",
                               note="dX of the cut into sequence chunks"),
                CollectiveSite(parent, "all_gather", "forward", per_token=inv.hidden, style="sequence",
                               note="sequence chunks joined after the last block")]
    return out


def _row_exit(s: CollectiveSite) -> bool:
    """A row split's all-reduce of its partial sums, inside the blocks (not the embedding's)."""
    return s.op == "all_reduce" and s.phase == "forward" and s.per_token > 0 and not s.head \
        and s.style != "vocab" and block_of(s.module) is not None


def _column_entry(s: CollectiveSite) -> bool:
    """A column split outside any region: the all-reduce of its dX, inside the blocks."""
    return s.op == "all_reduce" and s.phase == "backward" and s.per_token > 0 and not s.head \
        and block_of(s.module) is not None


def _replicated(p) -> bool:
    return all(r.pieces is None for r in p.ranks)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _local_params(inv: ModelInventory, tp_rank: int) -> list[tuple[str, tuple]]:
    """``(name, local shape)`` of every parameter tp rank ``tp_rank`` holds, in registration order."""
    return [(p.name, tuple(p.ranks[tp_rank].shape)) for p in inv.params]


def _units(inv: ModelInventory, tp_rank: int) -> dict:
    """FSDP units: every block, then the root (``""``: what no block holds), each with its
    parameters' local shapes."""
    units: dict = {}
    for name, shape in _local_params(inv, tp_rank):
        units.setdefault(block_of(name) or "", []).append(shape)
    root = units.pop("", [])
    return {**units, "": root}


def _padded_rows(rows: int, dp: int) -> int:
    return -(-rows // dp) * dp


def fsdp_unit_elems(shapes: list, dp: int) -> int:
    """Elements one all-gather of an FSDP unit returns: every parameter padded to ``dp`` x
    ``ceil(rows / dp)`` rows."""
    return sum(_padded_rows(s[0], dp) * _numel(s[1:]) for s in shapes if s)


def ddp_buckets(sizes_bytes: list, first: int = DDP_FIRST_BUCKET_BYTES, cap: int = DDP_BUCKET_BYTES) -> list:
    """Bytes of each DDP gradient bucket: parameters taken in reverse registration order, a bucket
    closed once it reaches its cap (``first`` for the first one)."""
    buckets, current, limit = [], 0, first
    for b in reversed(sizes_bytes):
        current += b
        if current >= limit:
            buckets.append(current)
            current, limit = 0, cap
    if current:
        buckets.append(current)
    return buckets


def dp_items(inv: ModelInventory, dp: int, data_parallel: str, e: int, *, tp_rank: int = 0,
             clip: bool = True) -> list[PredictedCollective]:
    """Data-parallel collectives of one training step of tp rank ``tp_rank`` (see the module docstring)."""
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel ({data_parallel!r}) must be one of: {', '.join(DATA_PARALLEL)}")
    if dp == 1:
        return []

    def item(op, where, phase, payload, count=1, note=""):
        return PredictedCollective(op, where, phase, dp, payload, (ring_bytes_sent(op, payload, dp),), count, note)

    if data_parallel == "ddp":
        sizes = [_numel(shape) * e for _, shape in _local_params(inv, tp_rank)]
        return _merge([item("all_reduce", "data_parallel", "backward", b, 1, "a DDP gradient bucket")
                       for b in ddp_buckets(sizes)]
                      + [item("all_reduce", "train_step", "forward", 8, 1, "the loss averaged over dp")])
    out = []
    for unit, shapes in _units(inv, tp_rank).items():
        n = fsdp_unit_elems(shapes, dp) * e
        # the root's all-gather runs in its pre-forward hook, under FSDP2's class name for it
        out.append(item("all_gather", unit or f"FSDP{inv.model_class}", "forward", n, 1, "FSDP unit unsharded"))
        if unit:
            out.append(item("all_gather", "data_parallel", "backward", n, 1, "FSDP block unsharded again"))
        out.append(item("reduce_scatter", "data_parallel", "backward", n, 1, "FSDP gradients reduced into shards"))
    if clip:
        out.append(item("all_reduce", "clip_grad_norm", "forward", 8, 1,
                        "the squared gradient norm's FSDP rows summed over dp"))
    out.append(item("all_reduce", "train_step", "forward", 8, 1, "the loss averaged over dp"))
    return _merge([replace(i, where=generic_name(i.where)) for i in out])


def mesh_step(inv: ModelInventory, *, dp: int, data_parallel: str | None, sequence_parallel: bool,
              batch: int, seq: int, e: int, tp_rank: int = 0, clip: bool = True) -> dict:
    """Every collective of one training step (``causal_lm_loss`` forward + backward, clipping,
    the optimizer step) of tp rank ``tp_rank`` on a dp x tp mesh, ``batch`` sequences in the
    global batch (``batch / dp`` per dp rank): ``{"tp": [...], "dp": [...]}``."""
    for name, v in (("dp", dp), ("batch", batch), ("seq", seq)):
        check_size(name, v)
    if batch % dp:
        raise ValueError(f"batch ({batch}) must divide by dp ({dp}): each dp rank trains on its share")
    if sequence_parallel and (inv.tp < 2 or seq % inv.tp):
        raise ValueError(f"sequence_parallel needs tp >= 2 dividing seq ({seq}); tp is {inv.tp}")
    sites = sequence_sites(inv) if sequence_parallel else inv.sites
    tp_items, _ = step_items(replace(inv, sites=sites), _Step("training", seq, "sharded", loss=True), batch // dp, e)
    tp_items = _merge(tp_items)
    if inv.tp > 1:  # train_step's check that the tp ranks hold one batch: max of [h, -h], two int64s
        tp_items.append(PredictedCollective("all_reduce", "train_step", "forward", inv.tp, 16,
                                            (ring_bytes_sent("all_reduce", 16, inv.tp),) * inv.tp, 1,
                                            "the batch's digest compared over tp"))
    if clip and inv.tp > 1:
        tp_items.append(PredictedCollective("all_reduce", "clip_grad_norm", "forward", inv.tp, 8,
                                            (ring_bytes_sent("all_reduce", 8, inv.tp),) * inv.tp, 1,
                                            "the squared gradient norm summed over tp"))
    dp_list = dp_items(inv, dp, data_parallel, e, tp_rank=tp_rank, clip=clip) if data_parallel else []
    return {"tp": tp_items, "dp": dp_list}


def state_bytes(inv: ModelInventory, *, dp: int, data_parallel: str | None, e: int, tp_rank: int = 0,
                dp_rank: int = 0) -> dict:
    """Parameters, gradients and AdamW moments (bytes) that the rank at ``(dp_rank, tp_rank)`` holds."""
    elems = 0
    for _, shape in _local_params(inv, tp_rank):
        if data_parallel == "fsdp" and dp > 1 and shape:
            per = -(-shape[0] // dp)
            rows = max(0, min(shape[0], (dp_rank + 1) * per) - dp_rank * per)
            elems += rows * _numel(shape[1:])
        else:
            elems += _numel(shape)
    return {"params": elems * e, "grads": elems * e, "optimizer": 2 * elems * e, "total": 4 * elems * e}


__all__ = ["DATA_PARALLEL", "sequence_sites", "ddp_buckets", "fsdp_unit_elems", "dp_items", "mesh_step",
           "state_bytes", "block_of"]
