"""The collectives' figures for ``tensorpar calibrate`` (:mod:`tensorpar.bench.calibrate`): each
operation timed over each transport and group size (:func:`link_points`), the all-reduce's small
payloads at more moments (:class:`LatencySamples`), and the ``alpha + n beta`` fit
(:func:`fit_link`).
"""
from __future__ import annotations

import statistics

import numpy as np
import torch

from tensorpar import distributed as dist
from tensorpar.distributed.probe import OPS, time_collective

PAYLOADS = tuple(8 * 8 ** k for k in range(8))  # 8 B ... 16 MiB
SMALL, LARGE = 4096, 256 << 10  # the latency regime (at most), the bandwidth regime (at least)
# The latency regime's least payload: 8 B is one float32 a rank at p = 2, which gloo's all-reduce
# ran 2-3x faster than any other payload (0.33-0.83 ms against 1.0-2.1 ms for 64 B to 4 KiB, in
# every calibration of 2026-12-05, ~25 of them; 4-8 B 0.33-0.35 ms and 16 B-4 KiB 0.8-1.4 ms in
# one interleaved sweep), a path no layer's collective takes (a hidden vector is hundreds of
# elements); its median with three slower points put the decode over gloo at up to 1.2-1.3x its
# estimate.
LEAST = 64


def fit_link(points: list, latency=()) -> dict:
    """``[(payload_bytes, seconds)]`` -> ``{"alpha_s", "beta_s_per_byte", "fit"}``: the latency
    ``alpha`` is the median time of the small payloads (``LEAST`` to ``SMALL`` bytes: there the
    bytes cost nothing, and a transport's latency is often bimodal, which a straight line through
    every size would average away; below ``LEAST``, a payload of an element or two a rank, gloo
    takes a faster path than any layer's collective, which only a grid without larger small
    payloads and without ``latency`` falls back on); with ``latency``'s samples of them
    (:class:`LatencySamples`: the same payloads right after the fixed costs' rounds), the mean of
    the two contexts' medians, each weighing alike however many samples it has: a layer's
    collective comes after its own work, and over gloo it costs between the two (below).
    ``beta`` is the median of ``(t - alpha) / n`` over the large payloads (at least ``LARGE``
    bytes); the fit's errors are over every point.

    Over gloo on this project's VM (2026-12-05) the small all-reduce read 1.4-1.9 ms among the
    other collectives and 0.96-1.25 ms right after the fixed costs' rounds, while the bench's
    decode over gloo paid 1.28-1.70 ms a call (its time less the estimate's other terms, over the
    collectives it counts; 17 runs). Over those runs, that decode came out at 0.96-1.23 of its
    estimate with the samples in one median (36 of its 39 values); re-estimated from the same
    profiles, at 0.78-1.06 with the grid's median alone and at 0.93-1.14 with the mean of the two.
    Over shared memory the two contexts agree within a few microseconds."""
    contexts = [statistics.median(c) for c in ([s for n, s in points if LEAST <= n <= SMALL],
                                               [s for n, s in latency if LEAST <= n <= SMALL]) if c]
    alpha = float(statistics.mean(contexts) if contexts else
                  statistics.median([s for n, s in points if n <= SMALL] or [min(s for _, s in points)]))
    large = [(s - alpha) / n for n, s in points if n >= LARGE and s > alpha]
    beta = float(statistics.median(large)) if large else 0.0
    t = np.array([s for _, s in points])
    pred = np.array([alpha + beta * n for n, _ in points])
    err = np.abs(pred - t) / t
    return {"alpha_s": alpha, "beta_s_per_byte": beta,
            "fit": {"median_rel_err": float(np.median(err)), "max_rel_err": float(err.max()),
                    "points": [[int(n), float(s)] for n, s in points],
                    **({"latency": [[int(n), float(s)] for n, s in latency]} if latency else {})}}


def link_groups(world: int, device="cpu") -> dict:
    """``{transport: {p: group of the first p ranks}}``: shared memory and gloo on the host; NCCL
    (the world's backend) on a GPU. Made once, every rank calling (a communicator holds memory)."""
    return {transport: {p: dist.new_group(list(range(p)), backend=None if transport == "nccl" else transport)
                        for p in range(2, world + 1)}
            for transport in (("nccl",) if torch.device(device).type == "cuda" else ("shm", "gloo"))}


def link_points(groups: dict, payloads, repeats: int, device="cpu") -> dict:
    """``{transport: {op: {p: [(payload, seconds)]}}}`` over :func:`link_groups`' groups, the
    tensors on ``device``; a rank outside a group skips it."""
    out = {}
    for transport, by_size in groups.items():
        out[transport] = {op: {} for op in OPS}
        for p, group in by_size.items():
            if dist.get_rank() >= p:
                continue
            for op in OPS:
                out[transport][op][p] = [(n, time_collective(op, n, group, list(range(p)), repeats=repeats,
                                                             device=device)) for n in payloads]
    return out


class LatencySamples:
    """The all-reduce's small payloads (``LEAST`` to ``SMALL``: 64 B, 512 B and 4 KiB) timed at
    more moments than the three windows' grids: :meth:`take` once after each kind's rounds of the
    fixed costs, 12 moments in a full calibration (4 kinds in 3 windows; 16 where calibrate's check
    adds a window; 4 in a quick one), a sample 32 back-to-back calls (~50 ms over gloo), kept per
    transport and group size for :func:`fit_link`'s ``alpha``: the median of these samples (36 of
    them in a full calibration) is one of its two contexts, the
    grid's (among the other collectives) the other (``by_window``'s alpha is each window's grid
    alone). Gloo's latency over loopback jumps between 0.8 and 2.1 ms within seconds: the
    windows' grids alone, three moments of about a second each, put its ``alpha`` at 1.25-1.92 ms
    across the calibrations of 2026-12-05 while the bench's decode over gloo paid a steadier
    1.27-1.74 ms a call over its minutes, and five of 24 runs had that case at 0.76-0.82 of its
    estimate. The all-reduce only: every tensor-parallel layer pays it; the other operations'
    ``alpha`` keep the windows' grids."""

    PAYLOADS = (64, 512, 4096)

    def __init__(self, groups: dict, device="cpu"):
        self.groups, self.device = groups, device
        self.samples = {tr: {p: [] for p in by_size} for tr, by_size in groups.items()}

    def take(self) -> None:
        for tr, by_size in self.groups.items():
            for p, group in by_size.items():
                if dist.get_rank() < p:
                    self.samples[tr][p] += [(n, time_collective("all_reduce", n, group, list(range(p)), repeats=1,
                                                                device=self.device)) for n in self.PAYLOADS]


def _links_by(tables: list, reduce) -> dict:
    """One ``{transport: {op: {p: [(payload, seconds)]}}}`` from several (passes, or ranks), each
    point's seconds ``reduce``-d over the tables that hold its group size."""
    return {tr: {op: {p: [(n, reduce([t[tr][op][p][i][1] for t in tables if p in t[tr][op]]))
                          for i, (n, _) in enumerate(pts)] for p, pts in by_size.items()}
                 for op, by_size in ops.items()} for tr, ops in tables[0].items()}


def _latency_of(per_rank: list) -> dict:
    """:class:`LatencySamples`' samples, each the slowest member's (a rank outside a group has none)."""
    out = {}
    for tr, by_size in (per_rank[0].get("latency") or {}).items():
        out[tr] = {}
        for p in by_size:
            mine = [r["latency"][tr][p] for r in per_rank if r["latency"][tr][p]]
            out[tr][p] = [(pt[0], max(m[i][1] for m in mine)) for i, pt in enumerate(mine[0])] if mine else []
    return out
