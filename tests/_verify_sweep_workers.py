"""verify's judgement (tensorpar.jobs.verify) on every architecture of the matrix, in float32 and
bfloat16 (tests/test_jobs_verify_sweep.py): a correct split must never be called divergent, and a
corrupted shard must always be.

Per architecture and tp size: the tiny float64 model of tests/_matrix_workers.py is the exact
reference; a copy cast to the precision is the unsplit model; another copy cast and split with
``parallelize(prove=False)`` (what ``load_sharded`` builds) is the split one. verify's own
functions compare them (``_forward_backward``, ``_rows``: activation, activation gradient and every
parameter gradient per block, judged by the dtype's tolerance or by the rounding the unsplit model
itself makes against float64). Then block 0's last matrix is scaled by 1 + 1000 tol on the group's
last rank, as ``verify --inject-fault 0`` does, and the same judgement must fail.
"""
from __future__ import annotations

import contextlib
import copy
import traceback
import warnings

import torch

from tests._matrix_workers import BATCH, SEQ, each_case

DTYPES = ("float32", "bfloat16")


def _as_loaded(model, dtype_name: str):
    """``model`` in ``dtype_name`` as ``dense_model`` and ``load_sharded`` give it to verify: below
    float64, mixture-of-experts layers run transformers' own default kernel (grouped matmuls),
    not the eager loop the float64 reference needs."""
    model = model.to(getattr(torch, dtype_name))
    if hasattr(model.config, "_experts_implementation"):
        model.config._experts_implementation = _DEFAULT_EXPERTS
    return model


_DEFAULT_EXPERTS = "grouped_mm"  # transformers 5's default for models built from a config


def sweep_check(arch: str, group) -> dict:
    from transformers.utils import logging as hf_logging

    from tensorpar import distributed as dist, parallelize
    from tensorpar.jobs import verify as V
    from tensorpar.jobs.common import TOLERANCE
    from tensorpar.models.tiny import make_tiny_model
    hf_logging.set_verbosity_error()
    ref = make_tiny_model(arch)  # float64: the exact reference
    vocab = ref.config.get_text_config().vocab_size
    inputs = {"input_ids": torch.randint(3, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(11))}
    with torch.no_grad():  # settles what a first forward changes (big_bird swaps block-sparse attention
        ref(**inputs, use_cache=False)  # for full attention on short inputs): every copy runs the same modules
    # copied before the reference's forward with gradients: a model that keeps state from it
    # (recurrent_gemma) cannot be copied after
    copies = {name: (_as_loaded(copy.deepcopy(ref), name), _as_loaded(copy.deepcopy(ref), name)) for name in DTYPES}
    try:
        split64 = parallelize(copy.deepcopy(ref), tp_group=group, prove=False)
    except ValueError as exc:  # an architecture the split refuses: nothing to judge
        return {"status": "refused", "why": str(exc)}
    exact, routing = V.reference(ref, inputs, True)
    out = {"status": "ran"}
    last = dist.get_world_size(group) - 1
    structure = []  # the float64 structure check, clean then with block 0's shard scaled by 1.01
    for corrupt in (False, True):
        if corrupt and dist.get_rank(group) == last:
            V._corrupt(V._blocks(split64)[0], TOLERANCE[torch.float32])
        split64.zero_grad(set_to_none=True)
        with routing.replaying():
            s64_acts, _ = V._forward_backward(split64, inputs, True)
        structure.append(max(row[3] for row in V._rows(split64, ref, s64_acts, exact[1], V.structure_tol(routing))))
    both = torch.tensor(structure, dtype=torch.float64)
    dist.all_reduce(both, group, op="max")
    out["structure"] = {"clean_excess": both[0].item(), "faulty_excess": both[1].item(),
                        "tolerance": V.structure_tol(routing)}
    for name in DTYPES:
        dtype = getattr(torch, name)
        tol = TOLERANCE[dtype]
        dense, split = copies[name]
        split = parallelize(split, tp_group=group, prove=False)
        with _ratios(V) as ratios:
            rows = V.compare(split, dense, inputs, True, tol, exact, routing)[0]
        clean = torch.tensor([row[3] for row in rows] + [max(ratios, default=0.0)], dtype=torch.float64)
        split.zero_grad(set_to_none=True)
        dense.zero_grad(set_to_none=True)
        if dist.get_rank(group) == last:
            V._corrupt(V._blocks(split)[0], tol)
        rows = V.compare(split, dense, inputs, True, tol, exact, routing)[0]
        faulty = torch.tensor([row[3] for row in rows] + [0.0], dtype=torch.float64)
        both = torch.stack([clean, faulty])
        dist.all_reduce(both, group, op="max")  # the worst over every rank's shards, as verify does
        out[name] = {"clean_excess": both[0, :-1].max().item(), "worst_row": int(both[0, :-1].argmax()),
                     "rounding_ratio": both[0, -1].item(),
                     "faulty_excess": both[1, :-1].max().item(), "faulty_first": int((both[1, :-1] > 1).int().argmax()),
                     "routing": routing.message()}
    return out


@contextlib.contextmanager
def _ratios(V):
    """The split's error norm over the unsplit model's (both against float64) for every tensor
    outside the dtype's tolerance: what ``rounding_factor`` must allow (recorded, not judged)."""
    seen, real = [], V._excess

    def recording(rel, split, dense, exact, tol, factor):
        if rel > tol and exact is not None and split is not None and dense is not None:
            e = exact.double()
            err_dense = (dense.double() - e).norm().item()
            if err_dense:
                seen.append((split.double() - e).norm().item() / err_dense)
        return real(rel, split, dense, exact, tol, factor)
    V._excess = recording
    try:
        yield seen
    finally:
        V._excess = real


def sweep_worker(archs, tp_sizes) -> dict:
    from tensorpar import distributed as dist
    torch.set_num_threads(1)
    dist.check_collectives(False)
    warnings.filterwarnings("ignore")
    return each_case(archs, tp_sizes, _guarded)


def _guarded(arch, group) -> dict:
    try:
        return sweep_check(arch, group)
    except Exception as exc:  # noqa: BLE001 - reported per architecture, the launch goes on
        if "gloo" in str(exc) or "pair closure" in str(exc):
            raise
        return {"status": "error", "why": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
