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
- ``generate``: tensorpar's ``generate`` at tp 2, the requests one after the other (batch 1):
  the baseline of "32 streams at least 4x sequential generate".

Figures: tokens/s (generated tokens over the time from the first arrival to the last token),
time to first token (arrival to first token) and per-token latency (gaps between a request's
tokens), p50 and p99. Greedy everywhere, the model's end-of-sequence token ignored by neither
(a random model rarely draws it): the token counts are reported beside the rates.
"""
from __future__ import annotations

import asyncio
import json
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
from transformers import AutoModelForCausalLM, GenerationConfig

from tensorpar import distributed as dist
from tensorpar.architecture.tiny_sizes import BENCH_LLAMA
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

def run_serve_bench(*, sizes=BENCH_LLAMA, levels=LEVELS, requests_per_stream: int = 2, prompts=PROMPTS,
                    outputs=OUTPUTS, seed: int = 0) -> list[dict]:
    """One row per (load, server); the first row of each load says its arrival rate."""
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="tensorpar-bench-serve-") as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "llama", "llama", seed=seed, **sizes)
        vocab = sizes["vocab_size"]
        alone = workload(8, 1.0, seed + 1, vocab, prompts, outputs)
        seq = dist.launch(generate_rank, 2, str(path), alone)[0]
        one_s = statistics.mean(t1 - t0 for t0, t1, _ in seq)
        rows = [{"server": "generate", "streams": 1, "requests": len(seq), "tokens": sum(n for *_, n in seq),
                 "tokens_per_s": sum(n for *_, n in seq) / sum(t1 - t0 for t0, t1, _ in seq),
                 "ttft_p50_s": float("nan"), "tpot_p50_s": statistics.median((t1 - t0) / n for t0, t1, n in seq)}]
        loads = {c: workload(max(8, requests_per_stream * c), c / one_s, seed + 2 + c, vocab, prompts, outputs)
                 for c in levels}
        rows += _tensorpar_rows(path, loads, max(levels))
        rows += _hf_rows(path, loads, max(levels), max(prompts) + max(outputs))
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_sequential_generate"] = r["tokens_per_s"] / base
        r["mean_request_alone_s"] = one_s
    return rows


def _tensorpar_rows(path, loads: dict, slots: int) -> list:
    """``tensorpar serve`` as a user starts it (a process of its own; the bench sits beside the
    CLI, not above the jobs), stopped with SIGTERM."""
    cmd = [sys.executable, "-m", "tensorpar", "serve", "--model", str(path), "--tp", "2", "--port", "0", "--json",
           "--max-batch", str(slots), "--max-tokens-in-flight", str(max(256, slots)), "--max-queue", "4096"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # the ready line, or nothing if it failed (its stderr says why)
        if not line:
            raise RuntimeError(f"tensorpar serve did not start (exit {proc.wait()})")
        url = json.loads(line)["url"]
        asyncio.run(_drive_http(url, loads[min(loads)][:2]))  # warm-up
        return [{"server": "tensorpar", "streams": c, **figures(*asyncio.run(_drive_http(url, reqs)))}
                for c, reqs in loads.items()]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def _hf_rows(path, loads: dict, slots: int, longest: int) -> list:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=model.config.eos_token_id)
    with torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=config)
        manager.start()
        try:
            drive_hf(manager, loads[min(loads)][:2])  # warm-up
            return [{"server": "hf_cb", "streams": c, **figures(*drive_hf(manager, reqs))} for c, reqs in loads.items()]
        finally:
            manager.stop(block=True, timeout=60)


def serve_table(rows: list[dict]) -> str:
    """Markdown: one line per (server, load)."""
    head = ("| server | streams | requests | tokens | tokens/s | x sequential generate | TTFT p50 / p99 (ms) "
            "| per token p50 / p99 (ms) |\n|---|---|---|---|---|---|---|---|\n")

    def ms(a, b=None):
        return " / ".join("-" if x is None or x != x else f"{1e3 * x:.1f}" for x in ((a,) if b is None else (a, b)))
    return head + "".join(
        f"| {r['server']} | {r['streams']} | {r['requests']} | {r['tokens']} | {r['tokens_per_s']:.1f} | "
        f"{r['vs_sequential_generate']:.2f} | {ms(r['ttft_p50_s'], r.get('ttft_p99_s'))} | "
        f"{ms(r['tpot_p50_s'], r.get('tpot_p99_s'))} |\n" for r in rows)
