"""The host's speed against its calibrated profile, for the estimates bench
(:mod:`tensorpar.bench.estimates`): a GEMM probe and a dispatch probe before each sample
(:class:`HostSpeed`, :class:`DispatchProbe`), a wait for a host in a slow spell
(:meth:`HostSpeed.settled`), and the note on a run whose profile was measured in one
(:func:`spell_note`).
"""
from __future__ import annotations

import statistics
import time

import torch

from tensorpar import distributed as dist
from tensorpar.bench.calibrate_costs import COLD_BYTES, _median_time, _models, _sampler
from tensorpar.models.generation import generate
from tensorpar.planner.profile import Profile

# Before a sample, a host probed under 0.9 of its calibrated speed is waited for: probed again every
# 2 s, at most 60 s a sample and 360 s a run (HostSpeed.settled). This VM's slow spells last seconds
# to minutes; in one run of a set (06:55 UTC, 2026-12-05) the host stayed at 0.83-0.93 and every
# case came out 1.08-1.36x its estimate, against 0.93-1.13x in the two runs before it; with 120 s a
# run, 5 of 12 runs spent it all, and one (07:55) still met the host at 0.78 (FSDP 1.26x). A sample
# waits up to a minute, not 20 s: a spell of minutes (11:35, GEMM probe 0.6-0.8, dispatch 1.5-2.7x)
# drained 240 s in 20 s waits, a dozen samples each taken in the spell after its wait, then met
# every sample of the pipeline case (1.32x); a longer wait a sample outlasts such a spell in a few.
SETTLE_FLOOR, SETTLE_POLL_S, SETTLE_WAIT_S, SETTLE_BUDGET_S = 0.9, 2.0, 60.0, 360.0
# A run whose probes found the host this much faster than the profile (the median over every
# sample's): the calibration met a slow spell, and every estimate from it runs high. Sets of
# 2026-12-05: runs whose calibration was sound probed 0.89-1.06; the two whose decode cases came out
# at 0.70-0.80 of their estimates probed 1.10 and 1.14 (their fixed costs 1.5-1.8x the others').
PROFILE_SLOW = 1.08
# The dispatch probe's reading over the lower quartile of its readings so far in the run, from its
# DISPATCH_AFTER-th on, above which the host is waited for too (as under SETTLE_FLOOR): a spell that
# took a block's Python and dispatch 1.4-2x while the GEMM probe moved under 10% put a run's decode
# at batch 8 at 1.25x its estimate (2026-12-05). Its own readings, not calibrate's: the same probe
# read 1.5x apart in calibrate's process and the bench's (0.55 against 0.37 ms, a quiet run).
DISPATCH_CEIL, DISPATCH_AFTER = 1.25, 4
# calibrate's own check after its windows (calibration_check): three readings of the probes a second
# apart, their medians against the windows'; the GEMMs at PROFILE_SLOW or more, or the dispatch probe
# at DISPATCH_CEIL or more, one more window (tensorpar.bench.calibrate). On 2026-12-05 two calibrations (of ~30) met a spell over most of their
# windows (probe GEMMs 665-739 us against 553-620 quiet; the decode block's least 194 us against
# 123-160) that ended by the bench's first probe (1.16-1.27x the profile): their decode at batch 1
# came out at 0.75 and 0.77 of its estimate.
CHECK_READINGS, CHECK_PAUSE_S = 3, 1.0


class DispatchProbe:
    """A tiny unsplit Llama of one block generating a token from a 4-token prompt (Python and
    dispatch, the work of a block's fixed cost; :mod:`tensorpar.bench.calibrate_costs`), 50 calls
    (20-30 ms on this project's VM), on every rank at once: the slowest rank's seconds per call.
    Making one is collective (the ranks agree on the count of calls); it leaves the global random
    state as it found it."""

    def __init__(self, device="cpu"):
        with torch.random.fork_rng(devices=[]):  # the tiny model is made from seed 0
            model = _models(1, "dense", device).eval()
        ids = torch.arange(4, device=device).reshape(1, 4)

        def token():
            with torch.no_grad():
                generate(model, ids, 1)
        token()
        token()  # warm: the count of calls comes from the next one's time
        self._sample = _sampler(token, 0.05, device)

    def __call__(self) -> float:
        t = torch.tensor([self._sample()], dtype=torch.float64)
        dist.all_reduce(t, op="max")
        return float(t.item())


class HostSpeed:
    """The host's speed now against the profile's, as calibrate measured it: two GEMMs of its
    grid (the largest weight at its smallest ``m``, bound by memory, and at its largest, bound by
    arithmetic) timed its way (cold weights, every rank at once, the slowest rank's time),
    profile's time over now's, the geometric mean of the two (> 1: faster than when calibrated).
    A shared machine's speed moves between a calibration and a run and within a run; this is
    measured before each sample, so that each sample can also be read at the profile's speed.
    ``None`` where the profile has no measured points (a preset). ``profile`` may also be the
    float32 GEMM points themselves (``[m, n, k, seconds]``: calibrate's own, for
    :func:`calibration_check`); ``dispatch``, a :class:`DispatchProbe` already made.

    :meth:`settled` waits, before a sample, for a host in a slow spell to come back to its
    calibrated speed (the profile describes the machine as calibrated; a neighbour taking a
    fifth of the CPU is not that machine): while the probe reads under ``SETTLE_FLOOR`` it sleeps
    ``SETTLE_POLL_S`` and probes again, sleeping at most ``SETTLE_WAIT_S`` a sample and
    ``SETTLE_BUDGET_S`` a run (the probes' own time, about 0.1 s each with the dispatch probe's,
    comes on top); then the
    sample is taken whatever the probe reads. The probe, not the sample, decides,
    and every rank sees the same reading (the slowest rank's), so they wait together.

    A :class:`DispatchProbe` goes with the GEMMs, for the spells a GEMM misses (Python and
    dispatch slowed, memory not): ``dispatch`` is its latest reading over the lower quartile of
    the run's readings that were not judged slow (:meth:`note_dispatch`; None for the first
    ``DISPATCH_AFTER - 1``; ``dispatch_s`` its latest seconds per call), and :meth:`settled`
    also waits while it reads over ``DISPATCH_CEIL``."""

    def __init__(self, profile: Profile | list, budget_s: float | None = None, dispatch: DispatchProbe | None = None):
        self.budget_s = SETTLE_BUDGET_S if budget_s is None else budget_s
        if isinstance(profile, Profile):
            profile = profile.gemm_for("fp32").fit.get("points") or []
        points = {tuple(p[:3]): p[3] for p in profile}  # [m, n, k, seconds]: a profile's, or calibrate's own
        self.usable = bool(points)
        self._dispatch = (dispatch or DispatchProbe()) if self.usable else None
        self.dispatch, self.dispatch_s, self.readings = None, None, []
        self.slowdowns: dict = {}  # {sample name: [dispatch before each]}: the rows' diagnostic
        self.shapes, self.ref, self.calls = [], [], []
        if self.usable:
            self.shapes = probe_shapes(points)
            self.ref = [points[shape] for shape in self.shapes]
            for m, n, k in self.shapes:
                copies = max(1, COLD_BYTES // (n * k * 4))
                weights, x, turn = [torch.randn(n, k) for _ in range(copies)], torch.randn(m, k), iter(range(1 << 62))
                self.calls.append(lambda w=weights, x=x, t=turn, c=copies: torch.nn.functional.linear(x, w[next(t) % c]))

    def __call__(self) -> float | None:
        if not self.usable:
            return None
        dist.barrier()
        now = torch.tensor([_median_time(call, 1) for call in self.calls], dtype=torch.float64)
        dist.all_reduce(now, op="max")
        ratios = [ref / t for ref, t in zip(self.ref, now.tolist())]
        self.dispatch_s = self._dispatch()
        self.note_dispatch(self.dispatch_s)
        return float(torch.tensor(ratios).log().mean().exp())

    def note_dispatch(self, seconds: float) -> None:
        """Judge the dispatch probe's reading: from the ``DISPATCH_AFTER``-th on, ``dispatch`` is
        it over the lower quartile (:func:`lower_quartile`) of ``readings``
        and it; ``readings`` keeps it unless that is over ``DISPATCH_CEIL`` (the first ones
        always), so that the polls of a long wait do not teach the reference the spell they wait
        out."""
        if len(self.readings) < DISPATCH_AFTER - 1:
            self.readings.append(seconds)
            self.dispatch = None
            return
        self.dispatch = seconds / lower_quartile(self.readings + [seconds])
        if self.dispatch <= DISPATCH_CEIL:
            self.readings.append(seconds)

    def slow(self, speed: float | None) -> bool:
        """Whether the probes (the GEMMs' ``speed``, the dispatch probe's ``dispatch``) find the host in a slow spell."""
        return speed is not None and (speed < SETTLE_FLOOR or (self.dispatch or 0.0) > DISPATCH_CEIL)

    def settled(self) -> tuple[float | None, float]:
        """``(speed, seconds waited)``: the probe's reading once the host is back within
        ``SETTLE_FLOOR`` of its calibrated speed (and the dispatch probe under ``DISPATCH_CEIL``
        of its run's), or once this sample's or this run's wait is spent."""
        speed, waited = self(), 0.0
        while (self.slow(speed) and waited + SETTLE_POLL_S <= SETTLE_WAIT_S
               and self.budget_s >= SETTLE_POLL_S):
            time.sleep(SETTLE_POLL_S)
            waited += SETTLE_POLL_S
            self.budget_s -= SETTLE_POLL_S
            speed = self()
        return speed, waited


def probe_shapes(points) -> list:
    """The probe's two GEMMs among ``points`` (``[m, n, k, ...]`` or ``(m, n, k)`` keys): the
    largest weight at its least and its most ``m`` (bound by memory, bound by arithmetic)."""
    shapes = {tuple(p[:3]) for p in points}
    n, k = max({(n, k) for _, n, k in shapes}, key=lambda nk: (nk[0] * nk[1], nk))
    ms = sorted(m for m, pn, pk in shapes if (pn, pk) == (n, k))
    return [(ms[0], n, k), (ms[-1], n, k)]


def calibration_check(points: list, windows_dispatch_s: list, probe: DispatchProbe, readings: int = CHECK_READINGS,
                      pause_s: float = CHECK_PAUSE_S) -> dict:
    """Whether calibrate's windows met a slow spell, read right after them: ``readings`` probes
    ``pause_s`` apart (:class:`HostSpeed`'s: the two GEMMs against ``points``, calibrate's own
    float32 points, each the slowest rank's; and ``probe``, the :class:`DispatchProbe` that read
    ``windows_dispatch_s`` after each window's rounds of the fixed costs). ``{"gemm_speed",
    "dispatch_speed", "speeds", "dispatch_s", "windows_dispatch_s"}``: the GEMMs' median speed
    against the windows' and the dispatch probe's windows' median seconds over its median now
    (> 1: the host runs faster now than while it was measured). Every rank gets the same figures
    (each reading is the slowest rank's)."""
    host = HostSpeed(points, budget_s=0.0, dispatch=probe)
    speeds, seconds = [], []
    for i in range(readings):
        if i:
            time.sleep(pause_s)
        speeds.append(host())
        seconds.append(host.dispatch_s)
    return {"gemm_speed": statistics.median(speeds),
            "dispatch_speed": statistics.median(windows_dispatch_s) / statistics.median(seconds),
            "speeds": speeds, "dispatch_s": seconds, "windows_dispatch_s": list(windows_dispatch_s)}


def lower_quartile(samples: list) -> float:
    """Linear between the nearest, as ``numpy.quantile``'s default (5 samples: the second least):
    a reference less swayed by one fast reading than the least."""
    return float(statistics.quantiles(samples, n=4, method="inclusive")[0]) if len(samples) > 1 else float(samples[0])


def spell_note(rows: list) -> str | None:
    """What to say of a run that found the host ``PROFILE_SLOW`` or more times as fast as its
    profile (the median of every row's probes): the profile was measured in a slow spell."""
    speeds = [f for r in rows for f in r.get("speeds") or []]
    speed = statistics.median(speeds) if speeds else None
    if speed is None or speed < PROFILE_SLOW:
        return None
    return (f"the host ran {speed:.2f}x as fast as during the calibration (the median "
            f"over its {len(speeds)} samples' probes): the profile was measured in a slow spell, and its estimates run high; "
            f"calibrate again")


def _probed(host: HostSpeed) -> tuple[dict, dict, object]:
    """``(speeds, waited, before)``: ``before(name)`` for :func:`interleaved` waits for a host in a
    slow spell (:meth:`HostSpeed.settled`), then records its speed into ``speeds[name]``, the
    seconds waited into ``waited[name]`` and the dispatch probe's reading into
    ``host.slowdowns[name]``."""
    speeds: dict = {}
    waited: dict = {}

    def before(name):
        speed, w = host.settled()
        speeds.setdefault(name, []).append(speed)
        host.slowdowns.setdefault(name, []).append(host.dispatch)
        waited[name] = waited.get(name, 0.0) + w
    return speeds, waited, before


def slowdowns(host: HostSpeed, *names) -> list:
    """Per round, the larger dispatch probe reading (:attr:`HostSpeed.dispatch`) before the
    samples of ``names``, where read: a row's diagnostic."""
    rows = zip(*(host.slowdowns.get(n) or [] for n in names))
    return [max(r) for r in rows if None not in r]
