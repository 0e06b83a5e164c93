"""Hardware profiles: the achieved rates the time estimates use (:mod:`.estimate`).

A :class:`~.hardware.Hardware` holds vendor peaks, right for lower bounds. A :class:`Profile` holds
what a device achieves, which is what an estimate needs:

- ``gemm[dtype]``: a matrix multiply of ``(m, k) @ (k, n)`` takes
  ``fixed_s + 2 m n k / rate_flops + e (m k + k n + m n) / bytes_per_s`` (e bytes per element):
  a call's fixed cost, its arithmetic at the achieved rate, its operands and result through
  memory. Small GEMMs are far from peak because the fixed cost and the bytes dominate them;
- ``memory_bytes_per_s``: achieved bandwidth of elementwise work (bytes read plus written);
- ``block_call_s[phase]``: the fixed cost of running one transformer block (a layer call:
  dispatch, Python, kernel launches) at vanishing size, by phase: ``forward`` (a plain forward),
  ``prefill`` (a prompt through ``generate``), ``train`` (a training step), ``decode`` (one
  token through tensorpar's lean forward), ``decode_hf`` (one token through Hugging Face's
  forward); ``phase@tp1`` the unsplit model's, ``train@ddp`` / ``train@fsdp`` a data-parallel
  one's, ``phase@b8`` (``phase@tp1@b8``) an inference phase's at batch 8 (linear in the batch
  between), where measured;
- ``links[name][op][p]``: a collective of ``n`` payload bytes in a group of ``p`` ranks takes
  ``alpha_s + n * beta_s_per_byte``; ``intra_link`` and ``inter_link`` name the links a group
  inside one node and across nodes use;
- ``synchronous``: whether the host waits for each operation (CPU: fixed costs add to the work)
  or queues them (GPU: a block costs the larger of its launches and its work).

``tensorpar calibrate`` measures a profile of the machine it runs on (the JSON documented in
docs/planner.md); :func:`published` builds one for a preset from public figures only (stated in
:data:`PUBLISHED`), so that the estimate of a published run is not fitted to that run.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .hardware import Hardware, get_hardware

FORMAT = "tensorpar-hardware-profile/1"
PHASES = ("forward", "prefill", "train", "decode", "decode_hf")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send")


@dataclass(frozen=True)
class Gemm:
    """Achieved matrix-multiply figures of one dtype (see the module docstring). ``fit`` holds the
    fit's median and largest relative error and, measured, its ``points`` ``[m, n, k, seconds]``:
    the time of a shape is the formula's, scaled by the measured-over-formula ratio of the nearest
    measured shapes (interpolated in log m between the two measured m around it, at each the
    nearest ``(n, k)`` by distance in ``log n`` and ``log k``), so that a regime the three figures
    miss (small m on a CPU, a narrow or a long weight) is as measured."""
    rate_flops: float
    bytes_per_s: float
    fixed_s: float
    fit: dict = field(default_factory=dict)

    def formula(self, m: float, n: float, k: float, bytes_per_elem: int) -> float:
        return self.fixed_s + 2.0 * m * n * k / self.rate_flops + bytes_per_elem * (m * k + k * n + m * n) / self.bytes_per_s

    def seconds(self, m: float, n: float, k: float, bytes_per_elem: int, *, calls: float = 1.0) -> float:
        """Seconds of ``calls`` multiplies of ``(m, k) @ (k, n)``."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        return calls * self.formula(m, n, k, bytes_per_elem) * self._ratio(m, n, k, bytes_per_elem)

    def _ratio(self, m: float, n: float, k: float, e: int) -> float:
        points = self.fit.get("points") or []
        if not points:
            return 1.0
        ratios = {}
        for pm, pn, pk, t in points:  # per measured m: the ratio at the (n, k) nearest the query's
            r = t / self.formula(pm, pn, pk, self.fit.get("bytes_per_elem", e))
            d = math.hypot(math.log(pn / n), math.log(pk / k))  # a shape's efficiency is its n's and its k's
            if pm not in ratios or d < ratios[pm][0]:
                ratios[pm] = (d, r)
        ms = sorted(ratios)
        if m <= ms[0]:
            return ratios[ms[0]][1]
        if m >= ms[-1]:
            return ratios[ms[-1]][1]
        lo = max(x for x in ms if x <= m)
        hi = min(x for x in ms if x >= m)
        if lo == hi:
            return ratios[lo][1]
        w = math.log(m / lo) / math.log(hi / lo)
        return (1 - w) * ratios[lo][1] + w * ratios[hi][1]


@dataclass(frozen=True)
class Link:
    """``{op: {p: {"alpha_s", "beta_s_per_byte", "fit"}}}`` of one transport."""
    name: str
    ops: dict

    def seconds(self, op: str, payload_bytes: float, p: int) -> float:
        """One ``op`` of ``payload_bytes`` in a group of ``p``: ``alpha + n beta``. A group size
        not measured takes the nearest measured one's alpha and scales beta by the ring's bytes
        per rank (``(p - 1) / p``, doubled for all-reduce, is what changes with p)."""
        if p <= 1 or payload_bytes <= 0:
            return 0.0
        table = self.ops.get(op) or self.ops.get("all_gather" if op != "all_reduce" else "all_reduce")
        if not table:
            raise ValueError(f"link {self.name!r} has no figures for {op!r}; it has: {', '.join(self.ops)}")
        sizes = sorted(int(q) for q in table)
        near = min(sizes, key=lambda q: (abs(q - p), q))
        fit = table[str(near)] if str(near) in table else table[near]
        beta = fit["beta_s_per_byte"] * (_ring(op, p) / _ring(op, near) if near > 1 else 1.0)
        return fit["alpha_s"] + payload_bytes * beta


def _key(table: dict, phase: str, tp: int, dp_engine: str | None) -> str:
    """The most specific measured key: ``phase@fsdp`` / ``phase@ddp`` for a data-parallel model
    without tp, ``phase@tp1`` for an unsplit one, else ``phase``."""
    for key in ((f"{phase}@{dp_engine}" if dp_engine and tp == 1 else None), (f"{phase}@tp1" if tp == 1 else None)):
        if key in table:
            return key
    return phase


def _at_batch(table: dict, key: str, batch: int) -> float:
    """``table[key]`` at ``batch``: linear from batch 1 through the ``key@b8`` figure (not below the
    batch-1 figure: a larger batch never calls less)."""
    one = table.get(key, 0.0)
    eight = table.get(f"{key}@b8")
    if eight is None or batch == 1:
        return one
    return max(one, one + (eight - one) * (batch - 1) / 7)


def _ring(op: str, p: int) -> float:
    """Ring bytes each rank moves per payload byte (NVIDIA/nccl-tests doc/PERFORMANCE.md)."""
    if op == "all_reduce":
        return 2.0 * (p - 1) / p
    if op in ("send", "broadcast"):
        return 1.0
    return (p - 1) / p


@dataclass(frozen=True)
class Profile:
    """What one device achieves, and the links between devices (see the module docstring)."""
    name: str
    device: str
    hardware: Hardware
    gemm: dict
    memory_bytes_per_s: float
    block_call_s: dict
    links: dict
    intra_link: str
    inter_link: str
    synchronous: bool
    source: str = ""
    step_call_s: dict = field(default_factory=dict)  # fixed cost per step by phase (embedding, head, loop)
    measured: dict = field(default_factory=dict)  # calibrate's context: ranks, threads, torch, time
    # the wait at a collective for the slower rank: {link: {ranks: {"points": [[segment_s, wait_s]], "measured"}}}
    collective_wait: dict = field(default_factory=dict)
    # one optimizer step (clipping, AdamW foreach) per float32 parameter, as tensorpar's runtime runs it; None: not measured
    optimizer_s_per_param: float | None = None

    def __post_init__(self):
        for dtype, g in self.gemm.items():
            if not (g.rate_flops > 0 and g.bytes_per_s > 0 and g.fixed_s >= 0):
                raise ValueError(f"profile {self.name!r}: gemm[{dtype!r}] needs positive rate and bandwidth, "
                                 f"a fixed cost >= 0; got {g}")
        if not self.memory_bytes_per_s > 0:
            raise ValueError(f"profile {self.name!r}: memory_bytes_per_s ({self.memory_bytes_per_s!r}) must be > 0")
        missing = [p for p in PHASES if p not in self.block_call_s]
        if missing:
            raise ValueError(f"profile {self.name!r}: block_call_s lacks {', '.join(missing)}; needs {', '.join(PHASES)}")
        if not _valid_waits(self.collective_wait):
            raise ValueError(f"profile {self.name!r}: collective_wait must be {{link: {{ranks: {{'points': "
                             f"[[segment_s > 0, wait_s >= 0], ...] by segment}}}}}}; got {self.collective_wait!r}")
        if self.optimizer_s_per_param is not None and not self.optimizer_s_per_param > 0:
            raise ValueError(f"profile {self.name!r}: optimizer_s_per_param ({self.optimizer_s_per_param!r}) must be "
                             f"> 0 or None (not measured)")
        for which in (self.intra_link, self.inter_link):
            if which not in self.links:
                raise ValueError(f"profile {self.name!r}: link {which!r} not among {', '.join(self.links) or 'none'}")

    def gemm_for(self, dtype: str) -> Gemm:
        """The figures of ``dtype`` (fp16 and bf16 stand for each other; a dtype not measured
        takes the nearest one by width and says so nowhere else: the docs list it)."""
        if dtype in self.gemm:
            return self.gemm[dtype]
        twin = {"bf16": "fp16", "fp16": "bf16", "fp64": "fp32", "fp32": "fp64"}.get(dtype)
        if twin in self.gemm:
            return self.gemm[twin]
        raise ValueError(f"profile {self.name!r} has no GEMM figures for {dtype!r}; it has: {', '.join(self.gemm)}")

    def block_s(self, phase: str, tp: int, dp_engine: str | None = None, batch: int = 1) -> float:
        """Fixed cost of one block call in ``phase``: measured under the data-parallel engine
        (``phase@ddp``, ``phase@fsdp``) or unsplit (``phase@tp1``) where the profile has it; at
        ``batch`` sequences, linear between batch 1 and the ``@b8`` figure where measured."""
        return _at_batch(self.block_call_s, _key(self.block_call_s, phase, tp, dp_engine), batch)

    def step_s(self, phase: str, tp: int, dp_engine: str | None = None, batch: int = 1) -> float:
        """Fixed cost of one step in ``phase`` besides its blocks (embedding, head, loss, loop)."""
        return _at_batch(self.step_call_s, _key(self.step_call_s, phase, tp, dp_engine), batch)

    def wait_s(self, segment_s: float, link: str | None = None, ranks: int = 2) -> float:
        """Seconds a collective of ``ranks`` over ``link`` (default: the intra-node one) waits for
        the slower rank after ``segment_s`` of work on each (``collective_wait``, measured by
        calibrate at each group size up to its ``--ranks``; a larger group takes the largest
        measured, an underestimate): linear between the measured segments, proportional below
        the shortest, the longest's above it (past ~10 ms of work the ranks' noise averages
        out); 0 where not measured."""
        by_size = self.collective_wait.get(link or self.intra_link) or {}
        sizes = sorted(int(p) for p in by_size)
        if not sizes or segment_s <= 0:
            return 0.0
        size = max([p for p in sizes if p <= ranks] or sizes[:1])
        pts = by_size[str(size)]["points"]
        (s0, w0), (s1, w1) = pts[0], pts[-1]
        if segment_s <= s0:
            return w0 * segment_s / s0
        if segment_s >= s1:
            return w1
        for (a, wa), (b, wb) in zip(pts, pts[1:]):
            if a <= segment_s <= b:
                return wa + (wb - wa) * (segment_s - a) / (b - a) if b > a else wb
        return w1

    def warnings(self) -> list[str]:
        """A host profile from an older ``tensorpar calibrate`` lacks figures the estimates now use."""
        if self.source != "tensorpar calibrate" or not self.synchronous:
            return []
        missing = [name for name, value in (("collective_wait", self.collective_wait),
                                            ("optimizer_s_per_param", self.optimizer_s_per_param)) if not value]
        return [f"the profile {self.name!r} lacks {', '.join(missing)} (written by an older tensorpar calibrate): "
                f"its estimates leave out the wait at tp collectives for the slower rank and price the optimizer "
                f"by bytes; run tensorpar calibrate again"] if missing else []

    def link(self, local: bool) -> Link:
        return self.links[self.intra_link if local else self.inter_link]

    def to_dict(self) -> dict:
        return {"format": FORMAT, "name": self.name, "device": self.device, "source": self.source,
                "synchronous": self.synchronous, "hardware": self.hardware.to_dict(),
                "gemm": {k: asdict(g) for k, g in self.gemm.items()},
                "memory_bytes_per_s": self.memory_bytes_per_s, "block_call_s": dict(self.block_call_s),
                "step_call_s": dict(self.step_call_s),
                "links": {k: link.ops for k, link in self.links.items()},
                "intra_link": self.intra_link, "inter_link": self.inter_link, "measured": dict(self.measured),
                "collective_wait": dict(self.collective_wait), "optimizer_s_per_param": self.optimizer_s_per_param}

    def save(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")
        return path


def _valid_waits(waits) -> bool:
    """``{link: {ranks: {"points": [[segment_s > 0, wait_s >= 0], ...]}}}``, segments ascending."""
    def points_ok(pts):
        return bool(pts) and all(isinstance(p, (list, tuple)) and len(p) == 2 and p[0] > 0 and p[1] >= 0
                                 for p in pts) and all(a[0] < b[0] for a, b in zip(pts, pts[1:]))
    return isinstance(waits, dict) and all(
        isinstance(by_size, dict) and all(str(p).isdigit() and isinstance(w, dict) and points_ok(w.get("points"))
                                          for p, w in by_size.items()) for by_size in waits.values())


def from_dict(d: dict) -> Profile:
    """A profile from its JSON (``Profile.to_dict``); a wrong or missing field is a ValueError."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"not a tensorpar hardware profile: 'format' must be {FORMAT!r}, "
                         f"got {d.get('format') if isinstance(d, dict) else type(d).__name__!r}")
    try:
        hw = d["hardware"]
        hardware = Hardware(
            name=hw["name"], peak_dense_bf16_flops=hw["peak_dense_bf16_flops"],
            peak_dense_tf32_flops=hw.get("peak_dense_tf32_flops"), hbm_bytes_per_s=hw["hbm_bytes_per_s"],
            mem_bytes=hw["mem_bytes"], links=dict(hw["links_bidirectional_bytes_per_s"]),
            intra_node_link=hw["intra_node_link"], inter_node_bytes_per_s=hw["inter_node_bytes_per_s_per_device"],
            devices_per_node=hw["devices_per_node"])
        return Profile(
            name=d["name"], device=d["device"], hardware=hardware, source=d.get("source", ""),
            gemm={k: Gemm(**g) for k, g in d["gemm"].items()}, memory_bytes_per_s=float(d["memory_bytes_per_s"]),
            block_call_s={k: float(v) for k, v in d["block_call_s"].items()},
            step_call_s={k: float(v) for k, v in d.get("step_call_s", {}).items()},
            links={k: Link(k, ops) for k, ops in d["links"].items()}, intra_link=d["intra_link"],
            inter_link=d["inter_link"], synchronous=bool(d["synchronous"]), measured=dict(d.get("measured", {})),
            collective_wait=dict(d.get("collective_wait") or {}),
            optimizer_s_per_param=None if d.get("optimizer_s_per_param") is None else float(d["optimizer_s_per_param"]))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"hardware profile: missing or malformed field {exc}") from exc


def load(path) -> Profile:
    """The profile in the JSON file ``path`` (written by ``tensorpar calibrate``)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"hardware profile {str(path)!r}: {exc}") from exc
    return from_dict(data)


# ---- published profiles -----------------------------------------------------------------------
#
# Public figures only, none taken from the runs the estimates are checked against:
# - GEMM: cuBLAS reaches about 80% of the dense tensor-core peak on large half-precision GEMMs
#   (NVIDIA "Matrix Multiplication Background User's Guide", docs.nvidia.com/deeplearning/
#   performance, Fig. 2-3: A100 ~250 of 312 TFLOP/s at large sizes); operands stream at the
#   memory rate below; a kernel launch costs about 5 us (NVIDIA blog "Getting Started with CUDA
#   Graphs", 2019, launch overhead of a few microseconds).
# - memory: STREAM/BabelStream-class kernels reach about 85% of HBM peak (BabelStream results on
#   V100, A100, H100: 0.8-0.9).
# - links: nccl-tests bus bandwidth reaches 0.77 (A100: 230 of 300 GB/s) to 0.82 (H100: 370 of
#   450) of NVLink's per-direction line rate (maintainer comments, nccl-tests #149 and #212; the
#   reference case nccl_effective_nvlink_bw): 0.8 of the line rate for every link, NVLink and
#   InfiniBand alike; a collective's latency about 10 us inside a node and 20 us across nodes
#   (nccl-tests small-message all_reduce times on DGX systems).
# - a transformer block on a GPU launches about 40 kernels in forward (the elementwise model of
#   :mod:`.estimate` counts them), each at the launch cost above.

PUBLISHED = {"gemm_of_peak": 0.80, "memory_of_peak": 0.85, "link_of_line_rate": 0.80,
             "launch_s": 5e-6, "alpha_intra_s": 10e-6, "alpha_inter_s": 20e-6, "kernels_per_block": 40}


def _link_table(alpha: float, bytes_per_s: float, sizes=(2, 4, 8, 16, 64, 256, 1024)) -> dict:
    """Ring collectives over a link of ``bytes_per_s`` per direction: each rank moves
    ``_ring(op, p)`` bytes per payload byte."""
    return {op: {str(p): {"alpha_s": alpha, "beta_s_per_byte": _ring(op, p) / bytes_per_s, "fit": {}}
                 for p in sizes} for op in OPS}


def published(hardware: Hardware | str) -> Profile:
    """A profile of ``hardware`` (a preset or its name) from public figures (:data:`PUBLISHED`)."""
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    f = PUBLISHED
    mem = f["memory_of_peak"] * hw.hbm_bytes_per_s
    half = Gemm(rate_flops=f["gemm_of_peak"] * hw.peak_dense_bf16_flops, bytes_per_s=mem, fixed_s=f["launch_s"])
    # fp32 at the TF32 peak where the device has one, else at its fastest (Hardware.peak_flops)
    single = Gemm(rate_flops=f["gemm_of_peak"] * hw.peak_flops("fp32"), bytes_per_s=mem, fixed_s=f["launch_s"])
    gemm = {"bf16": half, "fp16": half, "fp32": single}
    block = f["kernels_per_block"] * f["launch_s"]
    eff = f["link_of_line_rate"]
    links = {"intra": Link("intra", _link_table(f["alpha_intra_s"], eff * hw.intra_node_bytes_per_s)),
             "inter": Link("inter", _link_table(f["alpha_inter_s"], eff * hw.inter_node_bytes_per_s))}
    return Profile(name=f"{hw.name} (published figures)", device="cuda" if hw.name.startswith(("a1", "h1", "h2", "v1"))
                   else "accelerator", hardware=hw, gemm=gemm, memory_bytes_per_s=mem,
                   block_call_s={"forward": block, "prefill": block, "train": 3 * block, "decode": block,
                                 "decode_hf": block},
                   links=links, intra_link="intra", inter_link="inter", synchronous=False,
                   source="public figures: tensorpar.planner.profile.PUBLISHED")


def with_latency(profile: Profile, latency_s: float) -> Profile:
    """``profile`` with every collective's latency (alpha) set to ``latency_s``."""
    if isinstance(latency_s, bool) or not isinstance(latency_s, (int, float)) or not 0 <= latency_s < float("inf"):
        raise ValueError(f"latency_s ({latency_s!r}) must be a finite number of seconds >= 0")
    links = {name: Link(name, {op: {p: {**fit, "alpha_s": float(latency_s)} for p, fit in table.items()}
                               for op, table in link.ops.items()}) for name, link in profile.links.items()}
    return replace(profile, links=links)


def hardware_or_profile(text: str) -> tuple[Hardware, Profile]:
    """``--hardware``'s value: a preset's name, or a profile file written by ``tensorpar calibrate``."""
    path = Path(text)
    if text.endswith(".json") or path.is_file():
        prof = load(path)
        return prof.hardware, prof
    hw = get_hardware(text)
    return hw, published(hw)
