"""Sequence parallelism on a model ``parallelize`` has split (Korthikanti et al. 2022, Sec. 4.2.2).

Between the tensor-parallel regions of a block (attention, MLP) the activations are whole on
every rank: norms, residual additions and dropout run ``tp`` times on the same tensor and keep
``tp`` copies of it for backward. Sequence parallelism gives each rank a chunk of the sequence
there instead, exactly as Megatron-LM does for its own layers:

- the hidden states are cut into ``tp`` chunks before the first block (backward: all-gather) and
  joined after the last (backward: keep one's chunk): the final norm and the head run whole;
- each region all-gathers the chunks on entry instead of copying the input in (backward:
  reduce-scatter of dX instead of its all-reduce);
- each row-parallel linear leaves the region by reduce-scatter instead of all-reduce (backward:
  all-gather of dY); its bias, added to a chunk, gets its gradient all-reduced;
- every replicated parameter of a block outside its regions (the norms' weights and biases) sees
  one chunk of the tokens: its gradient is all-reduced over tp;
- dropout in the blocks draws from this rank's own generator state from the first block to the
  last (:class:`~tensorpar.nn.regions.RngFork`): each chunk gets its own masks, where the shared
  default generator would repeat one pattern along the sequence.

Forward bytes per block: an all-gather and a reduce-scatter, ``(p-1)/p N`` each, the same as the
one all-reduce ``2(p-1)/p N`` they replace. The embedding keeps its all-reduce (a Hugging Face
model takes its positions and attention mask from the embedding's output length, so that output
stays whole) and the first block takes its chunk without communication.

Only blocks whose regions are attention and MLP regions are accepted (a mixture-of-experts
region's partial sums and routing are not chunked); anything else is refused with
``ValueError``. With weights to run, the change is proved like the split itself: the model with
and without it, on example inputs, forward and backward, every parameter's gradient; a
difference beyond rounding undoes everything and raises ``ValueError``.
"""
from __future__ import annotations

import torch

from tensorpar.architecture import configs
from tensorpar.nn import (ColumnParallelLinear, ReplicatedHeadLinear, RowParallelLinear, ShardedRMSNorm,
                          VocabParallelEmbedding, regions)
from tensorpar.sharding import marks, probes
from tensorpar.sharding.commit import has_dropout, rng_fork
from tensorpar.sharding.discover import first_tensor
from tensorpar.sharding.verdicts import rel

REGION_STYLES = ("attention", "mlp")
MOE_STYLES = ("moe", "moe_split", "moe_experts")  # regions sequence parallelism refuses


def check(model, res, tp_size: int) -> list:
    """The blocks, after refusing what has no sequence-parallel form here (nothing changed yet)."""
    if tp_size < 2:
        raise ValueError(f"sequence_parallel=True splits the sequence over the tensor-parallel ranks; "
                         f"tp is {tp_size}: use tp >= 2 or sequence_parallel=False")
    blist = probes.blocks(model)
    if not blist:
        raise ValueError(f"sequence_parallel=True needs the model's transformer blocks (a ModuleList); "
                         f"{type(model).__name__} has none")
    other = sorted({p.style for a, p in marks.regions(res.placements).items()} - set(REGION_STYLES))
    if other:
        raise ValueError(f"sequence_parallel=True supports blocks whose tensor-parallel regions are "
                         f"{' and '.join(REGION_STYLES)}; this model has {', '.join(other)} regions "
                         f"(mixture-of-experts layers are not chunked): use sequence_parallel=False")
    if probes.has_cross_attention(model):
        raise ValueError(f"sequence_parallel=True is for decoder-only and encoder-only models; "
                         f"{type(model).__name__} has cross-attention: use sequence_parallel=False")
    return blist


def _anchors(res, blist) -> set:
    """The region anchors inside the chosen blocks (a vision tower's regions outside them keep
    their whole inputs and stay as they are)."""
    names = [b for b, _ in blist]
    return {a for a in marks.regions(res.placements) if any(a.startswith(b + ".") for b in names)}


def _inside(name: str, anchors: set) -> bool:
    return any(name == a or name.startswith(a + ".") for a in anchors)


def apply(model, res, blist, tp_group, undo) -> None:
    """Install sequence parallelism on the split ``model`` (every change logged in ``undo``)."""
    anchors = _anchors(res, blist)
    for anchor in anchors:
        undo.add(regions.swap_entry(model.get_submodule(anchor), sequence=True))
    for bname, block in blist:
        for name, mod in block.named_modules(prefix=bname):
            inside = _inside(name, anchors)
            _sequence_module(mod, name, inside, undo)
            if inside or isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
                continue
            for attr, p in mod.named_parameters(recurse=False):
                placed = res.placements.get(f"{name}.{attr}")
                if placed is not None and placed.style != "grad_sync":  # split by a parameter style
                    raise ValueError(f"{name}.{attr} is split by {placed.style!r} outside "
                                     f"the block's regions: it has no sequence-parallel form here; use "
                                     f"sequence_parallel=False")
                if attr not in regions.substituted(mod):  # frozen ones too: they may be unfrozen later
                    regions.sync_grad(mod, attr, tp_group)
                    undo.add(lambda mod=mod, attr=attr: regions.drop_substitute(mod, attr))
    undo.add(regions.scatter_sequence(blist[0][1], tp_group).remove)
    undo.add(regions.gather_sequence(blist[-1][1], tp_group).remove)
    if any(has_dropout(block) for _, block in blist):  # each rank's chunk draws its own masks
        for h in rng_fork(model, tp_group, undo).around(blist[0][1], [blist[-1][1]]):
            undo.add(h.remove)
    undo.add(model.register_forward_pre_hook(_refuse_hidden_states, with_kwargs=True).remove)


def _refuse_hidden_states(model, args, kwargs):
    """Hidden states between blocks are sequence chunks: refuse to return them as if whole."""
    asked = kwargs.get("output_hidden_states")
    config = getattr(model, "config", None)
    if asked or (asked is None and getattr(config, "output_hidden_states", False)):
        raise ValueError(f"{type(model).__name__} is sequence parallel: the hidden states between its blocks "
                         f"are chunks of the sequence, different on every rank; output_hidden_states=True "
                         f"needs a model parallelized without sequence_parallel")


def _sequence_module(mod, name: str, inside: bool, undo) -> None:
    """A parallel linear of a block switched to its sequence-parallel form (refused where none)."""
    if isinstance(mod, RowParallelLinear):
        if not mod.input_is_parallel:  # it would cut a sequence chunk's features, then the chunk again
            raise ValueError(f"{name}: a row-parallel linear that splits its own whole input has no "
                             f"sequence-parallel form here: use sequence_parallel=False")
        if not mod.reduce_output:
            raise ValueError(f"{name}: a row-parallel linear whose partial sum an enclosing block reduces "
                             f"has no sequence-parallel form here: use sequence_parallel=False")
        undo.set_attr(mod, "sequence_parallel", True)  # leaves by reduce-scatter
    elif isinstance(mod, ColumnParallelLinear) and not inside:  # its own input copy becomes a gather
        if mod.gather_output:
            raise ValueError(f"{name}: a column-parallel linear that gathers its output inside a block "
                             f"has no sequence-parallel form here: use sequence_parallel=False")
        undo.set_attr(mod, "sequence_parallel", True)
    elif isinstance(mod, (ReplicatedHeadLinear, VocabParallelEmbedding, ShardedRMSNorm)) and not inside:
        raise ValueError(f"{name}: a {type(mod).__name__} outside the block's regions has no "
                         f"sequence-parallel form here: use sequence_parallel=False")


def example(model, given, tp_size: int):
    """Example inputs whose sequence divides by ``tp_size`` (the default ones cut to a multiple)."""
    inputs = probes.example_inputs(model, given)
    if given is not None or not isinstance(inputs, dict) or "input_ids" not in inputs:
        return inputs
    t = inputs["input_ids"].shape[1]
    if t >= tp_size:
        keep = t - t % tp_size
        return {k: v[:, :keep] if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == t else v
                for k, v in inputs.items()}
    limit = configs.max_positions(getattr(model, "config", None))
    if limit is not None and limit < tp_size:
        raise ValueError(f"sequence_parallel=True with tp={tp_size} needs sequences of at least {tp_size} "
                         f"tokens; {type(model).__name__} takes at most {limit}")
    reps = -(-tp_size // t)  # the example tokens repeated up to tp of them
    return {k: v.repeat(1, reps, *([1] * (v.dim() - 2)))[:, :tp_size]
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == t else v for k, v in inputs.items()}


def run(model, inputs) -> tuple:
    """Output, every gradient of one forward + backward (eval mode, a fixed cotangent) and the
    least precise floating dtype it computed in (Gemma's norms run in float32 in a float64 model)."""
    with probes.quiet(model, None):
        with probes.Precision() as precision:
            out = first_tensor(probes.call(model, inputs))
        if out is None:
            raise ValueError(f"{type(model).__name__} returned no tensor to prove sequence parallelism on")
        (out * probes.cotangent(out, 1)).sum().backward()
        dtype = probes.least_precise(precision.dtypes | {out.dtype})
        return out.detach(), probes.grads_by_name(model, ""), dtype


def differences(model, before: tuple, after: tuple, blist) -> dict:
    """``{where: (relative error, worst parameter)}`` of the output and of each block's (and the
    rest's) gradients, each against the largest value of its group: the scale the split's own
    proof uses. The keys are the same on every rank."""
    out_a, grads_a, _ = before
    out_b, grads_b, _ = after
    errors = {"<output>": (rel(out_b, out_a), None)}
    groups = {}
    for n in grads_a.keys() | grads_b.keys():
        where = next((b for b, _ in blist if n.startswith(b + ".")), "<outside the blocks>")
        groups.setdefault(where, []).append(n)
    for where, names in groups.items():
        scale = max((grads_a[n].double().abs().max().item() for n in names if n in grads_a), default=0.0) or 1.0
        worst, at = 0.0, None
        for n in names:
            a, b = grads_a.get(n), grads_b.get(n)
            err = float("inf") if a is None or b is None or a.shape != b.shape else (
                (b.double() - a.double()).abs().max().item() / scale)
            if err > worst or at is None:
                worst, at = err, n
        errors[where] = (worst, at)
    return errors


__all__ = ["check", "apply", "example", "run", "differences"]
