"""Step 4 of ``parallelize``: every placement's shard built for this rank (:class:`~.plan.Shards`).

Each style's builder (:mod:`.styles`) takes the dense module, or the module holding a split
parameter, and returns its replacement or new parameters with the
:class:`~tensorpar.sharding.spec.ShardSpec` that cuts each out of the dense tensor. Nothing in
the model changes here. In an ``"auto"`` plan a block whose builder refuses it is left whole
(the resolution loses that unit, and the rest is built again); a user plan raises.
"""
from __future__ import annotations

from tensorpar.nn.layers import tp_info
from tensorpar.sharding import marks
from tensorpar.sharding.records import Resolution, Shards, StyleContext
from tensorpar.sharding.sizes import attention_dims
from tensorpar.sharding.styles import STYLES


def place(model, res: Resolution, tp_group) -> Shards:
    """The :class:`Shards` of ``res`` on this rank of ``tp_group``; the blocks whose builders
    refused are in ``res.whole`` afterwards (an ``"auto"`` plan)."""
    tp_size, tp_rank = tp_info(tp_group)
    refused = {}
    while True:
        built, failed = {}, {}
        regs = marks.regions(res.placements)
        for name, p in res.placements.items():
            style = STYLES[p.style]
            if style.build is None:
                continue
            owner = model.get_submodule(name.rpartition(".")[0]) if style.target == "param" else (
                model.get_submodule(name))
            ctx = _context(model, name, p, regs, res, tp_group, tp_size, tp_rank)
            try:
                built[name] = style.build(owner, ctx, name)
            except ValueError as exc:
                if res.strict:
                    raise
                failed[name] = str(exc)
        if not failed:
            return Shards(tp_size, tp_rank, built, refused)
        refused.update(failed)
        res.whole.update(failed)
        marks.drop_whole(res)


def _context(model, name: str, p, regs: dict, res, tp_group, tp_size, tp_rank) -> StyleContext:
    """The builder's context: the sizes (inside an attention region, its module's own heads),
    whether an enclosing region copies the input in, and whether a ``moe`` region reduces the
    block's output once for all its partial sums."""
    anchor = marks.region_of(name, regs)
    dims = res.dims
    if anchor is not None and dims is not None and regs[anchor].style == "attention":
        dims = attention_dims(model.get_submodule(anchor), dims)
    return StyleContext(tp_group, tp_size, tp_rank, dims, anchor is not None, p,
                        reduce_later=anchor is not None and regs[anchor].style in ("moe", "moe_experts"))
