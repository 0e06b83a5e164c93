"""The device paths :mod:`gpu_check` runs, each a function of one rank (``tools/gpu_check.py``).

Every check builds what it compares from the project's own recipes (``tensorpar.models.tiny``,
the test workers' prompts, batches and single-process training reference), on the rank's device
(``Ctx.device``): the dense reference and the split model on the same device, so a difference is
the split's, not the device's. A check returns its detail line (PASS), raises :class:`Skip`, or
raises :class:`Mismatch` once its collectives are done (FAIL; the other ranks go on to the next
check); any other exception fails the check and ends the launch (a rank that raised midway could
leave its peers waiting in a collective).

Tolerances (relative to the reference's largest magnitude): float64 ``1e-10`` (exact in
practice: 1e-16..1e-13 on the host; a GPU's float64 matmuls sum in another order), float32
``1e-4`` (a few hundred float32 ulps, the order of the split's partial sums). Collectives of
small integers stored as float64 are compared bit for bit, token ids exactly.
"""
from __future__ import annotations

import copy
import json
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from tensorpar import distributed as dist

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


class Skip(Exception):
    """The check does not apply here (said why)."""


class Mismatch(Exception):
    """The path ran and computed something other than its reference."""


@dataclass
class Ctx:
    """One rank's view: its device, the world, and the run's settings."""
    rank: int
    world: int
    device: torch.device
    tmp: Path
    quick: bool = False

    @property
    def where(self) -> str:
        return f"{dist.get_backend()} x{self.world} on {self.device}"


# ---- the launch and the raw collectives ---------------------------------------------------------------

def check_launch(ctx: Ctx) -> str:
    """The backend formed the group; a device tensor all-reduced through torch.distributed is exact
    (at world size 1 too, where tensorpar's own collectives would send nothing)."""
    import torch.distributed as tdist
    x = _ints(ctx.device, ctx.rank)
    tdist.all_reduce(x)
    _equal("all_reduce", x, _ints(ctx.device, None, ctx.world))
    y = torch.tensor([float(ctx.rank + 1)])  # a host tensor: staged through the GPU on NCCL
    dist.all_reduce(y)
    _equal("all_reduce of a host tensor", y, torch.tensor([ctx.world * (ctx.world + 1) / 2]))
    return f"{ctx.where}: group formed, all_reduce exact (device and host tensors)"


def check_collectives(ctx: Ctx, group=None, label: str | None = None) -> str:
    """tensorpar's all_reduce (sum, max), all_gather, reduce_scatter and broadcast over ``group``,
    on device tensors (a strided view among them) and on host tensors: bit for bit."""
    if dist.get_world_size(group) < 2:
        raise Skip("needs 2 ranks")
    p, r = dist.get_world_size(group), dist.get_rank(group)
    devices = list(dict.fromkeys((ctx.device, torch.device("cpu"))))
    for device in devices:
        x = _ints(device, r)
        _equal(f"all_reduce on {device}", dist.all_reduce(x.clone(), group), _ints(device, None, p))
        _equal(f"all_reduce max on {device}", dist.all_reduce(x.clone(), group, op="max"), _ints(device, p - 1))
        strided = torch.stack([x, x]).t()[:, 0]  # (n,) a view with stride 2
        dist.all_reduce(strided, group)
        _equal(f"all_reduce of a strided view on {device}", strided, _ints(device, None, p))
        rows = x.view(1, -1).expand(2, -1).clone()  # (2, n)
        gathered = dist.all_gather(rows, dim=-1, group=group)  # (2, p n)
        _equal(f"all_gather on {device}", gathered, torch.cat([_ints(device, q).view(1, -1).expand(2, -1)
                                                              for q in range(p)], dim=-1))
        wide = torch.cat([_ints(device, r)] * p).view(1, -1)  # (1, p n)
        _equal(f"reduce_scatter on {device}", dist.reduce_scatter(wide, dim=1, group=group),
               _ints(device, None, p).view(1, -1))
        b = _ints(device, r)
        dist.broadcast(b, src=0, group=group)
        _equal(f"broadcast on {device}", b, _ints(device, 0))
    on = " and ".join(str(d) for d in devices)
    return f"{label or ctx.where}: all_reduce, all_gather, reduce_scatter, broadcast bit-exact on {on} tensors"


def check_shm(ctx: Ctx) -> str:
    """A shared-memory group (``backend="shm"``): host tensors go through its segment, GPU tensors
    past it to its gloo group; the same collectives, bit for bit, and what carried them."""
    group = dist.new_group(list(range(ctx.world)), backend="shm")
    if dist.get_world_size(group) < 2:
        raise Skip("needs 2 ranks")
    kind = dist.transport(group)
    detail = check_collectives(ctx, group, label=f"shm group ({kind})")
    host = "shared memory" if kind == "shm" else "gloo"
    gpu = "" if ctx.device.type == "cpu" else f", {ctx.device.type} tensors passed on to gloo"
    return f"{detail}; host tensors over {host}{gpu}"


def _ints(device, rank, world=None) -> torch.Tensor:
    """``(rank + 1) * [1..8]`` as float64 (exact), or with ``world``: its sum over ranks
    ``0..world-1`` (``rank=None``), or rank ``rank``'s values."""
    base = torch.arange(1, 9, dtype=torch.float64, device=device)
    if world is not None and rank is None:
        return base * (world * (world + 1) / 2)
    return base * (rank + 1)


def _equal(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.device != want.device or not torch.equal(got, want):
        raise Mismatch(f"{what}: got {got.flatten()[:6].tolist()} on {got.device}, "
                       f"want {want.flatten()[:6].tolist()} on {want.device}")


# ---- parallelize, load_sharded, the lean decode path ----------------------------------------------

def dense_run(dense, ids, cotangent):
    """``(logits, {name: gradient})`` of ``<logits, cotangent>``: the reference of :func:`check_parallelize`."""
    dense.zero_grad(set_to_none=True)
    logits = dense(input_ids=ids).logits
    (logits * cotangent).sum().backward()
    return logits.detach(), {n: p.grad for n, p in dense.named_parameters()}


def check_parallelize(ctx: Ctx, *, _reference=dense_run) -> str:
    """``parallelize`` of a model on the device over the world: forward logits and every gradient
    shard against the dense model's (``_reference``: how the reference is computed; the tool's
    own test gives a wrong one to see this check fail)."""
    from tensorpar.apply import parallelize
    from tensorpar.models.tiny import make_tiny_model
    parts = []
    for dtype in (torch.float64,) if ctx.quick else (torch.float64, torch.float32):
        dense = make_tiny_model("llama", seed=4, dtype=dtype).to(ctx.device)
        split = parallelize(copy.deepcopy(dense))
        _on_device(split, ctx.device)
        g = torch.Generator().manual_seed(11)
        ids = torch.randint(0, dense.config.vocab_size, (2, 9), generator=g).to(ctx.device)
        cotangent = torch.randn((2, 9, dense.config.vocab_size), generator=g, dtype=dtype).to(ctx.device)
        want, grads = _reference(dense, ids, cotangent)
        got, split_grads = dense_run(split, ids, cotangent)
        err = {"logits": _rel(got, want)}
        err.update({f"grad {n}": _rel(split_grads[n], _shard_of(p, grads[n])) for n, p in split.named_parameters()})
        _within(err, TOL[dtype], f"tp {split.tp_report.tp_size} {dtype}")
        parts.append(f"{str(dtype)[6:]} logits {err['logits']:.0e}, {len(err) - 1} gradients <= {TOL[dtype]:.0e}")
    return f"{ctx.where}: " + "; ".join(parts)


def check_load_sharded(ctx: Ctx) -> str:
    """``load_sharded(device=)`` of a tiny checkpoint: every tensor on the device, logits equal to
    transformers' dense load of the same files (float64)."""
    from tensorpar.jobs.common import dense_model
    from tensorpar.models.checkpoint import load_sharded
    from tensorpar.models.tiny import make_tiny_checkpoint
    path = ctx.tmp / "checkpoint"
    if ctx.rank == 0:
        make_tiny_checkpoint(path, "llama", seed=3)
    dist.barrier()
    split, report = load_sharded(path, dtype=torch.float64, device=ctx.device)
    _on_device(split, ctx.device)
    dense = dense_model(path, torch.float64).to(ctx.device)
    ids = torch.randint(0, dense.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5)).to(ctx.device)
    with torch.no_grad():
        err = _rel(split(input_ids=ids).logits, dense(input_ids=ids).logits)
    _within({"logits": err}, TOL[torch.float64], "load_sharded")
    return (f"{ctx.where}: tp {report.tp_size}, {report.shard_bytes} B per rank on {ctx.device}, "
            f"logits {err:.0e} (float64, tol 1e-10)")


def check_lean_decode(ctx: Ctx, *, _reference=None) -> str:
    """``generate(engine="lean")`` of the split model: the same tokens as the dense model's own
    forward (``engine="hf"``), greedy and top-k sampling, and every step's logits within float64's
    tolerance (``_reference``: the dense model's tokens and logits, see :func:`check_parallelize`)."""
    from tensorpar.apply import parallelize
    from tensorpar.models.generation import generate
    from tensorpar.models.lean import lean_decoder
    from tensorpar.models.tiny import make_tiny_model
    from tests._lean_workers import NEW, PROMPTS, SAMPLERS, _with_biases
    dense = _with_biases(make_tiny_model("llama", seed=4, attention_bias=True, mlp_bias=True)).to(ctx.device)
    split = parallelize(copy.deepcopy(dense))
    why_not = lean_decoder(split)[1]
    if why_not:
        raise Mismatch(f"the split model does not take the lean path: {why_not}")
    reference = _reference or (lambda model, kw: generate(model, PROMPTS, NEW, return_logits=True, engine="hf", **kw))
    samplers = {"greedy": SAMPLERS["greedy"]} if ctx.quick else SAMPLERS
    for name, kw in samplers.items():
        want, want_logits = reference(dense, kw)
        got, logits = generate(split, PROMPTS, NEW, return_logits=True, engine="lean", **kw)
        if got.device != ctx.device or not torch.equal(got.cpu(), want.cpu()):
            raise Mismatch(f"{name}: lean tokens {got[:, -NEW:].tolist()} != dense {want[:, -NEW:].tolist()}")
        _within({f"{name} step {i}": _rel(a, b) for i, (a, b) in enumerate(zip(logits, want_logits))},
                TOL[torch.float64], "lean decode")
    return (f"{ctx.where}: {len(PROMPTS)} prompts x {NEW} tokens ({', '.join(samplers)}) equal to the dense "
            f"model's forward, logits <= 1e-10 (float64)")


# ---- training on the mesh, checkpoints --------------------------------------------------------------

def _mesh_model(ctx: Ctx, layout, seed: int):
    """The tiny Llama (float64) on the device, split on a ``(dp, tp)`` mesh, with AdamW; its dp rows."""
    from tensorpar.apply import parallelize
    from tensorpar.distributed import dp_engines
    from tensorpar.models.tiny import make_tiny_model
    from tests._mesh_workers import BATCH, DECAY, LR
    dp, tp, kind, sp = layout
    mesh = dp_engines.init_mesh(dp, tp, ctx.device.type)
    model = make_tiny_model("llama", seed=seed).to(ctx.device)
    model = parallelize(model, mesh=mesh, data_parallel=kind, sequence_parallel=sp).train()
    d = mesh["dp"].get_local_rank()
    rows = slice(d * BATCH // dp, (d + 1) * BATCH // dp)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY), rows


def _train(model, opt, rows, steps) -> list:
    from tensorpar.models.training import train_step
    from tests._mesh_workers import MAX_NORM
    return [train_step(model, opt, ids[rows], max_norm=MAX_NORM)["loss"] for ids in steps]


def _steps_and_reference(ctx: Ctx, n: int):
    """The first ``n`` global batches on the device, and the dense single-process run's losses on them."""
    from tensorpar.models.tiny import make_tiny_model
    from tests._mesh_workers import batches, reference
    dense = make_tiny_model("llama", seed=5).to(ctx.device)
    steps = [ids.to(ctx.device) for ids in batches(dense.config.vocab_size)[:n]]
    return steps, reference(dense, steps)["losses"]


def _layouts(ctx: Ctx) -> list:
    """``(dp, tp, data_parallel, sequence_parallel)`` meshes of the world's ranks."""
    w = ctx.world
    if w < 2:
        raise Skip("needs 2 ranks")
    both = [(1, w, "ddp", False), (w, 1, "fsdp", False)]
    return both if ctx.quick else both + [(1, w, "fsdp", True)] + ([(2, w // 2, "fsdp", False)] if w >= 4 else [])


def check_train_mesh(ctx: Ctx) -> str:
    """AdamW steps with clipping on each mesh layout (DDP, FSDP2, sequence parallelism), each dp
    rank on its rows: the global loss of every step against the dense single-process run (float64)."""
    n = 3 if ctx.quick else 8
    steps, want = _steps_and_reference(ctx, n)
    worst = 0.0
    for layout in _layouts(ctx):
        model, opt, rows = _mesh_model(ctx, layout, seed=5)
        got = _train(model, opt, rows, steps)
        err = {f"dp{layout[0]}xtp{layout[1]} {layout[2]}{'+sp' * layout[3]} step {i}": abs(a - b) / abs(b)
               for i, (a, b) in enumerate(zip(got, want))}
        _within(err, TOL[torch.float64], "training")
        worst = max(worst, *err.values())
    names = ", ".join(f"dp{d}xtp{t} {k}{'+sp' * s}" for d, t, k, s in _layouts(ctx))
    return f"{ctx.where}: {names}: {n} steps' losses within {worst:.0e} of the dense run (float64, tol 1e-10)"


def check_checkpoint(ctx: Ctx) -> str:
    """``save`` at one layout, ``load`` into a model of other weights at another (resharded),
    training on: the losses of the steps after the load equal the uninterrupted dense run's."""
    from tensorpar.models import saving
    n = 2 if ctx.quick else 4
    steps, want = _steps_and_reference(ctx, 2 * n)
    saved_at, loaded_at = _layouts(ctx)[:2]
    model, opt, rows = _mesh_model(ctx, saved_at, seed=5)
    _train(model, opt, rows, steps[:n])
    saving.save(model, opt, ctx.tmp / "saved", step=n)
    model, opt, rows = _mesh_model(ctx, loaded_at, seed=77)  # other weights, replaced by the checkpoint's
    step = saving.load(model, opt, ctx.tmp / "saved")
    _on_device(model, ctx.device)
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    off = [tuple(v.shape) for v in states if _device_of(v) != ctx.device]
    if step != n or off:
        raise Mismatch(f"load returned step {step} (saved {n}); optimizer states off {ctx.device}: {off[:3]}")
    got = _train(model, opt, rows, steps[n:])
    err = {f"step {n + i}": abs(a - b) / abs(b) for i, (a, b) in enumerate(zip(got, want[n:]))}
    _within(err, TOL[torch.float64], "resumed training")
    return (f"{ctx.where}: saved at dp{saved_at[0]}xtp{saved_at[1]} {saved_at[2]}, loaded at "
            f"dp{loaded_at[0]}xtp{loaded_at[1]} {loaded_at[2]}: {n} more steps within {max(err.values()):.0e} "
            f"of the uninterrupted run")


# ---- helpers ------------------------------------------------------------------------------------------

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = _local(a), _local(b)
    if a.shape != b.shape:
        raise Mismatch(f"shapes differ: {tuple(a.shape)} and {tuple(b.shape)}")
    return float((a - b.to(a.device)).abs().max() / b.abs().max().clamp_min(1e-300))


def _shard_of(p, dense: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a dense tensor, as ``p`` holds it (``p.tp_spec``; whole when unsplit)."""
    spec = getattr(p, "tp_spec", None)
    return dense if spec is None else spec.apply(dense)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().double()


def _device_of(t: torch.Tensor) -> torch.device:
    return (t.to_local() if hasattr(t, "to_local") else t).device


def _within(errors: dict, tol: float, what: str) -> None:
    bad = {k: e for k, e in errors.items() if not e <= tol}
    if bad:
        listed = "; ".join(f"{k} {e:.1e}" for k, e in list(bad.items())[:3])
        raise Mismatch(f"{what}: {len(bad)} of {len(errors)} above {tol:.0e}: {listed}")


def _on_device(model, device: torch.device) -> None:
    """Every parameter and buffer of ``model`` on ``device`` (as this rank holds it)."""
    off = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if _device_of(t) != device]
    if off:
        raise Mismatch(f"{len(off)} tensors are not on {device}, e.g. {off[:3]}")


CHECKS = {"launch": check_launch, "collectives": check_collectives, "shm": check_shm,
          "parallelize": check_parallelize, "load_sharded": check_load_sharded, "lean_decode": check_lean_decode,
          "train_mesh": check_train_mesh, "checkpoint": check_checkpoint}


def rank_device(plan: dict) -> torch.device:
    """This rank's device: its GPU (``rank % gpus``), made current and initialised before any
    DeviceMesh is (which would otherwise pick one by LOCAL_RANK, absent on a single GPU), or the host."""
    if plan["device"] == "cpu":
        return torch.device("cpu")
    index = dist.get_rank() % plan["gpus"]
    torch.cuda.set_device(index)
    torch.zeros(1, device=f"cuda:{index}")
    return torch.device("cuda", index)


def rank_worker(plan: dict) -> str:
    """Every check of ``plan["checks"]`` on this rank, in order; each result appended as a JSON line
    to ``<tmp>/rank<r>.jsonl`` as soon as it is known (a launch that ends early keeps what came before)."""
    warnings.filterwarnings("ignore")
    from tensorpar.jobs.common import quiet_transformers
    quiet_transformers()
    ctx = Ctx(dist.get_rank(), dist.get_world_size(), rank_device(plan), Path(plan["tmp"]), plan["quick"])
    log = ctx.tmp / f"rank{ctx.rank}.jsonl"
    for name in plan["checks"]:
        t0 = time.perf_counter()
        status, detail, error = "PASS", "", None
        try:
            detail = CHECKS[name](ctx)
        except Skip as exc:
            status, detail = "SKIP", str(exc)
        except Mismatch as exc:
            status, detail = "FAIL", str(exc)
        except Exception as exc:  # noqa: BLE001 - the verdict names it; the launch then ends
            status, detail, error = "FAIL", f"{type(exc).__name__}: {_first_line(exc)}", exc
            traceback.print_exc()
        with open(log, "a") as f:
            f.write(json.dumps({"name": name, "status": status, "detail": detail, "rank": ctx.rank,
                                "seconds": time.perf_counter() - t0}) + "\n")
        if error is not None:
            raise RuntimeError(f"check {name} raised on rank {ctx.rank}: {detail}") from error
    return "done"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else ""
