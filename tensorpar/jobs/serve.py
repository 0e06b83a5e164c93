"""`tensorpar serve`: a sharded model behind an OpenAI-compatible HTTP server, with continuous batching.

Every rank loads its shard (``load_sharded``) and runs the engine loop; rank 0 also runs the HTTP
server (uvicorn, in a thread of its own) and the scheduler: each step it sends the plan to the
other ranks (:class:`~tensorpar.models.engine_plan.PlanWire`), every rank runs it, and rank 0 hands
the tokens to the requests' handlers. Idle, rank 0 still sends an empty plan every
:data:`IDLE_S` seconds, so no rank waits in a collective long enough to look stuck, and a rank
that died is found within that time (the launcher ends the whole job, naming it).

Stopping: SIGTERM or SIGINT to the ``tensorpar serve`` process stops accepting connections,
finishes the streams in flight, then exits 0; a second signal stops at the next step, dropping
what is in flight (exit 130). The parent tells rank 0 through a file in a private folder
(ranks are not its children under a fork server, and they ignore SIGINT). Under torchrun each
process is a rank: the same handler runs in each, and only rank 0's file is read.

Everything a user can get wrong (the checkpoint, tp, sizes, the address, the key) is checked here
before any rank starts: ``ValueError`` naming the value and what it may be.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from tensorpar import distributed as dist
from tensorpar.architecture import registry
from tensorpar.data.tokens import has_tokenizer
from tensorpar.jobs.common import DTYPES, check_tp, is_decoder, max_positions, open_checkpoint, parse_dtype, quiet_transformers
from tensorpar.jobs.serve_api import ServeState, make_app
from tensorpar.jobs.serve_scheduler import Scheduler
from tensorpar.models.checkpoint import load_sharded
from tensorpar.models.engine import Engine
from tensorpar.models.engine_plan import Plan, PlanWire

IDLE_S = 0.5
START_S = 120.0  # the HTTP server's start (binding, the app) on rank 0, bounded


@dataclass(frozen=True)
class ServeOptions:
    model: str
    tp: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 32
    max_tokens_in_flight: int = 512
    max_queue: int = 256
    max_model_len: int | None = None
    api_key: str | None = None
    dtype: str = "float32"
    backend: str = "auto"
    name: str | None = None  # the model's name in the API (default: the folder's)


def check(opts: ServeOptions) -> dict:
    """Everything checked before any rank starts; the spec every rank gets."""
    ckpt = open_checkpoint(opts.model)
    if not is_decoder(ckpt):
        raise ValueError(f"--model {ckpt.path}: tensorpar serve generates text; this is a {ckpt.family} encoder")
    if ckpt.family not in registry.LEAN_TYPES:
        raise ValueError(f"--model {ckpt.path} is a {ckpt.family} model; tensorpar serve runs the lean decode "
                         f"path's families: {', '.join(registry.LEAN_TYPES)}")
    dtype = parse_dtype(opts.dtype)
    check_tp(ckpt, opts.tp)
    _check_count("--max-batch", opts.max_batch, 1)
    _check_count("--max-queue", opts.max_queue, 0)
    _check_count("--max-tokens-in-flight", opts.max_tokens_in_flight, opts.max_batch,
                 f"at least --max-batch ({opts.max_batch}): every running stream takes one token a step")
    capacity = _capacity(ckpt, opts.max_model_len)
    _check_cache(ckpt.config, opts.tp, opts.max_batch, capacity, dtype.itemsize)
    if opts.api_key is not None and not opts.api_key.strip():
        raise ValueError("--api-key '' is empty: give a key, or leave the option out for no key")
    _check_address(opts.host, opts.port)
    dist.check_world(opts.tp)
    return {"path": str(ckpt.path), "name": opts.name or ckpt.path.name, "dtype": opts.dtype, "capacity": capacity,
            "max_batch": opts.max_batch, "step_tokens": opts.max_tokens_in_flight, "max_queue": opts.max_queue,
            "host": opts.host, "port": opts.port, "api_key": opts.api_key, "tokenizer": has_tokenizer(ckpt.path),
            "stop_ids": _eos(ckpt), "backend": dist.resolve_backend(opts.backend, opts.tp), "tp": opts.tp}


def _check_count(option: str, value, least: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{option} must be an integer >= {least}{' (' + why + ')' if why else ''}, got {value!r}")


def _capacity(ckpt, max_model_len) -> int:
    limit = max_positions(ckpt)
    if max_model_len is None:
        if limit is None:
            raise ValueError(f"{ckpt.path}: config.json gives no max_position_embeddings; set --max-model-len")
        return limit
    _check_count("--max-model-len", max_model_len, 2)
    if limit is not None and max_model_len > limit:
        raise ValueError(f"--max-model-len {max_model_len} is more than this model's {limit} positions")
    return max_model_len


def cache_bytes(config: dict, tp: int, slots: int, capacity: int, itemsize: int) -> int:
    """One rank's :class:`~tensorpar.models.engine.SlotCache`: K and V, ``(slots, KV heads / tp,
    capacity, head_dim)`` a layer (a KV head shared by several ranks where tp > KV heads)."""
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * slots * max(1, kv // tp) * capacity * head_dim * itemsize


def _check_cache(config: dict, tp: int, slots: int, capacity: int, itemsize: int) -> None:
    """The preallocated KV cache of every local rank together, against this machine's memory (a
    bound that never refuses what fits: a model's default context, 128k positions, times 32 slots
    would otherwise be a failed allocation or the OOM killer in the ranks)."""
    per_rank = cache_bytes(config, tp, slots, capacity, itemsize)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if tp * per_rank > memory:
        raise ValueError(f"the KV cache of --max-batch {slots} slots x {capacity} positions takes "
                         f"{tp * per_rank / 2 ** 30:.1f} GiB over {tp} rank(s), more than this machine's "
                         f"{memory / 2 ** 30:.1f} GiB of memory; lower --max-model-len or --max-batch")


def _eos(ckpt) -> list[int]:
    """The model's end-of-sequence tokens (generation_config.json, else config.json): a choice ends there."""
    gen = ckpt.path / "generation_config.json"
    value = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    value = ckpt.config.get("eos_token_id") if value is None else value
    ids = [] if value is None else [value] if isinstance(value, int) else list(value)
    return [int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool)]


def _check_address(host: str, port) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535 (0: any free port), got {port!r}")
    try:
        with _listen(host, port):
            pass
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _listen(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise OSError(exc.errno, f"--host {host!r} is not an address of this machine ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


# ---- the parent ---------------------------------------------------------------------------------

def serve(opts: ServeOptions, *, on_ready=None, stop: threading.Event | None = None) -> dict:
    """Run the server until it is told to stop (SIGTERM or SIGINT in the main thread, or ``stop``
    set: each drains, as below); ``on_ready(info)`` once it listens (``info``: url, host, port,
    model, tp, dtype, pids). Returns rank 0's summary."""
    spec = check(opts)
    with tempfile.TemporaryDirectory(prefix="tensorpar-serve-") as control:
        spec["control"] = control
        outcome: dict = {}

        def run():
            try:
                outcome["ranks"] = dist.launch(serve_rank, opts.tp, spec, backend=spec["backend"], deadline=None)
            except BaseException as exc:  # raised again in the caller's thread
                outcome["error"] = exc
        thread = threading.Thread(target=run, name="tensorpar-serve-launch", daemon=True)
        with _stop_signals(Path(control)):
            thread.start()
            _wait(thread, Path(control), on_ready, stop)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["ranks"][0]


def _wait(thread, control: Path, on_ready, stop) -> None:
    ready, drain = False, False
    while thread.is_alive():
        thread.join(0.1)
        if not ready and (control / "ready.json").is_file():
            ready = True
            if on_ready is not None:
                on_ready(json.loads((control / "ready.json").read_text()))
        if not drain and stop is not None and stop.is_set():
            drain = True
            _tell(control, "drain")


@contextlib.contextmanager
def _stop_signals(control: Path):
    """SIGTERM/SIGINT: drain (then exit 0); a second one: stop now. Only in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    count = []

    def handler(signum, frame):
        count.append(signum)
        _tell(control, "drain" if len(count) == 1 else "stop")
    before = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _tell(control: Path, word: str) -> None:
    tmp = control / "signal.tmp"
    tmp.write_text(word)
    tmp.replace(control / "signal")


# ---- every rank ---------------------------------------------------------------------------------

def serve_rank(spec: dict) -> dict:
    quiet_transformers()
    model, _ = load_sharded(spec["path"], dtype=DTYPES[spec["dtype"]])
    model.eval()
    engine = Engine(model, slots=spec["max_batch"], capacity=spec["capacity"])
    wire = PlanWire(spec["max_batch"], spec["step_tokens"], device=engine.decoder.device)
    pids = dist.all_gather_object(os.getpid())
    if dist.get_rank() != 0:
        return _follow(engine, wire)
    return _lead(engine, wire, spec, pids)


def _follow(engine: Engine, wire: PlanWire) -> dict:
    steps = 0
    while True:
        plan = wire.exchange(None)
        if plan.stop:
            return {"rank": dist.get_rank(), "steps": steps}
        engine.step(plan)
        steps += 1


def _lead(engine: Engine, wire: PlanWire, spec: dict, pids: list) -> dict:
    from transformers import AutoTokenizer

    scheduler = Scheduler(spec["max_batch"], spec["step_tokens"], spec["max_queue"])
    state = ServeState(scheduler, spec["name"], spec["capacity"], engine.vocab, tuple(spec["stop_ids"]),
                       spec["max_batch"], AutoTokenizer.from_pretrained(spec["path"]) if spec["tokenizer"] else None,
                       spec["api_key"])
    sock = _listen(spec["host"], spec["port"])
    server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", access_log=False, lifespan="off"))
    http = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), name="tensorpar-http", daemon=True)
    http.start()
    _started(server, http)
    host, port = sock.getsockname()[:2]
    info = {"event": "ready", "url": f"http://{_url_host(host)}:{port}", "host": host, "port": port,
            "model": spec["name"], "tp": spec["tp"], "dtype": spec["dtype"], "max_batch": spec["max_batch"],
            "pids": pids}
    _write(Path(spec["control"]) / "ready.json", info)
    try:
        steps, forced = _loop(engine, wire, scheduler, state, server, http, Path(spec["control"]) / "signal")
    finally:
        server.should_exit = True
    return {"event": "stopped", "url": info["url"], "steps": steps, "forced": forced,
            "requests": _total(state.metrics.requests), "generated_tokens": _total(state.metrics.generated_tokens)}


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _started(server, http) -> None:
    t_end = time.monotonic() + START_S
    while not server.started:
        if not http.is_alive():
            raise RuntimeError("the HTTP server stopped while starting (its log on stderr says why)")
        if time.monotonic() > t_end:
            raise TimeoutError(f"the HTTP server did not start within {START_S:g} s")
        time.sleep(0.01)


def _write(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def _loop(engine, wire, scheduler, state, server, http, signal_file: Path) -> tuple[int, bool]:
    """Steps until told to stop and drained (or told twice); ``(steps, forced)``."""
    steps, draining = 0, False
    while True:
        word = signal_file.read_text() if signal_file.is_file() else None
        if word is not None and not draining:
            draining, server.should_exit = True, True  # no new connections; the open ones finish
        if not draining and not http.is_alive():
            raise RuntimeError("the HTTP server stopped by itself (its log on stderr says why)")
        plan = scheduler.next_plan(IDLE_S)
        stop = word == "stop" or (draining and not http.is_alive() and scheduler.idle)
        plan = wire.exchange(Plan(stop=True) if stop else plan)
        if plan.stop:
            server.force_exit = True
            return steps, word == "stop"
        _step(engine, scheduler, state, plan)
        steps += bool(plan.rows)


def _step(engine, scheduler, state, plan) -> None:
    if not plan.rows:
        return
    t0 = time.perf_counter()
    scheduler.finish(*engine.step(plan))
    state.outbox.flush()
    m = state.metrics
    m.step.observe(time.perf_counter() - t0)
    m.batch.observe(len(plan.rows))
    m.queue_depth.set(scheduler.queue_depth)
    m.running.set(scheduler.running)


def _total(counter) -> int:
    return int(sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")))
