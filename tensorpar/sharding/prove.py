"""Step 6 of ``parallelize``: the split model proved against the dense one, forward and backward.

Before anything changes, :meth:`Evidence.collect` runs the dense model on example inputs (random
token ids, the same on every rank): the output of the whole model and, with a fixed random
cotangent, the gradient of every parameter outside the transformer blocks; and each block on
the inputs it received, with its own random cotangent: its output, its input gradient and every
one of its parameters' gradients. After the commit, :meth:`Evidence.check` runs the split model
the same way on every rank and compares each shard with the same slice of the dense tensor
(:class:`~tensorpar.sharding.spec.ShardSpec`), each replicated tensor whole:

    error = max |split - dense| / scale

where ``scale`` is the largest dense value of the compared group (the block's output, its input
gradient, its parameter gradients together): a parameter whose exact gradient vanishes (a key
bias under softmax) is judged on its block's scale, not on its own rounding noise. A correct
split differs by rounding only (float64: ~1e-15); a missing reduction, a partial gradient, a
head paired with the wrong KV head or a per-head bias on the wrong heads is O(1). The limit per
dtype (:data:`TOLERANCE`) sits between the two. Every rank's worst error is all-reduced, so all
ranks reach the same verdict.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tensorpar import distributed as dist
from tensorpar.architecture.plans import generic
from tensorpar.sharding import probes
from tensorpar.sharding.discover import first_tensor
from tensorpar.sharding.probes import (ALL_BLOCKS_BELOW, Precision, block_run, blocks, call, capture, cotangent,
                                       example_inputs, grads_by_name, least_precise, quiet)
from tensorpar.sharding.verdicts import blame, over_reduced, param_error, raised_in, rel, shard_specs, worst_params

TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@dataclass
class Evidence:
    """The dense model's outputs and gradients on the example inputs.

    A model below :data:`ALL_BLOCKS_BELOW` parameters is run once, whole: its output, every
    block's output (forward hooks) and every parameter's gradient. A larger one keeps only the
    gradients outside its blocks from that run (their memory is the model's) and runs each block
    it proves on its own, with its own cotangent."""
    inputs: object
    dtype: torch.dtype
    top_out: torch.Tensor
    top_grads: dict
    block_names: list = field(default_factory=list)  # the blocks found before the split, in order
    whole_run: bool = True
    block_outs: dict = field(default_factory=dict)  # block name -> output (whole run)
    block_inputs: dict = field(default_factory=dict)  # block name -> (args, kwargs) (block runs)
    block_runs: dict = field(default_factory=dict)  # block name -> Run (block runs)

    @classmethod
    def collect(cls, model, res, given_inputs=None) -> "Evidence":
        inputs = example_inputs(model, given_inputs)
        blist = blocks(model)
        whole = sum(p.numel() for p in model.parameters()) < ALL_BLOCKS_BELOW
        block_params = {f"{b}.{n}" for b, m in blist for n, _ in m.named_parameters()}
        all_params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        captured, outs = {}, {}
        hooks = capture(blist, captured, outs)
        try:
            with quiet(model, all_params if whole else all_params - block_params):
                with Precision() as precision:
                    out = first_tensor(call(model, inputs))
                if out is None:
                    raise ValueError(f"{type(model).__name__} returned no tensor to prove the split on")
                (out * cotangent(out, 1)).sum().backward()
                dtype = least_precise(precision.dtypes | {out.dtype})
                ev = cls(inputs, dtype, out.detach(), grads_by_name(model, ""), [b for b, _ in blist], whole, outs)
        finally:
            for h in hooks:
                h.remove()
        if not whole:
            chosen = probes.chosen(model, blist)
            for i, (bname, block) in enumerate(blist):
                if bname in chosen and bname in captured:
                    with quiet(model, None):
                        ev.block_inputs[bname] = captured[bname]
                        ev.block_runs[bname] = block_run(block, bname, *captured[bname], seed=100 + i)
        return ev

    def check(self, model, res, shards, tp_group) -> dict:
        """``{generic block name: why}`` for every part whose split differs from the dense run
        (``"@unsync:<parameter>"``: a synchronised gradient that needs none)."""
        tp_size = dist.get_world_size(tp_group)
        specs = shard_specs(model, shards.built)
        blist = {name: model.get_submodule(name) for name in self.block_names}
        errors = self._whole_errors(model, res, blist, specs, tp_size) if self.whole_run else {}
        if not self.whole_run:
            self._block_errors(model, res, blist, specs, tp_size, errors)
            self._top_errors(model, res, blist, specs, errors)
        names = sorted(k for k in errors if " <" not in k)
        worst = torch.tensor([errors[k] for k in names], dtype=torch.float64)
        if tp_size > 1:
            dist.all_reduce(worst, tp_group, op="max")
        failed = self._verdict(model, res, dict(zip(names, worst.tolist())), errors, tp_size)
        # the verdict is every rank's (all-reduced); the wording is rank 0's, so every report agrees
        return dist.broadcast_object(failed, src=0, group=tp_group) if failed else failed

    def _whole_errors(self, model, res, blist, specs, tp_size) -> dict:
        """One run of the whole split model: its output, each block's output and every gradient."""
        errors, outs = {}, {}
        hooks = capture(list(blist.items()), {}, outs)
        all_params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        try:
            with quiet(model, all_params):
                out = first_tensor(call(model, self.inputs))
                (out * cotangent(out, 1)).sum().backward()
                grads = grads_by_name(model, "")
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:  # same shapes on every rank
            where = raised_in(exc, model, res)
            key = next((b for b in blist if where and (where == b or where.startswith(b + "."))), "<output>")
            return {key: float("inf"), key + " <raised>": f"{type(exc).__name__}: {exc}", key + " <where>": where}
        finally:
            for h in hooks:
                h.remove()
        errors["<output>"] = rel(out.detach(), self.top_out)
        inside = set()
        for bname in blist:
            mine = {n: g for n, g in grads.items() if n.startswith(bname + ".")}
            dense = {n: g for n, g in self.top_grads.items() if n.startswith(bname + ".")}
            inside |= set(dense)
            errors[bname + " <out>"] = rel(outs.get(bname), self.block_outs.get(bname))
            errors[bname] = max(errors[bname + " <out>"], param_error(mine, dense, specs))
            errors[bname + " <params>"] = worst_params(mine, dense, specs)
            errors[bname + " <over>"] = over_reduced(mine, dense, res, tp_size)
        errors["<outside the blocks>"] = param_error({n: g for n, g in grads.items() if n not in inside},
                                                      {n: g for n, g in self.top_grads.items() if n not in inside},
                                                      specs)
        return errors

    def _block_errors(self, model, res, blist, specs, tp_size, errors) -> None:
        order = list(blist)
        for bname in self.block_runs:
            dense = self.block_runs[bname]
            try:
                with quiet(model, None):
                    run = block_run(blist[bname], bname, *self.block_inputs[bname], seed=100 + order.index(bname))
            except (RuntimeError, ValueError, IndexError, TypeError) as exc:  # same shapes on every rank
                errors[bname], errors[bname + " <raised>"] = float("inf"), f"{type(exc).__name__}: {exc}"
                errors[bname + " <where>"] = raised_in(exc, model, res)
                continue
            errors[bname + " <out>"] = rel(run.out, dense.out)
            errors[bname] = max(errors[bname + " <out>"], rel(run.input_grad, dense.input_grad),
                                param_error(run.grads, dense.grads, specs))
            errors[bname + " <params>"] = worst_params(run.grads, dense.grads, specs)
            errors[bname + " <over>"] = over_reduced(run.grads, dense.grads, res, tp_size)

    def _top_errors(self, model, res, blist, specs, errors) -> None:
        block_params = {f"{b}.{n}" for b in blist for n, _ in blist[b].named_parameters()}
        all_params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        try:
            with quiet(model, all_params - block_params):
                out = first_tensor(call(model, self.inputs))
                (out * cotangent(out, 1)).sum().backward()
                errors["<output>"] = rel(out.detach(), self.top_out)
                errors["<outside the blocks>"] = param_error(grads_by_name(model, ""), self.top_grads, specs)
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            errors["<output>"], errors["<output> <raised>"] = float("inf"), f"{type(exc).__name__}: {exc}"

    def _verdict(self, model, res, worst: dict, errors: dict, tp_size: int) -> dict:
        tol = TOLERANCE.get(self.dtype, 1e-4)
        failed = {}
        blocks_failed = any(err > tol for key, err in worst.items() if not key.startswith("<"))
        for key, err in worst.items():
            if err <= tol or (blocks_failed and key.startswith("<")):  # a block's error reaches the output
                continue
            over = errors.get(key + " <over>")
            if over:  # a gradient all-reduced that every rank had whole: drop its synchronisation first
                failed.update({"@unsync:" + generic(n): f"its gradient came out {tp_size} times too large"
                               for n in over})
                continue
            failed.update(blame(model, res, key, err, tol, errors.get(key + " <params>"),
                                 errors.get(key + " <raised>"), errors.get(key + " <where>"),
                                 errors.get(key + " <out>")))
        return failed
