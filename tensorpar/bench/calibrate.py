"""``tensorpar calibrate``: measure this machine into a hardware profile (:mod:`tensorpar.planner.profile`).

One launch of ``ranks`` processes, one thread each, every rank measuring at once (they share the
cores and the memory bus, as they do in a run); each figure is the slowest rank's. The rates
(GEMMs in the first dtype, memory, the optimizer) and the collectives are measured at the start,
the middle and the end of the run and each point is the median of the three: a shared host's
speed moves within a minute, and a profile should hold its speed over the calibration, not at
one moment (gloo's latency on this project's VM moved from 0.3 to 1.9 ms at 2 KiB between
windows of a few seconds).

- **GEMMs**: ``F.linear`` of ``(m, k)`` by an ``(n, k)`` weight over a grid of shapes (m from 1 to
  512, n from 128 to 4096 and k from 128 to 1408; on the host float64 on five of them), float32 and
  float64 (on a GPU float32 and bfloat16), each call on another copy of the weight (64 MiB of
  them: weights come from memory, as in a model's pass); fitted to
  ``t = fixed + 2 m n k / rate + e (m k + k n + m n) / bandwidth`` by least squares on the
  relative error (the three coefficients enter linearly), with the fit's median and largest
  relative error reported; the points are kept, and the estimate scales the formula by the
  measured ratio of the nearest shapes (:class:`tensorpar.planner.profile.Gemm`);
- **memory**: a copy and an add of 32 MiB tensors (bytes read plus written per second);
- **the optimizer step**: clipping and AdamW over ~12.9M float32 parameters, per parameter;
- **a block's fixed cost**: a tiny Llama (hidden 32) of 1 and of 6 blocks, split at tp = ranks and
  unsplit, timed for a forward of 4 tokens, a prompt, a training step (``train_step``: loss,
  backward, clipping, AdamW) and a decode step (tensorpar's lean forward and Hugging Face's), and
  data-parallel over the ranks (DDP, FSDP) for a training step; the slope over blocks is the cost
  of one block call, the intercept the step's own; the time spent inside collectives (a
  stopwatch's: a ledger's hooks would be timed too) is taken out, as the estimate counts
  collectives by their own fit; on the host each norm first reads 4 MiB past the caches, as a
  real model's weights leave them (:class:`~tensorpar.bench.calibrate_costs.ColdCaches`, the
  reads' time taken out); its rounds are
  spread over the same windows as the rates (:class:`~tensorpar.bench.calibrate_costs.BlockCosts`);
- **collectives**: all-reduce, all-gather, reduce-scatter, broadcast and a point-to-point send,
  over shared memory and over gloo, in groups of 2 to ``ranks``, payloads 8 B to 16 MiB; fitted to
  ``alpha + n beta`` (alpha from the small payloads, beta from the large: :func:`~tensorpar.bench.calibrate_links.fit_link`), the
  fit's errors reported; the all-reduce's small payloads also after each kind's rounds of the
  fixed costs, 12 moments more, and ``alpha`` the mean of the two contexts' medians
  (:class:`~tensorpar.bench.calibrate_links.LatencySamples`);
- **the wait at a collective for the slower rank**, over shared memory and gloo, by the length of
  the work before it;
- **a check after the windows** (on the host): the estimates bench's probes, read right after;
  where the host runs faster than during the windows, they met a slow spell and one more window
  is measured (:func:`calibrate_worker`).

The fixed costs, the optimizer and the wait are measured in :mod:`tensorpar.bench.calibrate_costs`,
the collectives in :mod:`tensorpar.bench.calibrate_links`.
"""
from __future__ import annotations

import datetime
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from tensorpar import distributed as dist
from tensorpar.bench.calibrate_costs import (COLD_BYTES, OPTIMIZER_SHAPES, QUICK_OPTIMIZER, WAIT_M, _median_time,
                                             BlockCosts, ColdCaches, collective_wait, optimizer_rate, wait_points)
from tensorpar.bench.calibrate_links import (PAYLOADS, LatencySamples, _latency_of, _links_by, fit_link, link_groups,
                                             link_points)
from tensorpar.bench.host_speed import DISPATCH_CEIL, PROFILE_SLOW, DispatchProbe, calibration_check, probe_shapes
from tensorpar.bench.timing import spread
from tensorpar.planner.hardware import Hardware
from tensorpar.planner.profile import Gemm, Link, Profile

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}  # on the host; on a GPU fp32 and bf16
M_SIZES = (1, 8, 64, 512)
# (n, k): square, narrow and wide around k = 512, long (a vocabulary's head shard) and 1024 square. The
# estimate scales a shape by its nearest (n, k)'s measured ratio: a formula fitted on squares alone
# put narrow (128 x 512) and long (4000 x 512) shards 10-18% under their measured time.
NK_SIZES = ((128, 128), (128, 512), (256, 512), (512, 256), (512, 512), (768, 512), (512, 768), (1408, 512),
            (512, 1408), (1024, 1024), (4096, 512))
# float64's on the host (exactness runs, seldom timed); on a GPU every dtype takes the whole grid
OTHER_NK = ((128, 128), (512, 512), (1408, 512), (512, 1408), (1024, 1024))
# The later windows' samples per point: the first window's 5 and their 3 and 3, 11 in all, each
# point the median of the windows' medians (calibrate in about 42 s, not 50).
LATER_REPEATS = 3
AGAIN_ROUNDS = 2  # the rounds of the fixed costs in the window a slow spell adds (calibrate_worker)
QUICK = dict(m_sizes=(1, 64), nk_sizes=((128, 128), (512, 512)), payloads=(8, 64, 4096, 1 << 20), repeats=3, new=5,
             quick=True)


def gemm_points(dtype, m_sizes, nk_sizes, repeats: int, device="cpu") -> list:
    """``[m, n, k, seconds]`` of ``F.linear`` over the grid, each call on the next of enough
    copies of the weight to fill ``COLD_BYTES`` (so weights come from memory, as in a model's
    pass over its layers, not from a cache the model would not fit in)."""
    out = []
    for n, k in nk_sizes:
        copies = max(1, COLD_BYTES // (n * k * dtype.itemsize))
        # ones, not random: a GEMM's time does not depend on the values, and 64 MiB of normal
        # samples per shape took a second a window of the calibration
        weights = [torch.ones(n, k, dtype=dtype, device=device) for _ in range(copies)]
        for m in m_sizes:
            x = torch.randn(m, k, dtype=dtype, device=device)
            turn = iter(range(1 << 62))
            out.append([m, n, k, _median_time(lambda: F.linear(x, weights[next(turn) % copies]), repeats,
                                              device=device)])
    return out


def fit_gemm(points: list, bytes_per_elem: int) -> Gemm:
    """Relative least squares of ``t = c + a flops + b bytes`` (see the module docstring); a
    negative coefficient is dropped and the rest refitted."""
    t = np.array([p[3] for p in points])
    cols = np.array([[1.0, 2.0 * m * n * k, bytes_per_elem * (m * k + k * n + m * n)] for m, n, k, _ in points])
    coef = _nonneg_lstsq(cols, t)
    pred = cols @ coef
    err = np.abs(pred - t) / t
    return Gemm(rate_flops=1.0 / coef[1] if coef[1] > 0 else float(max(cols[:, 1] / t)),
                bytes_per_s=1.0 / coef[2] if coef[2] > 0 else 1e15, fixed_s=float(coef[0]),
                fit={"median_rel_err": float(np.median(err)), "max_rel_err": float(err.max()), "points": points,
                     "bytes_per_elem": bytes_per_elem})


def _nonneg_lstsq(cols: np.ndarray, t: np.ndarray) -> np.ndarray:
    keep = list(range(cols.shape[1]))
    while True:
        a = cols[:, keep] / t[:, None]
        sol, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
        if (sol >= 0).all() or len(keep) == 1:
            coef = np.zeros(cols.shape[1])
            coef[keep] = np.maximum(sol, 0)
            return coef
        keep.pop(int(np.argmin(sol)))


def memory_rate(repeats: int, device="cpu") -> float:
    a = torch.ones(8 << 20, device=device)  # 32 MiB
    b, c = torch.empty_like(a), torch.empty_like(a)
    copy = 2 * a.nbytes / _median_time(lambda: b.copy_(a), repeats, device=device)
    add = 3 * a.nbytes / _median_time(lambda: torch.add(a, b, out=c), repeats, device=device)
    return statistics.median([copy, add])


# ---- the job --------------------------------------------------------------------------------------


def calibrate_worker(m_sizes=M_SIZES, nk_sizes=NK_SIZES, payloads=PAYLOADS, repeats: int = 5, new: int = 17,
                     quick: bool = False, spell: tuple = (PROFILE_SLOW, DISPATCH_CEIL)) -> list:
    """Every rank's measurements (each rank gets all of them): in each of three windows the rates
    and collectives (:func:`_rates`) then rounds of the fixed costs
    (:class:`~tensorpar.bench.calibrate_costs.BlockCosts`), the wait at a collective before the
    last (and a fourth window where the check below finds a spell); each rate the median of the
    windows', each fixed cost the least over every round. ``quick``: the
    fixed costs of the split and unsplit models only, at batch 1, over 1 and 2 blocks, short
    samples, in two windows, the rates in the first only, the wait at two lengths of work (a
    smoke run).

    On the host, then, a check (:func:`~tensorpar.bench.host_speed.calibration_check`): where the
    host probes as fast as ``spell`` times its speed during the windows or more (its GEMMs, its
    dispatch probe: the bench's ``PROFILE_SLOW`` and ``DISPATCH_CEIL``, the second noisier: one
    quiet calibration's dispatch readings spread 0.52-0.85 ms), the windows met a slow spell, and
    one more window (the float32 rates, the wait, ``AGAIN_ROUNDS`` rounds of the fixed costs)
    joins them: each rate is then the median over the windows the spell spared (:func:`spared`:
    their probe GEMMs within ``PROFILE_SLOW`` of the fastest window's), the wait the new window's,
    each fixed cost the least over every round. Not the rates' median over all four windows: a
    decode at batch 1 is mostly its weights' GEMMs, and in one calibration that found a spell
    (2026-12-05 14:01) the new window's least decode block was 111 us, but the median over four
    windows kept the GEMMs 12% slow, the wait from the third window at 0.84 ms a token (0.2-0.5
    quiet), and the decode came out at 0.80 of its estimate."""
    torch.set_num_threads(1)
    device = dist.rank_device()  # its GPU under NCCL, else the host
    t0 = time.perf_counter()
    kinds, kw = ("split", "dense", "ddp", "fsdp"), {}
    if quick:
        kinds, kw = ("split", "dense"), dict(layers=(1, 2), batches=(1,), min_s=0.0)
    dtypes = DTYPES if device.type == "cpu" else {"fp32": torch.float32, "bf16": torch.bfloat16}
    grid = dict(m_sizes=m_sizes, nk_sizes=nk_sizes, payloads=payloads, device=device,
                groups=link_groups(dist.get_world_size(), device),
                optimizer_shapes=QUICK_OPTIMIZER if quick else OPTIMIZER_SHAPES)
    took, passes, blocks, mine = {"rates": 0.0, "blocks": 0.0, "wait": 0.0, "check": 0.0, "again": 0.0}, [], {}, {}
    latency = LatencySamples(grid["groups"], device)
    probe = DispatchProbe(device) if device.type == "cpu" else None  # a GPU's host queues kernels: no check

    def window(i: int, rounds: int, rates: dict, rate_repeats: int, wait: bool, part: str | None = None) -> float:
        """One window (``part``: the key of ``took`` its whole time goes to, if not by part); the
        dispatch probe's reading after it (None on a GPU)."""
        t = time.perf_counter()
        if rates:
            passes.append({**_rates(rates, **grid, repeats=rate_repeats), "window": i})
        took[part or "rates"] += time.perf_counter() - t
        t = time.perf_counter()
        if wait:
            mine["wait"] = {tr: wait_points(tr, repeats, device, m_sizes=WAIT_M[:2] if quick else WAIT_M)
                            for tr in ("shm", "gloo")}
        took[part or "wait"] += time.perf_counter() - t
        t = time.perf_counter()
        if not blocks:
            cold = ColdCaches(device)
            blocks.update({kind: BlockCosts(kind, new, device=device, cold=cold, **kw) for kind in kinds})
        for costs in blocks.values():
            costs.rounds(rounds)
            latency.take()
        took[part or "blocks"] += time.perf_counter() - t
        return None if probe is None else probe()

    windows = spread(repeats, 2 if quick else 3)
    first = list(dtypes)[:1]  # the other dtypes once: fp64 on a host, bf16 on a GPU
    passes_kept = None  # every window's, unless the check finds a spell
    dispatch = [window(i, rounds, {k: dtypes[k] for k in (dtypes if i == 0 else first)} if i == 0 or not quick else {},
                       repeats if i == 0 else min(repeats, LATER_REPEATS),
                       wait=i == len(windows) - 1 and device.type == "cpu")
                for i, rounds in enumerate(windows)]
    if probe is not None:
        t = time.perf_counter()
        points = _median_of_passes(passes)["gemm"][first[0]]
        slowest = torch.tensor([p[3] for p in points], dtype=torch.float64)
        dist.all_reduce(slowest, op="max")  # the profile's points are the slowest rank's
        check = calibration_check([[*p[:3], t_] for p, t_ in zip(points, slowest.tolist())], dispatch, probe)
        again = torch.tensor([float(met_spell(check, spell))])
        dist.broadcast(again, 0)  # one decision: the window is collective
        mine["check"] = {**check, "again": bool(again.item())}
        took["check"] += time.perf_counter() - t
        if mine["check"]["again"]:
            windows = [*windows, AGAIN_ROUNDS]
            # the dispatch probe after it too: whether the spell had ended (the window's GEMMs: by_window)
            mine["check"]["again_dispatch_s"] = window(len(windows) - 1, AGAIN_ROUNDS, {k: dtypes[k] for k in first},
                                                       min(repeats, LATER_REPEATS), wait=True, part="again")
            kept = spared(passes, first[0])
            mine["check"]["kept_windows"] = [passes[j]["window"] for j in kept]
            passes_kept = [passes[j] for j in kept]
    mine.update({"blocks": {kind: costs.costs() for kind, costs in blocks.items()}, "device": device.type,
                 "latency": latency.samples,
                 "by_window": _by_window(passes, blocks.get("split"), windows),
                 "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 **_median_of_passes(passes, passes_kept), "seconds": time.perf_counter() - t0,
                 "seconds_by_part": {k: round(v, 2) for k, v in took.items()}})  # where calibrate's time went
    return dist.all_gather_object(mine)


def met_spell(check: dict, spell: tuple = (PROFILE_SLOW, DISPATCH_CEIL)) -> bool:
    """Whether :func:`~tensorpar.bench.host_speed.calibration_check`'s figures say the windows met
    a slow spell: the GEMMs ``spell[0]`` or more times as fast right after them, or the dispatch
    probe ``spell[1]`` or more."""
    return check["gemm_speed"] >= spell[0] or check["dispatch_speed"] >= spell[1]


def _by_window(passes: list, split, windows: list) -> list:
    """Each window's own figures, beside the medians the profile keeps (a diagnostic: a slow spell
    shows as one window, or every window, off the others): the split model's decode and training
    block costs over the window's rounds, each transport's all-reduce ``alpha`` at 2 ranks, and the
    float32 GEMM of the grid's largest weight at its least and most ``m`` (the estimates bench's
    probe), from the pass of the window (its ``window``; a quick run's later windows have none)."""
    out, first, of = [], 0, {p["window"]: p for p in passes}
    for i, n in enumerate(windows):
        w = {}
        if split is not None and n:
            c = split.costs(range(first, first + n))
            w["block_s"] = {ph: c[ph][0] for ph in ("decode", "train") if ph in c}
        first += n
        if i in of:
            w["alpha_s"] = {tr: fit_link(ops["all_reduce"][2])["alpha_s"] for tr, ops in of[i]["links"].items()
                            if 2 in ops["all_reduce"]}
            t = {tuple(p[:3]): p[3] for p in of[i]["gemm"]["fp32"]}
            w["gemm_s"] = {"x".join(map(str, shape)): t[shape] for shape in probe_shapes(t)}
        out.append(w)
    return out


def _max_over(trees):
    """The elementwise maximum of equally shaped dicts, lists and numbers (ranks' figures: the slowest's)."""
    if isinstance(trees[0], dict):
        return {k: _max_over([t[k] for t in trees]) for k in trees[0]}
    if isinstance(trees[0], list):
        return [_max_over([t[i] for t in trees]) for i in range(len(trees[0]))]
    return max(trees)


def _rates(dtypes: dict, *, m_sizes, nk_sizes, payloads, repeats: int, device, groups, optimizer_shapes) -> dict:
    """One window's rates: the GEMM grid in ``dtypes`` (float32's whole grid; on the host, float64
    on ``OTHER_NK``'s shapes), the memory, the optimizer and the collectives."""
    return {"gemm": {k: gemm_points(dt, m_sizes, nk_sizes if k == "fp32" or device.type != "cpu" else _other(nk_sizes),
                                    repeats, device) for k, dt in dtypes.items()},
            "memory": memory_rate(repeats, device),
            "optimizer": optimizer_rate(repeats, device, shapes=optimizer_shapes),
            "links": link_points(groups, payloads, repeats, device)}


def _other(nk_sizes) -> tuple:
    """The grid of the dtypes after the first: its shapes among ``OTHER_NK`` (all, if none is)."""
    return tuple(nk for nk in nk_sizes if nk in OTHER_NK) or tuple(nk_sizes)


def _median_of_passes(passes: list, kept: list | None = None) -> dict:
    """``{"gemm", "memory", "optimizer", "links"}``: each GEMM point's, the memory and optimizer
    rates', each collective point's median over the passes that measured them, among ``kept``
    where given (:func:`spared`; a dtype only the first window measured keeps its pass)."""
    use, gemm = kept or passes, {}
    for k, pts in passes[0]["gemm"].items():
        mine = [p["gemm"][k] for p in use if k in p["gemm"]] or [p["gemm"][k] for p in passes if k in p["gemm"]]
        gemm[k] = [[*pt[:3], statistics.median(q[i][3] for q in mine)] for i, pt in enumerate(pts)]
    return {"gemm": gemm, "memory": statistics.median(p["memory"] for p in use),
            "optimizer": statistics.median(p["optimizer"] for p in use),
            "links": _links_by([p["links"] for p in use], statistics.median)}


def spared(passes: list, dtype: str = "fp32") -> list:
    """The indices of the passes a slow spell spared: those whose probe GEMMs (``dtype``'s,
    :func:`~tensorpar.bench.host_speed.probe_shapes`; the slowest rank's, so that every rank keeps
    the same) took at most ``PROFILE_SLOW`` times the fastest pass's, their geometric mean."""
    times = []
    for p in passes:
        t = {tuple(q[:3]): q[3] for q in p["gemm"][dtype]}
        times.append([t[shape] for shape in probe_shapes(t)])
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op="max")
    speed = slowest.log().mean(dim=1).exp().tolist()
    return [j for j, t in enumerate(speed) if t <= min(speed) * PROFILE_SLOW]


def profile_of(per_rank: list, *, ranks: int, seconds: float, quick: bool) -> Profile:
    """The profile of one launch's measurements (the same on every rank)."""
    return build_profile(_slowest(per_rank), ranks=ranks, cores=os.cpu_count() or 1, seconds=seconds, quick=quick)


def _slowest(per_rank: list) -> dict:
    """Each figure from the slowest rank (the largest time, the smallest rate)."""
    first = per_rank[0]
    gemm = {k: [[*pt[:3], max(r["gemm"][k][i][3] for r in per_rank)] for i, pt in enumerate(first["gemm"][k])]
            for k in first["gemm"]}
    blocks = {kind: {ph: tuple(max(r["blocks"][kind][ph][j] for r in per_rank) for j in (0, 1))
                     for ph in first["blocks"][kind]} for kind in first["blocks"]}
    links = _links_by([r["links"] for r in per_rank], max)
    return {"gemm": gemm, "memory": min(r["memory"] for r in per_rank), "blocks": blocks, "links": links,
            "optimizer": max(r["optimizer"] for r in per_rank) if "optimizer" in first else None,
            "wait": first.get("wait"), "device": first.get("device", "cpu"), "name": first.get("name", "cpu"),
            "by_window": _max_over([r["by_window"] for r in per_rank]) if "by_window" in first else None,
            "latency": _latency_of(per_rank), "check": first.get("check"),
            "seconds_by_part": first.get("seconds_by_part")}


def calibrate(ranks: int = 2, *, quick: bool = False, repeats: int = 5) -> Profile:
    """Measure this machine with ``ranks`` processes; return its profile."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise ValueError(f"--ranks ({ranks!r}) must be an integer >= 2 (collectives need a peer)")
    kw = dict(QUICK) if quick else dict(repeats=repeats)
    t0 = time.perf_counter()
    per_rank = dist.launch(calibrate_worker, ranks, *_args(kw), backend="auto", timeout=300)[0]
    return profile_of(per_rank, ranks=ranks, seconds=time.perf_counter() - t0, quick=quick)


def _args(kw: dict) -> tuple:
    full = dict(m_sizes=M_SIZES, nk_sizes=NK_SIZES, payloads=PAYLOADS, repeats=5, new=17, quick=False,
                spell=(PROFILE_SLOW, DISPATCH_CEIL)) | kw
    return (full["m_sizes"], full["nk_sizes"], full["payloads"], full["repeats"], full["new"], full["quick"],
            full["spell"])


WIDTH = {"fp32": 4, "fp64": 8, "bf16": 2, "fp16": 2}


def _bandwidth(link: Link) -> float:
    fit = link.ops["all_reduce"][str(2)]
    return 1.0 / fit["beta_s_per_byte"] if fit["beta_s_per_byte"] > 0 else 1e12


def build_profile(m: dict, *, ranks: int, cores: int, seconds: float, quick: bool) -> Profile:
    """The profile of the slowest rank's measurements: on the host, shared memory inside the
    node and gloo across; on GPUs, NCCL both (across nodes it is NCCL's too, over another link:
    calibrate a multi-node run to measure it)."""
    gemm = {k: fit_gemm(pts, WIDTH[k]) for k, pts in m["gemm"].items()}
    latency = m.get("latency") or {}
    links = {tr: Link(tr, {op: {str(p): fit_link(pts, latency.get(tr, {}).get(p, ()) if op == "all_reduce" else ())
                                for p, pts in table.items()} for op, table in ops.items()})
             for tr, ops in m["links"].items()}
    suffix = {"split": "", "dense": "@tp1", "ddp": "@ddp", "fsdp": "@fsdp"}

    def key(ph, kind):  # decode@b8 + @tp1 -> decode@tp1@b8
        base, _, batch = ph.partition("@")
        return base + suffix[kind] + (f"@{batch}" if batch else "")
    block = {key(ph, kind): v[0] for kind, phases in m["blocks"].items() for ph, v in phases.items()}
    step = {key(ph, kind): v[1] for kind, phases in m["blocks"].items() for ph, v in phases.items()}
    gpu = m.get("device", "cpu") == "cuda"
    intra, inter = ("nccl", "nccl") if gpu else ("shm", "gloo")
    if gpu:
        memory = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks
    what = f"{ranks} x {m.get('name', 'GPU')}" if gpu else f"{ranks} ranks x 1 thread"
    hardware = Hardware(name=f"this machine, {what} (measured)",
                        peak_dense_bf16_flops=max(g.rate_flops for g in gemm.values()),
                        peak_dense_tf32_flops=gemm["fp32"].rate_flops, hbm_bytes_per_s=m["memory"],
                        mem_bytes=memory or 1.0, links={tr: 2 * _bandwidth(link) for tr, link in links.items()},
                        intra_node_link=intra, inter_node_bytes_per_s=_bandwidth(links[inter]), devices_per_node=ranks)
    return Profile(name=hardware.name, device=m.get("device", "cpu"), hardware=hardware, gemm=gemm,
                   memory_bytes_per_s=m["memory"], block_call_s=block, step_call_s=step, links=links,
                   intra_link=intra, inter_link=inter, synchronous=not gpu, source="tensorpar calibrate",
                   collective_wait=collective_wait(m.get("wait"), links),
                   optimizer_s_per_param=m.get("optimizer"),
                   measured={"ranks": ranks, "threads_per_rank": 1, "cpu_count": cores, "quick": quick,
                             "seconds": round(seconds, 2), "seconds_by_part": m.get("seconds_by_part"),
                             "by_window": m.get("by_window"), "check": m.get("check"),
                             "torch": torch.__version__,
                             "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
