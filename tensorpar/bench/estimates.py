"""Estimates suite: every case timed beside the planner's estimate of it, from this machine's profile.

The loop the planner exists for: ``tensorpar calibrate`` measures the machine into a profile
(:mod:`tensorpar.bench.calibrate`), ``tensorpar.planner.plan(..., profile=...)`` estimates each
case from it, and this suite runs the case and puts the two side by side (measured / estimate;
the target is within 20% either way). One launch of 2 ranks over shared memory, one thread per
rank, float32, the ~25M Llama (``BENCH_LLAMA``):

- training steps (``train_step``: loss, backward, clipping at 1.0, AdamW; a global batch of
  ``BATCH x SEQ``): ``tp2``; ``dp2_ddp`` and ``dp2_fsdp`` (each rank half the batch); ``pp2``
  (two stages, 1F1B, ``MICROBATCHES`` microbatches);
- decode per token (``generate``, ``(t(n) - t(1)) / (n - 1)``, prompt ``PROMPT``): tp 2 over shared
  memory through the lean forward at batch 1 and 8, through Hugging Face's forward at batch 1, and
  over gloo at batch 1;
- prefill (``generate`` of one token: the prompt's forward and the first token): tp 2 at batch 1
  and 8, prompt ``PROMPT``.

The training cases run one after another, each training model freed before the next is built,
as in a training job (:func:`_train_samples`); the inference cases in interleaved rounds
(:func:`~tensorpar.bench.timing.interleaved`), in groups before, between and after the training
cases (:class:`_Inference`: a slow spell of the shared host spoils a group or two of a case's
rounds; their two models stay loaded while the training cases run). Each time is taken on the slowest rank, after a
probe of the host's speed (:class:`~tensorpar.bench.host_speed.HostSpeed`; a host in a slow
spell is waited for, within bounds: :meth:`~tensorpar.bench.host_speed.HostSpeed.settled`); the figure is the median over rounds (a decode step's: of each round's
``(t(new) - t(1)) / (new - 1)``). The planner sees the checkpoint's own split
(``MetaSource``), the layout, and the profile with its link set to the case's transport.
"""
from __future__ import annotations

import copy
import gc
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from tensorpar import distributed as dist
from tensorpar.apply import parallelize
from tensorpar.architecture.tiny_sizes import BENCH_LLAMA
from tensorpar.bench import calibrate, train
from tensorpar.bench.host_speed import HostSpeed, _probed, slowdowns
from tensorpar.bench.timing import interleaved, spread
from tensorpar.distributed.dp_engines import init_mesh
from tensorpar.models.checkpoint import load_sharded
from tensorpar.models.generation import generate
from tensorpar.models.tiny import make_tiny_checkpoint
from tensorpar.models.training import train_step
from tensorpar.planner import Layout, plan
from tensorpar.planner import estimate as est
from tensorpar.planner.layout import group_placement
from tensorpar.planner.traffic import decode_items
from tensorpar.planner.profile import Profile, from_dict
from tensorpar.sharding.inventory import MetaSource

BATCH, SEQ, MICROBATCHES, MAX_NORM, LR = 4, 128, 2, 1.0, 3e-4
PROMPT, NEW, DECODE_BATCHES = 32, 17, (1, 8)
TARGET = 0.20  # |measured / estimate - 1| the issue asks for
# `--quick`: the train suite's ~0.6M Llama (2 blocks), 4 x 32 tokens, 5 generated tokens.
QUICK = dict(sizes=train.QUICK["sizes"], batch=4, seq=32, new=5)


# ---- the planner's side --------------------------------------------------------------------------

def on_link(profile: Profile, transport: str) -> Profile:
    """``profile`` with its intra-node collectives over ``transport`` (``shm`` or ``gloo``)."""
    if transport not in profile.links:
        raise ValueError(f"transport {transport!r} not in the profile; it has: {', '.join(profile.links)}")
    return replace(profile, intra_link=transport)


def estimate(path, layout: Layout, profile: Profile, *, seq: int, what: str, transport: str = "shm",
             engine: str = "decode") -> dict:
    """The planner's estimate of one case: ``what`` is ``step``, ``decode`` or ``prefill``."""
    r = plan(MetaSource(path), layout, profile.hardware, seq=seq, profile=on_link(profile, transport))
    e = r.estimates
    if what == "decode" and engine != "decode":
        split = MetaSource(path).at(layout.tp)
        e = {"decode": est.decode_step(split, layout, seq, decode_items(split, layout),
                                       group_placement(layout, profile.hardware.devices_per_node),
                                       on_link(profile, transport), engine=engine)}
    part = e["step"] if what == "step" else e[what]
    return {"estimate_s": part["seconds"], "terms": part["terms"], "dominant": part["dominant"]}


def judged(measured_s: float, est: dict, speeds: list | None = None, samples: list | None = None) -> dict:
    """The case beside its estimate: ``measured_vs_estimate`` from the median sample, which the
    target judges (``within_target``); with the host's speed beside each sample (``speeds``,
    :class:`HostSpeed`), also the median over rounds of each sample at the profile's speed
    against the estimate (a diagnostic: how much of the difference the host's drift explains)."""
    ratio = measured_s / est["estimate_s"]
    out = {**est, "measured_s": measured_s, "measured_vs_estimate": ratio, "within_target": abs(ratio - 1) <= TARGET}
    if speeds:
        out["speeds"], out["host_speed"] = list(speeds), statistics.median(speeds)
        out["at_profile_speed_vs_estimate"] = statistics.median(t * f for t, f in zip(samples, speeds)) / est["estimate_s"]
    return out



# ---- the runs ----------------------------------------------------------------------------------

def _train_cases(dense, ids) -> dict:
    """``{case: (layout, build)}``: ``build()`` makes the case's model and optimizer and returns its
    step (a fresh copy of ``dense`` each)."""
    half = ids[dist.get_rank() * (len(ids) // 2):(dist.get_rank() + 1) * (len(ids) // 2)]
    b, s = ids.shape

    def case(batch, **how):
        def build():
            model = parallelize(copy.deepcopy(dense), **how).train()
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            return lambda: train_step(model, opt, batch, max_norm=MAX_NORM)
        return build
    return {
        "tp2": (Layout(tp=2, micro_batch=b, dtype="fp32"), case(ids)),
        "dp2_ddp": (Layout(dp=2, micro_batch=b // 2, dtype="fp32"),
                    case(half, mesh=init_mesh(2, 1), data_parallel="ddp")),
        "dp2_fsdp": (Layout(dp=2, micro_batch=b // 2, dtype="fp32", zero_stage=3),
                     case(half, mesh=init_mesh(2, 1), data_parallel="fsdp")),
        "pp2": (Layout(pp=2, micro_batch=b // MICROBATCHES, global_batch=b, dtype="fp32", schedule="1F1B"),
                case(ids, mesh=init_mesh(1, 1, pp=2), pipeline="1F1B", microbatches=MICROBATCHES))}


def _train_samples(cases: dict, repeats: int, before, after_each=lambda: None) -> dict:
    """Each training case's samples, one case at a time: its model built, ``repeats`` steps timed
    after two of warm-up, then freed, as a training job runs one model (following other models'
    steps in shared rounds, FSDP's took up to 2.5x its time alone); ``after_each()`` once each
    case is done."""
    out = {}
    for name, (_, build) in cases.items():
        step = build()
        out[name] = interleaved({name: step}, repeats, warmup=2, before=before)[name]
        del step
        gc.collect()
        after_each()
    return out


def estimates_worker(path: str, repeats: int, batch: int, seq: int, new: int, profile_dict: dict | None,
                     calibration: dict | None = None) -> dict:
    """``{"rows", "profile"}``: the cases beside their estimates; without a profile, this launch
    measures one first (:func:`tensorpar.bench.calibrate.calibrate_worker`, ``calibration`` its
    arguments: a smoke run's, which never waits for the host, :meth:`HostSpeed.settled`)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    dist.check_collectives(False)
    if profile_dict is None:
        t0 = time.perf_counter()
        per_rank = calibrate.calibrate_worker(*calibrate._args(calibration or {}))
        profile = calibrate.profile_of(per_rank, ranks=dist.get_world_size(), seconds=time.perf_counter() - t0,
                                       quick=bool(calibration))
    else:
        profile = from_dict(profile_dict)
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    ids = torch.randint(0, dense.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    rows = []
    cases = _train_cases(dense, ids)
    speed = HostSpeed(profile, budget_s=0.0 if calibration else None)
    speeds, waited, before = _probed(speed)
    # the inference rounds in groups before, between and after the training cases: a slow spell
    # of the shared host (seconds to a minute) then spoils one or two groups of a case's rounds,
    # not half of them (it did: the median then lands on the spell's edge)
    inference = _Inference(path, profile, new, dense.config.vocab_size, speed)
    groups = iter(spread(repeats, len(cases) + 1))
    inference.take(next(groups))
    samples = _train_samples(cases, repeats, before, after_each=lambda: inference.take(next(groups)))
    for name, (layout, _) in cases.items():
        guess = estimate(path, layout, profile, seq=seq, what="step")
        rows.append({"kind": "step", "case": name, "layout": _layout_text(layout, seq), "samples_s": samples[name],
                     **judged(statistics.median(samples[name]), guess, _known(speeds, name), samples[name]),
                     "dispatch_slowdowns": slowdowns(speed, name), "host_wait_s": waited.get(name, 0.0)})
    del cases
    return {"rows": rows + inference.rows(), "profile": profile.to_dict()}


def _known(speeds: dict, *names) -> list | None:
    """Per round, the mean host speed before the samples of ``names`` (None: not measured, a
    profile without measured GEMMs)."""
    rows = list(zip(*(speeds.get(n) or [] for n in names)))
    if not rows or any(f is None for r in rows for f in r):
        return None
    return [sum(r) / len(r) for r in rows]


class _Inference:
    """The inference cases of one launch: their models loaded once, :meth:`take` times rounds of
    every case (interleaved) and may be called more than once, :meth:`rows` judges them all."""

    # (case, model, engine of generate, batch, what, transport, engine of the estimate)
    CASES = [("decode_b1", "shm", "auto", 1, "decode", "shm", "decode"),
             ("decode_b8", "shm", "auto", 8, "decode", "shm", "decode"),
             ("decode_hf_b1", "shm", "hf", 1, "decode", "shm", "decode_hf"),
             ("decode_gloo_b1", "gloo", "auto", 1, "decode", "gloo", "decode"),
             ("prefill_b1", "shm", "auto", 1, "prefill", "shm", "decode"),
             ("prefill_b8", "shm", "auto", 8, "prefill", "shm", "decode")]

    def __init__(self, path, profile: Profile, new: int, vocab: int, speed: HostSpeed):
        self.path, self.profile, self.new = path, profile, new
        shm = dist.new_group([0, 1], backend="shm")
        models = {"shm": load_sharded(path, tp_group=shm, dtype=torch.float32)[0].eval(),
                  "gloo": load_sharded(path, tp_group=dist.new_group([0, 1], backend="gloo"),
                                       dtype=torch.float32)[0].eval()}
        prompts = {b: torch.randint(0, vocab, (b, PROMPT), generator=torch.Generator().manual_seed(b))
                   for b in DECODE_BATCHES}
        self.runs = {}
        for name, model, engine, b, what, _, _ in self.CASES:
            ids = prompts[b]
            self.runs[f"{name}/1"] = lambda m=models[model], e=engine, x=ids: generate(m, x, 1, engine=e)
            if what == "decode":
                self.runs[f"{name}/n"] = lambda m=models[model], e=engine, x=ids: generate(m, x, new, engine=e)
        self.speed = speed
        self.speeds, self.waited, self._before = _probed(speed)
        self.timed = {k: [] for k in self.runs}

    def take(self, repeats: int) -> None:
        """``repeats`` more rounds (after one of warm-up: the caches other work left), the order's
        rotation continuing from the rounds before; none: nothing runs."""
        if repeats <= 0:
            return
        done = len(next(iter(self.timed.values())))
        with torch.no_grad():
            for k, v in interleaved(self.runs, repeats, warmup=1, before=self._before, start=done).items():
                self.timed[k] += v

    def rows(self) -> list:
        rows = []
        for name, _, engine, b, what, transport, est_engine in self.CASES:
            one = self.timed[f"{name}/1"]  # per round: a prefill's time, or a decode step's (t(new) - t(1)) / (new - 1)
            samples = one if what == "prefill" else [(n - o) / (self.new - 1) for o, n in zip(one, self.timed[f"{name}/n"])]
            layout = Layout(tp=2, micro_batch=b, dtype="fp32", workload="inference")
            context = PROMPT + self.new // 2 if what == "decode" else PROMPT
            guess = estimate(self.path, layout, self.profile, seq=context, what=what, transport=transport,
                             engine=est_engine)
            known = _known(self.speeds, f"{name}/1", f"{name}/n") if what == "decode" else _known(self.speeds, f"{name}/1")
            rows.append({"kind": what, "case": name, "layout": f"tp2 over {transport}, batch {b}, "
                         f"{'context ' + str(context) if what == 'decode' else 'prompt ' + str(PROMPT)}, "
                         f"{'lean' if engine == 'auto' else 'HF'} forward",
                         "samples_s": samples, **judged(statistics.median(samples), guess, known, samples),
                         "dispatch_slowdowns": slowdowns(self.speed, *(f"{name}/{k}" for k in ("1", "n")
                                                                       if f"{name}/{k}" in self.runs)),
                         "host_wait_s": sum(self.waited.get(f"{name}/{k}", 0.0) for k in ("1", "n"))})
        return rows


def _layout_text(layout: Layout, seq: int) -> str:
    parts = [f"{k}{getattr(layout, k)}" for k in ("tp", "pp", "dp") if getattr(layout, k) > 1] or ["unsplit"]
    extra = " (FSDP)" if layout.zero_stage == 3 else " (DDP)" if layout.dp > 1 else ""
    return " x ".join(parts) + extra + f", global batch {layout.global_batch} x {seq}"


def run_estimates_bench(profile: Profile | None, repeats: int = 5, sizes=None, batch: int = BATCH, seq: int = SEQ,
                        new: int = NEW, calibration: dict | None = None) -> tuple[list, Profile]:
    """Rank 0's rows, one per case (see the module docstring), and the profile they were estimated
    from (measured in the same launch when ``profile`` is None)."""
    with tempfile.TemporaryDirectory(prefix="tensorpar-bench-estimates-") as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "llama", "llama", dtype=torch.float32, **(sizes or BENCH_LLAMA))
        out = dist.launch(estimates_worker, 2, str(path), repeats, batch, seq, new,
                          None if profile is None else profile.to_dict(), calibration, backend="auto", timeout=600)[0]
    return out["rows"], from_dict(out["profile"])


def estimates_table(rows: list[dict]) -> str:
    head = ("| case | layout | measured | estimate | measured / estimate | within 20% | host speed vs profile | "
            "at the profile's speed / estimate | dominant term |\n"
            "|---|---|---:|---:|---:|---|---:|---:|---|\n")
    return head + "\n".join(
        f"| {r['case']} | {r['layout']} | {_ms(r['measured_s'])} | {_ms(r['estimate_s'])} | "
        f"{r['measured_vs_estimate']:.2f} | {'yes' if r['within_target'] else '**no**'} | "
        f"{_num(r.get('host_speed'))} | {_num(r.get('at_profile_speed_vs_estimate'))} | "
        f"{r['dominant']} |" for r in rows) + "\n"


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


# ---- the measured point of `plan --search-tp` ------------------------------------------------------

def measure_decode(path, tps: list, batch: int, context: int, new: int = NEW, repeats: int = 3) -> dict:
    """``{tp: seconds per decode token}`` on this machine at each tp of ``tps`` (one launch of
    ``max(tps)`` ranks, one thread each; tp 1: the unsplit model through the lean forward), a
    ``batch`` of prompts long enough that the mean context over ``new`` tokens is ``context``."""
    prompt = context - new // 2
    if prompt < 1:
        raise ValueError(f"context ({context}) must exceed {new // 2} (half the {new} tokens generated)")
    return dist.launch(_measure_worker, max(tps), str(path), sorted(tps), batch, prompt, new, repeats,
                       backend="auto", timeout=600)[0]


def _measure_worker(path: str, tps: list, batch: int, prompt: int, new: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.check_collectives(False)
    out = {}
    for tp in tps:
        members = list(range(tp))
        group = dist.new_group(members, backend="shm") if tp > 1 else None
        if dist.get_rank() in members:
            model = (load_sharded(path, tp_group=group, dtype=torch.float32)[0] if tp > 1 else
                     AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)).eval()
            vocab = model.config.vocab_size
            ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(batch))
            per_token = []
            with torch.no_grad():
                generate(model, ids, 2)
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    generate(model, ids, 1)
                    one = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    generate(model, ids, new)
                    per_token.append((time.perf_counter() - t0 - one) / (new - 1))
            out[tp] = statistics.median(per_token)
        dist.barrier()
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.2f} ms"
