"""Pipeline stages of a split model: which blocks, parameters, collective sites and activations
each stage holds (standard library only).

A block is every module under one index of the model's stack (``model.layers.3``,
``transformer.h.3``: the first number in a name). ``n`` stages hold consecutive blocks, cut as the
runtime cuts them (:func:`tensorpar.architecture.pipeline.stage_sizes`: ``L // n`` each, the
remainder one each to the first stages; ``pp x v`` stages under a schedule with ``v`` stages per
pipeline rank, which ranks hold them is the schedule's); what has no index
goes to the first stage when the model registers it before its blocks (the embeddings) and to
the last one otherwise (the final norm, the output head, and what runs outside the model: the
loss, the next-token exchange). A tensor tied across stages (GPT's input and output embeddings)
is held on both, as Megatron-LM keeps a copy of the embedding on the last stage.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tensorpar.architecture.pipeline import stage_ranges, stage_sizes
from tensorpar.architecture.split_model import SplitModel


def block_of(name: str) -> int | None:
    """The first index in a module or parameter name (``model.layers.3.mlp`` -> 3)."""
    return next((int(part) for part in name.split(".") if part.isdigit()), None)


def stacks(split: SplitModel) -> list:
    """The prefixes of the indexed stacks (``model.layers.``): more than one in an
    encoder-decoder or a model with a vision tower."""
    out = []
    for p in split.params:
        parts = p.name.split(".")
        i = next((k for k, part in enumerate(parts) if part.isdigit()), None)
        if i is not None and ".".join(parts[:i]) not in out:
            out.append(".".join(parts[:i]))
    return out


def blocks(split: SplitModel) -> list:
    return sorted({b for b in (block_of(p.name) for p in split.params) if b is not None})


@dataclass(frozen=True)
class Stages:
    """``pp`` stages of ``split`` (``pp x v`` under a multi-stage schedule: the field counts
    stages): ``owner[block]`` its stage, ``before`` the unindexed names the model registers
    before its first block."""
    pp: int
    owner: dict
    before: frozenset
    head_names: frozenset
    stack_parents: frozenset = frozenset()
    homes: dict = field(default_factory=dict)  # parameter -> the stages holding it (tied copies too)

    def of(self, name: str) -> int:
        """The stage holding the module or parameter ``name``; the stack's parent (where the
        hidden states leave the last block) is the last."""
        b = block_of(name)
        if b is not None and b in self.owner:
            return self.owner[b]
        if name in self.head_names or name in self.stack_parents:
            return self.pp - 1
        return 0 if any(name == n or n.startswith(name + ".") for n in self.before) else self.pp - 1


def why_not(split: SplitModel, pp: int, virtual: int = 1) -> str | None:
    """Why ``split`` cannot run as ``pp x virtual`` stages (None: it can)."""
    n, found, n_stages = len(blocks(split)), stacks(split), pp * virtual
    if n_stages > 1 and len(found) > 1:
        return (f"pp ({pp}) needs one stack of blocks to cut; this model has {len(found)} "
                f"({', '.join(found)}); valid pp sizes: 1")
    if n == 0 and n_stages > 1:
        return f"pp ({pp}) needs blocks to cut; this model has none; valid pp sizes: 1"
    if n_stages > n:
        each = f" x {virtual} stages per rank" if virtual > 1 else ""
        return (f"pp ({pp}){each} makes {n_stages} stages, more than the model's {n} blocks; valid pp sizes: "
                f"1 to {n // virtual}")
    return None


def stages(split: SplitModel, pp: int) -> Stages:
    """The ``pp`` stages of ``split`` (``why_not`` first: at most one stage per block)."""
    found = blocks(split)
    ranges = stage_ranges(stage_sizes(len(found), pp)) if found else [(0, 0)] * pp
    owner = {b: next(s for s, (lo, hi) in enumerate(ranges) if lo <= k < hi) for k, b in enumerate(found)}
    before, seen_block = set(), False
    for p in split.params:
        if block_of(p.name) is not None:
            seen_block = True
        elif not seen_block:
            before.add(p.name)
    heads = frozenset(m.name for m in split.matmuls if m.head)
    parents = {".".join(prefix.split(".")[:k]) for prefix in stacks(split) for k in range(1, prefix.count(".") + 2)}
    st = Stages(pp, owner, frozenset(before), heads, frozenset(parents))
    for p in split.params:
        st.homes[p.name] = sorted({st.of(p.name)} | {st.of(t) for t in p.tied})
    return st


def held(split: SplitModel, st: Stages, stage: int) -> list:
    """The parameters a device of ``stage`` holds (a tied tensor on each stage that uses it)."""
    return [p for p in split.params if stage in st.homes[p.name]]


def params_per_stage(split: SplitModel, st: Stages, rank: int) -> list:
    """Parameters rank ``rank`` of each stage holds."""
    out = [0] * st.pp
    for p in split.params:
        for stage in st.homes[p.name]:
            out[stage] += p.ranks[rank].numel
    return out


def tied_across(split: SplitModel, st: Stages) -> list:
    """Parameters whose tied copies sit on another stage (their gradients are all-reduced
    between the stages each step)."""
    return [p for p in split.params if len(st.homes[p.name]) > 1]


def layers_of(st: Stages, stage: int) -> list:
    return sorted(b for b, s in st.owner.items() if s == stage)
