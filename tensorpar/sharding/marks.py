"""Completing a resolved plan: the regions, KV heads, gradient synchronisation and whole units it implies.

A declared plan names column and row linears only. ``derive_regions`` makes each row split's parent
a region (``attention``, ``mlp``, or ``moe`` when it holds the experts); ``mark_kv`` turns the
column linears that produce the KV heads into ``colwise_kv``; ``mark_moe_mlps`` splits an MLP a
``moe`` region would otherwise add whole to its partial sums; ``mark_grad_sync`` marks every
unsplit parameter inside a region, whose gradient is only this rank's share. ``unit_root`` and
``drop_whole`` define the unit that splits together or not at all.
"""
from __future__ import annotations

from torch import nn

from tensorpar.architecture.plans import generic, parent_name
from tensorpar.architecture.tp_rules import Dims
from tensorpar.sharding.records import Placement, Resolution
from tensorpar.sharding.sizes import attention_dims
from tensorpar.sharding.styles import STYLES, splits_module


PARTIAL_SUM_REGIONS = ("moe", "moe_split", "moe_experts")  # regions whose inner row splits leave partial sums
EXPERTS = "experts"  # internal marker: a mixture-of-experts module whose parameters are split


def _under(name: str, anchor: str) -> bool:
    return name.startswith(anchor + ".")


def _ancestors(name: str) -> list:
    """``a.b.c`` -> ``["a.b", "a"]``."""
    out = []
    while "." in name:
        name = name.rpartition(".")[0]
        out.append(name)
    return out


def _within(name: str, anchors: set) -> bool:
    """``name`` is one of ``anchors`` or inside one (its ancestors looked up, not every anchor scanned)."""
    while name:
        if name in anchors:
            return True
        name = name.rpartition(".")[0]
    return "" in anchors


def _is_attention(module) -> bool:
    cls = type(module).__name__.lower()
    return "attention" in cls or "attn" in cls


def _is_experts(module) -> bool:
    """A fused mixture-of-experts module: it holds its experts' weights as 3-D parameters (a
    convolution's 3-D kernel is not one: Kimi-Linear's short convolutions)."""
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d)):
        return False
    return any(p.dim() == 3 for p in module.parameters(recurse=False))


def _is_block(model, name: str) -> bool:
    """``name`` is a transformer block: an item of a ``ModuleList`` (Gemma-4 calls its experts from
    the decoder layer, which holds the attention too: no region can be the whole layer)."""
    return bool(name) and isinstance(model.get_submodule(parent_name(name)), nn.ModuleList)


def derive_regions(model, placements: dict) -> dict:
    """Add a region for each row split's parent (a fused experts module's parent for its split
    parameters); regions nested in another region, derived or placed, join the outer one."""
    experts = {n for n, p in placements.items() if p.style == EXPERTS}
    placed = {n for n, p in placements.items() if p.style in STYLES and STYLES[p.style].kind == "region"}
    anchors = set()
    for name, p in placements.items():
        if p.style == "rowwise":
            anchors.add(parent_name(name))
        elif p.style.startswith("param_") and p.style not in ("param_rank0", "param_heads"):
            owner = parent_name(name)
            fused = owner in experts or _is_experts(model.get_submodule(owner))
            anchors.add(parent_name(owner) if fused and not _is_block(model, parent_name(owner)) else owner)
    everything = anchors | placed
    outer = {a for a in anchors if a not in placed and not any(_under(a, b) for b in everything if b != a)}
    out = dict(placements)
    for anchor in sorted(outer):
        module = model.get_submodule(anchor) if anchor else model
        fused = any(_under(e, anchor) for e in experts) or any(
            _is_experts(m) for m in module.modules())
        if anchor in experts or _is_experts(module):  # the block itself routes: a region of its own
            style = "moe_experts"
        else:
            style = "moe" if fused else ("attention" if _is_attention(module) else "mlp")
        out[anchor] = Placement(anchor, style, "region of its row split's parent")
    regs = regions(out)
    for inner in [a for a in regs if any(_under(a, b) for b in regs if b != a)]:
        del out[inner]  # a region inside another joins it: one input copy, one reduction
    return out


def regions(placements: dict) -> dict:
    return {n: p for n, p in placements.items() if p.style in STYLES and STYLES[p.style].kind == "region"}


def region_of(name: str, regs: dict) -> str | None:
    """The outermost region strictly containing ``name`` (its ancestors looked up)."""
    return next((a for a in reversed(_ancestors(name)) if a in regs), None)


def mark_kv(model, placements: dict, dims: Dims | None) -> dict:
    """Column linears of attention regions that produce the KV heads -> ``colwise_kv`` (by each
    attention module's own heads: layers of one model may differ)."""
    if dims is None:
        return placements
    regs = regions(placements)
    out = dict(placements)
    for name, p in placements.items():
        if p.style != "colwise":
            continue
        anchor = region_of(name, regs)
        if anchor is None or regs[anchor].style != "attention":
            continue
        d = attention_dims(model.get_submodule(anchor), dims)
        mod = model.get_submodule(name)
        if d.n_kv_heads != d.n_heads and getattr(mod, "out_features", None) == d.n_kv_heads * d.head_dim:
            out[name] = Placement(name, "colwise_kv", p.why + " (KV heads)", p.options)
    return out


# Linear names that close an MLP (its row split); the others of the MLP open it (column splits).
ROW_NAMES = ("down_proj", "w2", "fc2", "c_proj", "dense_4h_to_h", "out_proj", "wo", "fc_out", "dense_out")


def mark_moe_mlps(model, placements: dict) -> dict:
    """Inside a ``moe`` region, an MLP the plan leaves whole (a shared expert a declaration does
    not name) would add its whole output to the partial sums on every rank, ``tp`` times in all:
    its linears are split too, by name (the closing one by rows, the others by columns), and the
    proof checks the result."""
    regs = regions(placements)
    out = dict(placements)
    experts = {n for n, p in placements.items() if p.style == EXPERTS}
    for anchor, reg in regs.items():
        if reg.style not in ("moe", "moe_split"):  # a moe_experts region holds only the experts
            continue
        for name, module in model.get_submodule(anchor).named_modules():
            full = f"{anchor}.{name}" if name else anchor
            if not name or full in experts or any(_under(full, e) for e in experts):
                continue
            linears = {n: m for n, m in module.named_children() if splits_module("colwise", m)}
            if len(linears) < 2 or any(f"{full}.{n}" in placements for n in linears):
                continue
            rows = [n for n in linears if n in ROW_NAMES]
            if len(rows) != 1:
                continue
            width = linears[rows[0]].in_features
            cols = [n for n, m in linears.items() if n != rows[0] and m.out_features == width]
            fused = [n for n, m in linears.items() if n != rows[0] and m.out_features == 2 * width]
            if len(cols) + len(fused) != len(linears) - 1:
                continue
            for n in cols:
                out[f"{full}.{n}"] = Placement(f"{full}.{n}", "colwise", "an MLP inside a moe region")
            for n in fused:  # [gate | up] in one linear
                out[f"{full}.{n}"] = Placement(f"{full}.{n}", "fused_colwise", "a fused MLP inside a moe region",
                                               (("segments", (width, width)),))
            out[f"{full}.{rows[0]}"] = Placement(f"{full}.{rows[0]}", "rowwise", "an MLP inside a moe region")
    return out


def _split_names(placements: dict) -> set:
    """Modules replaced by a split and parameters split in place."""
    return {n for n, p in placements.items() if p.style in STYLES and STYLES[p.style].kind in
            ("column", "row", "vocab", "norm")} | {n for n, p in placements.items() if p.style.startswith("param_")}


def mark_grad_sync(model, placements: dict) -> dict:
    """Every unsplit parameter inside a region: ``grad_sync`` (``param_rank0`` for an expert
    bias added inside a partial sum). Declared ``grad_sync`` modules expand to their parameters."""
    regs = regions(placements)
    split = _split_names(placements)
    experts = {n for n, p in placements.items() if p.style == EXPERTS}
    out = {n: p for n, p in placements.items() if p.style != "grad_sync"}
    declared_sync = {n for n, p in placements.items() if p.style == "grad_sync"}
    modules = dict(model.named_modules())
    split_modules = {s for s in split if s in modules}
    for mname, module in modules.items():
        if _within(mname, split_modules):
            continue
        anchor = region_of(mname, regs) if mname not in regs else mname
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if full in split:
                continue
            in_decl = mname in declared_sync or full in declared_sync
            if anchor is None and not in_decl:
                continue
            owner_is_experts = mname in experts
            if owner_is_experts and regs.get(anchor) is not None and regs[anchor].style in PARTIAL_SUM_REGIONS:
                out[full] = Placement(full, "param_rank0", "unsplit expert parameter inside the partial sum")
            else:
                why = "declared replicated_with_grad_allreduce" if in_decl else f"replicated inside region {anchor!r}"
                out[full] = Placement(full, "grad_sync", why)
    return out


def unit_root(name: str, placements: dict) -> str:
    """The block that splits with ``name`` or not at all: its region, else its parent module."""
    regs = regions(placements)
    if name in regs:
        return name
    anchor = region_of(name, regs)
    if anchor is not None:
        return anchor
    style = STYLES.get(placements[name].style) if name in placements else None
    if style is not None and style.kind == "vocab":
        return name
    if style is not None and style.kind == "param":
        return parent_name(name)  # the module holding the parameter
    return parent_name(name)  # a column or row split and its sibling partners


def drop_whole(res: Resolution) -> None:
    """Remove every placement of each unit the resolution leaves whole. ``res.whole`` names a
    block concretely or generically (``model.layers.*.mlp``: every layer's MLP)."""
    for block in list(res.whole):
        g = generic(block)
        for name in list(res.placements):
            if name not in res.placements:
                continue
            gn = generic(name)
            if gn == g or gn.startswith(g + ".") or g.startswith(gn + "."):
                root = unit_root(name, res.placements) if not g.startswith(gn + ".") else name
                for n in [n for n in res.placements if n == root or _under(n, root)]:
                    del res.placements[n]
