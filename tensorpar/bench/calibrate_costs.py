"""What a step costs besides its GEMMs and its collectives' own time, for ``tensorpar calibrate``
(:mod:`tensorpar.bench.calibrate`): a block's fixed cost (Python, dispatch, launches) by phase, one
optimizer step per parameter, and the wait at a collective for the slower rank; and the timing
helpers calibrate's measurements share.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from tensorpar import distributed as dist
from tensorpar.apply import parallelize
from tensorpar.bench.timing import round_order
from tensorpar.distributed import collectives
from tensorpar.distributed.dp_engines import init_mesh
from tensorpar.distributed.groups import barrier
from tensorpar.models.generation import generate
from tensorpar.models.tiny import make_tiny_model
from tensorpar.models.training import clip_grad_norm_, train_step

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64)

COLD_BYTES = 64 << 20  # weights cycled per shape: a model's step touches more than any cache holds
FLUSH_BYTES = 4 << 20  # read before each norm of the fixed costs' tiny model: more than a core's L2 (1-2 MiB on x86)



def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, repeats: int, min_s: float = 0.02, device="cpu") -> float:
    """Median seconds of ``fn``: each sample loops until ``min_s`` passes (short calls); on a GPU
    the device is waited for (a queued kernel is not a finished one)."""
    fn()
    samples = []
    for _ in range(repeats):
        _sync(device)
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            _sync(device)
            if time.perf_counter() - t0 >= min_s:
                break
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


# ---- the optimizer step ----------------------------------------------------------------------------

OPTIMIZER_SHAPES = ((1408, 512),) * 12 + ((4096, 512),) * 2 + ((512,),) * 16  # ~12.9M parameters, 52 MB each state
QUICK_OPTIMIZER = ((512, 512),) * 4  # a smoke run's


def optimizer_rate(repeats: int, device="cpu", shapes=OPTIMIZER_SHAPES) -> float:
    """Seconds per parameter of one optimizer step as ``train_step`` runs it: gradient clipping
    (:func:`~tensorpar.models.training.clip_grad_norm_`) then PyTorch's AdamW (its default for the device: a loop over the tensors on a CPU, foreach on a GPU), over
    float32 weights of a model's shapes, more than any cache holds. Each element is read and
    written in a dozen passes, some into fresh buffers: the bytes over the copy rate undercount it
    (the estimate's ``optimizer_s``, :mod:`tensorpar.planner.estimate`)."""
    module = torch.nn.Module()
    module.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes)
    for p in module.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def step():
        clip_grad_norm_(module, 1.0)
        opt.step()
    count = sum(p.numel() for p in module.parameters())
    return _median_time(step, repeats, device=device) / count


# ---- a block's fixed cost -------------------------------------------------------------------------

class ColdCaches:
    """Reads ``FLUSH_BYTES`` of a 64 MiB pool (the next slice each call, from memory) before each
    norm of a tiny model, as a real model's weights pass through the caches between its small
    operations: a tiny model's block otherwise runs with its every operand, and the interpreter's
    own data, in the core's caches, which no model worth splitting does. ``spent`` sums the seconds
    of the reads themselves, which a sample takes out (timed where they run: a read after the
    model's work costs what it costs there). Host only: a GPU's weights stream through the GPU's
    caches, not the host's.

    Measured on this project's 2-core VM (the ~25M Llama at tp 2, 6 blocks): a prompt's forward
    spent 1.8 ms outside its GEMMs and collectives with the GEMMs replaced by stand-ins of the
    right shape, 2.9 ms with them; the tiny model's prefill block took 124-256 us with warm caches and
    297-329 us after these reads."""

    def __init__(self, device="cpu"):
        self.active = torch.device(device).type == "cpu"
        self.pool = [torch.ones(FLUSH_BYTES // 4) for _ in range(COLD_BYTES // FLUSH_BYTES)] if self.active else []
        self.spent, self._turn = 0.0, 0

    def hook(self, model) -> None:
        """Read before every RMSNorm-like module of ``model`` (a norm module's class name ends in ``Norm``)."""
        if not self.active:
            return
        for module in model.modules():
            if type(module).__name__.endswith("Norm"):
                module.register_forward_pre_hook(self._read)

    def _read(self, _module, _inputs) -> None:
        t0 = time.perf_counter()
        self.pool[self._turn % len(self.pool)].sum()
        self._turn += 1
        self.spent += time.perf_counter() - t0


def _sampler(fn, min_s: float = 0.05, device="cpu", cold: ColdCaches | None = None):
    """A function taking one sample of ``fn``: seconds per call less the time spent inside
    collectives (:func:`~tensorpar.distributed.collectives.stopwatch`) and in ``cold``'s reads,
    over enough calls to last ``min_s`` (a short call's noise averaged). Every rank
    runs the same count (they meet in ``fn``'s collectives): agreed on from rank 0's first timing."""
    t0 = time.perf_counter()
    fn()
    _sync(device)
    first = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.broadcast(first, 0)
    calls = max(1, min(50, int(min_s / max(first.item(), 1e-6))))

    def sample() -> float:
        reads = cold.spent if cold is not None else 0.0
        with collectives.stopwatch() as watch:  # not a ledger: its hooks and records would be timed too
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            wall = time.perf_counter() - t0
        reads = (cold.spent if cold is not None else 0.0) - reads
        return (wall - watch.seconds - reads) / calls
    return sample


def _models(layers: int, kind: str, device):
    """A tiny Llama on ``device``: ``split`` at tp = world, ``dense``, or data-parallel over the
    world (``ddp``, ``fsdp``)."""
    model = make_tiny_model("llama", dtype=torch.float32, num_hidden_layers=layers, **TINY).to(device)
    if kind == "split":
        model = parallelize(model)
    elif kind in ("ddp", "fsdp"):
        model = parallelize(model, mesh=init_mesh(dist.get_world_size(), 1, torch.device(device).type),
                            data_parallel=kind)
    return model


LAYERS = (1, 6)  # the tiny models' blocks: the slope over them is one block's cost
BATCHES = (1, 8)  # inference's fixed costs at each: a larger batch costs more per call (cache, sampling)


class BlockCosts:
    """The fixed costs of a tiny Llama of ``LAYERS`` blocks (``kind`` as :func:`_models`), by
    phase: a forward of 4 tokens (``forward``), generating one token from a 4-token prompt
    (``prefill``), a training step (``train``), a decode step through the lean and Hugging Face
    forwards (``decode``, ``decode_hf``: ``(t(new) - t(1)) / (new - 1)``), the inference phases at
    each of ``BATCHES`` (``phase@b8``: at batch 8); a data-parallel model (``kind`` ``ddp`` or
    ``fsdp``) its training step only.

    :meth:`rounds` takes rounds of samples and may be called several times, so that a
    calibration spreads them over its length: a slow spell of a few seconds on a shared host then
    spoils the rounds of one window, not every round (measured in one window, a phase's cost came
    out up to twice another calibration's). Within a window each phase's rounds run one after the
    other, after one warm-up call of each of its functions (a decode step right after a training
    step finds the caches another phase left). Both depths are timed in the same rounds, so the
    host's drift meets both alike. On the host every norm of the models reads past the caches
    first (:class:`ColdCaches`, ``cold``), the reads' own time taken out.

    :meth:`costs` takes each timed function's least sample over the rounds, then the slope over
    depths (the block's cost) and the intercept (the step's), and a decode step as the difference
    of its two loops. The least, not the median: a sample is ~50 ms of calls, and what moves it
    on a shared host only adds time (a neighbour's slow spell; nothing runs a loop faster than the
    machine), and the estimates bench waits spells out
    (:meth:`~tensorpar.bench.host_speed.HostSpeed.settled`), so the profile is the machine between
    them (as ``timeit`` takes the least of its repeats). On 2026-12-05 three calibrations (of 16)
    met a spell in most of their rounds: the median put the decode block at 205 and 246 us (quiet
    calibrations: 123-152 us) and the decode at batch 1 at 0.78 and 0.80 of its estimate, and in
    the third the lower quartile still 201 us (0.78), four of its five rounds in the spell. Each
    sample's least, not each round's slope's: a spell on the subtracted sample (one block's, one
    token's loop) makes a difference smaller, so the least of differences would pick exactly the
    spoiled rounds."""

    def __init__(self, kind: str, new: int = 17, *, layers=LAYERS, batches=BATCHES, min_s: float = 0.05, device="cpu",
                 cold: ColdCaches | None = None):
        ids = torch.arange(4, device=device).reshape(1, 4)
        self._layers, self._new, self._done = layers, new, 0
        self._models = {depth: _models(depth, kind, device) for depth in layers}
        self._cold = cold or ColdCaches(device)  # one pool can serve every kind's models
        for model in self._models.values():
            self._cold.hook(model)
        fns = {"train": {}}
        for depth, model in self._models.items():
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            fns["train"][depth] = lambda model=model, opt=opt: train_step(model, opt, ids, max_norm=1.0)
        if kind not in ("ddp", "fsdp"):
            fns["forward"] = {d: lambda m=m: _forward(m, ids) for d, m in self._models.items()}
            for b in batches:
                tag, prompts = ("" if b == 1 else f"@b{b}"), ids.repeat(b, 1)
                for engine, key in (("auto", "decode"), ("hf", "decode_hf")):
                    fns[key + tag] = {(count, d): lambda m=m, x=prompts, e=engine, c=count: generate(m, x, c, engine=e)
                                      for count in (1, new) for d, m in self._models.items()}
        self._fns = fns
        self._samplers = {}  # each made in its phase's mode (its first call sets its count of calls)
        for phase, by_key in fns.items():
            self._set_mode(phase)
            self._samplers[phase] = {k: _sampler(f, min_s, device, self._cold) for k, f in by_key.items()}
        self._samples = {ph: {k: [] for k in by_key} for ph, by_key in fns.items()}

    def _set_mode(self, phase: str) -> None:
        for model in self._models.values():
            model.train(phase == "train")

    def rounds(self, n: int) -> None:
        """``n`` more rounds of every phase (each sampler once a round, the order rotating:
        :func:`~tensorpar.bench.timing.round_order`, so that none always runs first)."""
        if n <= 0:
            return
        for phase, samplers in self._samplers.items():
            self._set_mode(phase)
            for fn in self._fns[phase].values():
                fn()
            for i in range(self._done, self._done + n):
                for k in round_order(list(samplers), i):
                    self._samples[phase][k].append(samplers[k]())
        self._done += n

    def costs(self, rounds=None) -> dict:
        """``{phase: (per_block_s, per_step_s)}`` from each timed function's least sample over
        the rounds taken (over the round indices ``rounds``, where given: one window's)."""
        lo, hi = self._layers
        per_phase = {}
        for phase, every in self._samples.items():
            t = {k: min(v if rounds is None else [v[i] for i in rounds]) for k, v in every.items()}
            if phase.startswith("decode"):  # one token's cost: the loop of ``new`` tokens less the loop of one
                per_phase[phase] = {d: (t[(self._new, d)] - t[(1, d)]) / (self._new - 1) for d in self._layers}
                if not phase.startswith("decode_hf"):
                    per_phase["prefill" + phase[len("decode"):]] = {d: t[(1, d)] for d in self._layers}
            else:
                per_phase[phase] = t
        out = {}
        for phase, at in per_phase.items():
            slope = (at[hi] - at[lo]) / (hi - lo)
            out[phase] = (max(0.0, slope), max(0.0, at[lo] - lo * slope))
        return out


def _forward(model, ids):
    with torch.no_grad():
        model(ids)


# ---- the wait for the slower rank ------------------------------------------------------------------

WAIT_SHAPE, WAIT_M = (1408, 512), (1, 8, 64, 512)  # one weight of the grid, segments of ~0.1 to ~10 ms


def wait_points(transport: str, repeats: int, device="cpu", m_sizes=WAIT_M, work=None) -> dict:
    """``{p: [[segment_s, with_collective_s]]}`` for groups of the first ``p`` ranks, ``p`` from 2
    to the world: every member runs a GEMM (``m`` rows of ``WAIT_SHAPE``, cold weights, as
    :func:`gemm_points`; ``work(m)``, where given, makes the call instead) then a 64-byte
    all-reduce over ``transport``, back to back, and the same GEMMs without the all-reduce, in
    paired rounds (each loop first in every other round); the slowest rank's median time of the
    GEMM alone (``segment_s``), and that plus the median over rounds of the loop's time per GEMM
    with the collective less the slowest rank's without. The loop with the collective runs at the
    pace of whichever rank is slower at each call, so it costs more than the slowest rank's median
    and the collective's own latency: the wait for the slower rank, which grows with the noise of
    the work between two collectives and with the group (:func:`collective_wait`)."""
    n, k = WAIT_SHAPE
    weights = []
    if work is None:
        copies = max(1, COLD_BYTES // (n * k * 4))
        weights = [torch.randn(n, k, device=device) for _ in range(copies)]

        def work(m):
            x, turn = torch.randn(m, k, device=device), iter(range(1 << 62))
            return lambda: F.linear(x, weights[next(turn) % copies])
    out = {}
    for p in range(2, dist.get_world_size() + 1):
        group = dist.new_group(list(range(p)), backend=transport)
        if dist.get_rank() >= p:
            continue
        out[p] = [_wait_point(work(m), group, repeats, device) for m in m_sizes]
    return out


def _wait_point(gemm, group, repeats: int, device) -> list:
    flag = torch.zeros(16, device=device)  # 64 B: the least payload of a link's alpha (8 B takes gloo's faster path)

    def synced():
        gemm()
        collectives.all_reduce(flag, group)
    synced()
    t0 = time.perf_counter()
    gemm()
    first = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    collectives.all_reduce(first, group, op="max")
    calls = max(4, min(400, int(0.02 / max(first.item(), 1e-6))))  # about 20 ms a sample
    rounds = 2 * repeats + 1  # paired: each round's two loops ran within ~40 ms of each other
    times = torch.zeros(2, rounds, dtype=torch.float64)
    for i in range(rounds):
        for j, fn in ((0, gemm), (1, synced))[::1 if i % 2 else -1]:  # each first in every other round
            barrier(group)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            times[j, i] = (time.perf_counter() - t0) / calls
    collectives.all_reduce(times, group, op="max")  # the slowest rank's work alone; the loop with the collective
    seg = statistics.median(times[0].tolist())
    return [seg, seg + statistics.median((times[1] - times[0]).tolist())]


def collective_wait(points: dict | None, links: dict) -> dict:
    """``{transport: {p: {"points": [[segment_s, wait_s]], "measured"}}}``: the wait at a
    collective of ``p`` ranks for the slower rank (and for a blocked rank to wake) by the length
    of the work before it: :func:`wait_points`' loop with the collective, less the slowest rank's
    work and the collective's fitted latency ``alpha`` at that size (what the estimate does not
    count otherwise), at least 0; empty where not measured."""
    out = {}
    for tr, by_size in (points or {}).items():
        out[tr] = {}
        for p, pts in by_size.items():
            alpha = links[tr].ops["all_reduce"][str(p)]["alpha_s"]
            out[tr][str(p)] = {"points": [[seg, max(0.0, both - seg - alpha)] for seg, both in sorted(pts)],
                               "measured": [[seg, both] for seg, both in sorted(pts)]}
    return out
