"""Serve suite: `tensorpar serve` at tp 2 under an open-loop load, against Hugging Face's
continuous batching and against sequential ``generate``, on the same model in one run.

The load: requests of mixed prompt and output lengths arriving at Poisson times (open loop: a
request arrives when its time comes, whatever the server is doing), at a rate that offers
``streams`` concurrent requests (``streams`` / the mean time of one request alone, measured
first). For each load, each server:

- ``tensorpar``: ``tensorpar serve`` at tp 2 (its own process; ranks over shared memory, one
  thread each), the requests streamed over HTTP (``/v1/completions``, token ids), timed at the
  client;
- ``hf_cb``: transformers' continuous batching (``init_continuous_batching``: its scheduler and
  paged cache) on the unsplit model in this process, 2 threads (the machine's cores), the requests
  added at their times, each token timed as its output arrives (no HTTP: that favours it);
- ``generate``: tensorpar's ``generate`` at tp 2, the lightest load's requests one after the other
  (batch 1): the baseline of "32 streams at least 4x sequential generate".

Rounds: both servers start once; each round runs every server on every load (``generate`` on
its sequence of requests), the servers' order rotating from round to round, so each meets the
same drift of a shared machine. Every figure is the median over rounds; every ratio is the median
over rounds of the two throughputs measured in the same round.

Figures: tokens/s (generated tokens over the time from the first arrival to the last token),
time to first token (arrival to first token) and per-token latency (gaps between a request's
tokens), p50 and p99. Greedy everywhere, the model's end-of-sequence token ignored by neither
(a random model rarely draws it): the token counts are reported beside the rates.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from tensorpar import distributed as dist
from tensorpar.architecture.tiny_sizes import BENCH_LLAMA
from tensorpar.bench.timing import round_order
from tensorpar.models.checkpoint import load_sharded
from tensorpar.models.generation import generate
from tensorpar.models.tiny import make_tiny_checkpoint

LEVELS = (1, 8, 32, 64)
PROMPTS, OUTPUTS = (8, 96), (16, 64)  # token ranges, uniform
QUICK = dict(sizes=dict(BENCH_LLAMA, hidden_size=128, intermediate_size=256, num_hidden_layers=2),
             levels=(1, 8), requests_per_stream=2, prompts=(4, 16), outputs=(4, 8))


@dataclass(frozen=True)
class Request:
    at: float  # seconds after the run's start
    prompt: tuple
    max_tokens: int


def workload(count: int, rate: float, seed: int, vocab: int, prompts=PROMPTS, outputs=OUTPUTS) -> list:
    """``count`` requests, Poisson arrivals at ``rate`` a second, lengths uniform in the ranges."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        out.append(Request(t, tuple(rng.randrange(3, vocab) for _ in range(rng.randint(*prompts))),
                           rng.randint(*outputs)))
        t += rng.expovariate(rate)
    return out


def figures(arrivals: list, stamps: list) -> dict:
    """``stamps``: per request, the times of its tokens (same clock as ``arrivals``)."""
    ttft = [s[0] - a for a, s in zip(arrivals, stamps) if s]
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:])]
    tokens = sum(len(s) for s in stamps)
    span = max(s[-1] for s in stamps if s) - min(arrivals)
    return {"requests": len(stamps), "tokens": tokens, "tokens_per_s": tokens / span,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_s": _pct(gaps, 50), "tpot_p99_s": _pct(gaps, 99)}


def _pct(xs: list, p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


# ---- the clients --------------------------------------------------------------------------------

async def _one_http(client, url: str, req: Request, t0: float) -> list:
    await asyncio.sleep(max(0.0, t0 + req.at - time.perf_counter()))
    stamps = []
    body = {"prompt": list(req.prompt), "max_tokens": req.max_tokens, "temperature": 0, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                stamps += [now] * len(json.loads(line[6:])["choices"][0].get("token_ids", []))
    return stamps


async def _drive_http(url: str, reqs: list) -> tuple:
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx2.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        stamps = await asyncio.gather(*(_one_http(client, url, r, t0) for r in reqs))
    return [t0 + r.at for r in reqs], stamps


def drive_hf(manager, reqs: list) -> tuple:
    """Requests added to a running HF continuous-batching manager at their times; each output's
    new tokens stamped as it arrives."""
    stamps = {f"r{i}": [] for i in range(len(reqs))}
    t0 = time.perf_counter()

    def feed():
        for i, r in enumerate(reqs):
            time.sleep(max(0.0, t0 + r.at - time.perf_counter()))
            manager.add_request(list(r.prompt), request_id=f"r{i}", max_new_tokens=r.max_tokens, streaming=True)
    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    done = 0
    while done < len(reqs):
        out = manager.get_result(timeout=600)
        if out is None:
            raise RuntimeError("transformers' continuous batching stopped without finishing the requests")
        now, got = time.perf_counter(), stamps[out.request_id]
        got += [now] * (len(out.generated_tokens) - len(got))
        done += out.is_finished()
    feeder.join()
    return [t0 + r.at for r in reqs], [stamps[f"r{i}"] for i in range(len(reqs))]


def generate_rank(path: str, reqs: list) -> list:
    """Each request alone through ``generate`` on the split model: per request, its token times."""
    model, _ = load_sharded(path, dtype=torch.float32)
    generate(model, [list(reqs[0].prompt)], 2)  # warm-up
    out = []
    for r in reqs:
        dist.barrier()
        t0 = time.perf_counter()
        n = generate(model, [list(r.prompt)], r.max_tokens).shape[1] - len(r.prompt)
        t1 = time.perf_counter()
        out.append((t0, t1, n))
    return out


# ---- the run ------------------------------------------------------------------------------------

SERVERS = ("generate", "tensorpar", "hf_cb")
FIGURES = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")


def run_serve_bench(*, rounds: int = 11, sizes=BENCH_LLAMA, levels=LEVELS, requests_per_stream: int = 2,
                    prompts=PROMPTS, outputs=OUTPUTS, seed: int = 0) -> list[dict]:
    """One row per (server, load): the medians over ``rounds`` interleaved rounds, each round
    running every server on every load (the order of the servers rotates each round); the
    ratios are the medians over rounds of the two servers' throughputs in the same round."""
    if rounds < 1:
        raise ValueError(f"rounds {rounds}: need at least 1")
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="tensorpar-bench-serve-") as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "llama", "llama", seed=seed, **sizes)
        vocab = sizes["vocab_size"]
        alone = workload(8, 1.0, seed + 1, vocab, prompts, outputs)
        # the arrival rates: a request alone through generate, measured once (the same loads every round)
        one_s = statistics.mean(t1 - t0 for t0, t1, _ in dist.launch(generate_rank, 2, str(path), alone)[0])
        loads = {c: workload(max(8, requests_per_stream * c), c / one_s, seed + 2 + c, vocab, prompts, outputs)
                 for c in levels}
        samples = {(name, c): [] for name in SERVERS for c in ((1,) if name == "generate" else levels)}
        warm = loads[min(levels)][:2]
        with _tensorpar_server(path, max(levels), warm) as url, \
                _hf_manager(path, max(levels), max(prompts) + max(outputs), warm) as manager:
            one = loads[min(levels)]  # generate runs the lightest load's requests, one after the other
            run = {"generate": lambda: {1: generate_figures(dist.launch(generate_rank, 2, str(path), one)[0])},
                   "tensorpar": lambda: {c: figures(*asyncio.run(_drive_http(url, reqs))) for c, reqs in loads.items()},
                   "hf_cb": lambda: {c: figures(*drive_hf(manager, reqs)) for c, reqs in loads.items()}}
            for i in range(rounds):
                for name in round_order(list(SERVERS), i):
                    for c, got in run[name]().items():
                        samples[(name, c)].append(got)
    return summarize(samples, one_s)


def generate_figures(seq: list) -> dict:
    """``generate_rank``'s (start, end, tokens) per request, as a row's figures: the requests one
    after the other, so the throughput is the tokens over the time spent generating them."""
    return {"requests": len(seq), "tokens": sum(n for *_, n in seq),
            "tokens_per_s": sum(n for *_, n in seq) / sum(t1 - t0 for t0, t1, _ in seq),
            "ttft_p50_s": float("nan"), "ttft_p99_s": float("nan"),
            "tpot_p50_s": statistics.median((t1 - t0) / n for t0, t1, n in seq), "tpot_p99_s": float("nan")}


def summarize(samples: dict, one_s: float) -> list[dict]:
    """``samples[(server, streams)]``: that row's figures, one per round, rounds in order. Each
    figure is the median over rounds; ``vs_sequential_generate`` and ``vs_hf_cb`` are the
    medians over rounds of the throughput ratio within a round."""
    def paired(figs, other):
        return statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(figs, other))
    base = samples[("generate", 1)]
    rows = []
    for (name, c), figs in samples.items():
        row = {"server": name, "streams": c, "rounds": len(figs), "requests": figs[0]["requests"],
               "tokens": statistics.median(f["tokens"] for f in figs),
               **{k: _median(f[k] for f in figs) for k in FIGURES},
               "vs_sequential_generate": paired(figs, base), "mean_request_alone_s": one_s, "samples": figs}
        if name == "tensorpar" and ("hf_cb", c) in samples:
            row["vs_hf_cb"] = paired(figs, samples[("hf_cb", c)])
        rows.append(row)
    return rows


def _median(xs) -> float:
    xs = [x for x in xs if x == x]  # nan: no such figure (generate has no time to first token)
    return statistics.median(xs) if xs else float("nan")


@contextlib.contextmanager
def _tensorpar_server(path, slots: int, warm: list):
    """``tensorpar serve`` as a user starts it (a process of its own; the bench sits beside the
    CLI, not above the jobs), warmed up, stopped with SIGTERM. Idle, its ranks sleep in the
    kernel (no spinning), so the other servers' rounds run beside it undisturbed."""
    cmd = [sys.executable, "-m", "tensorpar", "serve", "--model", str(path), "--tp", "2", "--port", "0", "--json",
           "--max-batch", str(slots), "--max-tokens-in-flight", str(max(256, slots)), "--max-queue", "4096"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # the ready line, or nothing if it failed (its stderr says why)
        if not line:
            raise RuntimeError(f"tensorpar serve did not start (exit {proc.wait()})")
        url = json.loads(line)["url"]
        asyncio.run(_drive_http(url, warm))
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


@contextlib.contextmanager
def _hf_manager(path, slots: int, longest: int, warm: list):
    """transformers' continuous batching on the unsplit model, started once, warmed up."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=model.config.eos_token_id)
    with torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=config)
        manager.start()
        try:
            drive_hf(manager, warm)
            yield manager
        finally:
            manager.stop(block=True, timeout=60)


# ---- the page -----------------------------------------------------------------------------------

TARGETS = (("32 streams: at least 4x sequential generate", lambda rows: [
               r["vs_sequential_generate"] >= 4 for r in rows if r["server"] == "tensorpar" and r["streams"] == 32]),
           ("ahead of HF's continuous batching at every load", lambda rows: [
               r["vs_hf_cb"] > 1 for r in rows if "vs_hf_cb" in r]))


def serve_table(rows: list[dict]) -> str:
    """Markdown: one line per (server, load); medians over the rounds, ratios paired by round."""
    head = ("| server | streams | requests | tokens | tokens/s | x sequential generate | x HF continuous batching "
            "| TTFT p50 / p99 (ms) | per token p50 / p99 (ms) |\n|---|---|---|---|---|---|---|---|---|\n")

    def ms(a, b=None):
        return " / ".join("-" if x is None or x != x else f"{1e3 * x:.1f}" for x in ((a,) if b is None else (a, b)))
    return head + "".join(
        f"| {r['server']} | {r['streams']} | {r['requests']} | {r['tokens']:g} | {r['tokens_per_s']:.1f} | "
        f"{r['vs_sequential_generate']:.2f} | {'%.2f' % r['vs_hf_cb'] if 'vs_hf_cb' in r else '-'} | "
        f"{ms(r['ttft_p50_s'], r.get('ttft_p99_s'))} | {ms(r['tpot_p50_s'], r.get('tpot_p99_s'))} |\n" for r in rows)


def serve_page(rows: list[dict], command: str) -> str:
    """The suite's page: how it was run (the command, when, on what), the table, the targets."""
    rounds = rows[0]["rounds"]
    verdicts = "".join(f"- {name}: {_verdict(check(rows))}\n" for name, check in TARGETS)
    return (f"# Benchmark: `tensorpar serve` at tp 2 against Hugging Face's continuous batching\n\n"
            f"Written by `{command}` at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on "
            f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), load average "
            f"{os.getloadavg()[0]:.1f} at the end, torch {torch.__version__}, transformers {transformers.__version__}. "
            f"{rounds} interleaved round{'s' * (rounds != 1)}: each round runs every server on every load, the "
            f"servers' order rotating; each figure is the median over the rounds, each ratio the median of the "
            f"throughput ratios within a round. A request alone takes {rows[0]['mean_request_alone_s']:.2f} s "
            f"through `generate`; a load of N streams offers N such requests at once (Poisson arrivals). What the "
            f"suite measures: [benchmarks.md](../benchmarks.md#serve-a-server-under-load).\n\n"
            f"{serve_table(rows)}\nTargets (medians):\n\n{verdicts}")


def _verdict(checks: list) -> str:
    if not checks:
        return "not measured in this run"
    return "met" if all(checks) else f"missed at {checks.count(False)} of {len(checks)} loads"
