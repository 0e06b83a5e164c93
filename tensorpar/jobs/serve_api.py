"""The OpenAI-compatible HTTP API of ``tensorpar serve`` (FastAPI), on rank 0.

``POST /v1/completions`` (a prompt as text or token ids), ``POST /v1/chat/completions`` (the
tokenizer's chat template), both streamed as server-sent events with ``"stream": true`` (one
chunk per token, then ``data: [DONE]``); ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text). Each choice also carries ``token_ids``, the tokens it drew (an extension:
what an exact comparison reads). A request is checked whole before it is queued: anything
malformed is a 400 with an OpenAI error object (``{"error": {"message", "type", "param",
"code"}}``) naming the field and what it may be; options that would change the result in a way
this server does not compute (``echo``, penalties, ``logit_bias``, ``best_of``) are refused, not
ignored.

Log-probabilities (``logprobs: k`` on completions; ``logprobs: true`` and ``top_logprobs: k`` on
chat; ``k`` at most 20) are the model's own distribution at each drawn token (log-softmax of its
logits, before temperature, top-k and top-p: what vLLM reports by default), one entry per token
of ``token_ids``, in OpenAI's two formats (completions: ``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``; chat: ``content`` entries with ``token``, ``logprob``,
``bytes``, ``top_logprobs``). A token's text is the tokenizer's decoding of it alone
(``token_id:N`` without a tokenizer). A full queue is a 429; with an API key, a request without it is a 401.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import json
import math
import secrets
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from tensorpar.jobs.serve_job import Job, Outbox
from tensorpar.jobs.serve_render import stream, whole
from tensorpar.jobs.serve_scheduler import QueueFull
from tensorpar.models.sampling import Sampler

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (no process-wide state)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tensorpar_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("tensorpar_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("tensorpar_generated_tokens", "tokens generated", registry=r)
        self.queue_depth = Gauge("tensorpar_queue_depth", "requests waiting for a slot", registry=r)
        self.running = Gauge("tensorpar_running_requests", "requests holding slots of the KV cache", registry=r)
        self.batch = Histogram("tensorpar_batch_rows", "rows (one per running choice or prompt chunk) of an "
                               "engine step", buckets=_BATCH_BUCKETS, registry=r)
        self.step = Histogram("tensorpar_step_seconds", "engine step time", buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("tensorpar_time_to_first_token_seconds", "arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tensorpar_time_per_output_token_seconds", "time between a choice's tokens",
                              buckets=_LATENCY_BUCKETS, registry=r)

    def token(self, first_s: float | None, gap_s: float | None) -> None:
        """One token drawn: ``first_s`` for its request's first token, ``gap_s`` for a choice's
        later ones (a choice's first token past the request's first has neither)."""
        self.generated_tokens.inc()
        if first_s is not None:
            self.ttft.observe(first_s)
        if gap_s is not None:
            self.tpot.observe(gap_s)


@dataclass
class ServeState:
    scheduler: object
    model_name: str
    capacity: int  # positions a request may use: prompt + max_tokens
    vocab: int
    stop_ids: tuple  # the model's end-of-sequence tokens
    max_batch: int
    tokenizer: object = None
    api_key: str | None = None
    metrics: Metrics = field(default_factory=Metrics)
    outbox: Outbox = field(default_factory=Outbox)
    created: int = field(default_factory=lambda: int(time.time()))


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


Number = StrictInt | StrictFloat


class _Options(BaseModel):
    """What both endpoints take; unknown fields are ignored (clients send more), known ones typed."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = None
    stream_options: dict | None = None
    user: StrictStr | None = None
    logprobs: StrictBool | StrictInt | None = None
    top_logprobs: StrictInt | None = None
    # refused unless left at their defaults (see the module docstring)
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict | None = None


class CompletionRequest(_Options):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]


class ChatRequest(_Options):
    messages: list[dict]
    max_completion_tokens: StrictInt | None = None


_UNSUPPORTED = {"echo": (None, False), "best_of": (None, 1), "presence_penalty": (None, 0),
                "frequency_penalty": (None, 0), "logit_bias": (None, {})}
MAX_LOGPROBS = 20  # the most likely tokens reported beside each drawn one (OpenAI's bound on chat)


def make_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="tensorpar serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        route = request.url.path
        if state.api_key is not None and not _authorized(request, state.api_key):
            response = _error(BadRequest("a valid API key is needed: send 'Authorization: Bearer KEY'", None, 401,
                                         "authentication_error"))
        else:
            response = await call_next(request)
        state.metrics.requests.labels(route if route in _ROUTES else "other", str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "tensorpar", "max_model_len": state.capacity}]}

    @app.get("/metrics")
    async def metrics():
        state.metrics.queue_depth.set(state.scheduler.queue_depth)
        state.metrics.running.set(state.scheduler.running)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _answer(state, request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _answer(state, request, ChatRequest, chat=True)

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return _error(BadRequest(f"no route {request.method} {request.url.path}; this server has "
                                 f"{', '.join(sorted(_ROUTES))}", None, 404, "not_found_error"))

    return app


_ROUTES = ("/health", "/v1/models", "/metrics", "/v1/completions", "/v1/chat/completions")


def _authorized(request: Request, key: str) -> bool:
    given = request.headers.get("authorization", "")
    return given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), key.encode())


def _error(exc: BadRequest) -> JSONResponse:
    return JSONResponse({"error": {"message": exc.message, "type": exc.kind, "param": exc.param,
                                   "code": exc.status}}, status_code=exc.status)


async def _answer(state: ServeState, request: Request, schema, chat: bool):
    try:
        body = _parse(await request.body(), schema)
        job, events = _job(state, body, chat)
        state.scheduler.submit(job)
    except BadRequest as exc:
        return _error(exc)
    except QueueFull as exc:
        return _error(BadRequest(str(exc), None, 429, "rate_limit_error"))
    state.metrics.prompt_tokens.inc(len(job.prompt))
    meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}", "created": int(time.time()),
            "model": state.model_name}
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(stream(state, job, events, meta, chat, include_usage),
                                 media_type="text/event-stream")
    return await whole(state, request, job, events, meta, chat)


def _parse(raw: bytes, schema):
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc.errors()) from None


def _invalid(errors: list) -> BadRequest:
    """The first wrong field, named as the client sent it: a union's alternatives (pydantic puts
    each type's name in the location) said together, list indices kept."""
    field = errors[0]["loc"][0] if errors[0]["loc"] else None
    mine = [e for e in errors if e["loc"] and e["loc"][0] == field] or errors[:1]
    where = ".".join(str(p) for p in [field, *(p for p in mine[0]["loc"][1:] if isinstance(p, int))] if p is not None)
    wants = list(dict.fromkeys(e["msg"].removeprefix("Input should be ") for e in mine))
    said = mine[0]["msg"] if len(wants) == 1 else "should be " + " or ".join(wants)
    got = json.dumps(mine[0].get("input"))[:60]
    return BadRequest(f"{where or 'body'}: {said} (got {got})", None if field is None else str(field))


def _job(state: ServeState, body, chat: bool):
    """The request checked whole (BadRequest naming the field), as a job and its event queue."""
    for name, allowed in _UNSUPPORTED.items():
        if getattr(body, name) not in allowed:
            raise BadRequest(f"{name} is not supported by tensorpar serve (got {getattr(body, name)!r}); "
                             f"leave it out", name)
    prompt = _chat_prompt(state, body) if chat else _prompt(state, body.prompt)
    n = 1 if body.n is None else body.n
    if not 1 <= n <= state.max_batch:
        raise BadRequest(f"n must be in 1..{state.max_batch} (this server's --max-batch), got {n}", "n")
    room = state.capacity - len(prompt)
    if room < 1:
        raise BadRequest(f"the prompt is {len(prompt)} tokens; this model takes at most {state.capacity} "
                         f"positions, prompt and completion together", "prompt" if not chat else "messages")
    max_tokens = _max_tokens(body, chat, room)
    stop_ids = _stop_ids(state, body)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stops):
        raise BadRequest("stop strings must not be empty", "stop")
    if stops and state.tokenizer is None:
        raise BadRequest("stop strings need a tokenizer; this model has none (use stop_token_ids)", "stop")
    events = asyncio.Queue()
    emit = functools.partial(state.outbox.post, asyncio.get_running_loop(), events)  # handed over after the step
    decode = None if state.tokenizer is None else (
        lambda ids: state.tokenizer.decode(ids, skip_special_tokens=True))
    job = Job(prompt, n=n, sampler=_sampler(body), max_tokens=max_tokens, stop_ids=stop_ids, stop_texts=stops,
              emit=emit, decode=decode, metrics=state.metrics, logprobs=_logprobs(state, body, chat))
    return job, events


def _logprobs(state: ServeState, body, chat: bool) -> int | None:
    """How many most likely tokens to report beside each drawn one; None: no log-probabilities."""
    most = min(MAX_LOGPROBS, state.vocab)
    if not chat:
        if body.top_logprobs is not None:
            raise BadRequest("top_logprobs is a chat parameter; /v1/completions takes logprobs: k", "top_logprobs")
        k = body.logprobs
        if k is None:
            return None
        if isinstance(k, bool) or not 0 <= k <= most:
            raise BadRequest(f"logprobs must be an integer in 0..{most} on /v1/completions, got {json.dumps(k)}",
                             "logprobs")
        return k
    if body.logprobs is not None and not isinstance(body.logprobs, bool):
        raise BadRequest(f"logprobs must be true or false on /v1/chat/completions (top_logprobs: k says how many), "
                         f"got {body.logprobs}", "logprobs")
    k = body.top_logprobs
    if k is not None and not 0 <= k <= most:
        raise BadRequest(f"top_logprobs must be an integer in 0..{most}, got {k}", "top_logprobs")
    if not body.logprobs:
        if k:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return k or 0


def _prompt(state: ServeState, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise BadRequest(f"prompt: one prompt a request (got a list of {len(prompt)}); send one request each",
                             "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if state.tokenizer is None:
            raise BadRequest("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        prompt = state.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not prompt:
        raise BadRequest("prompt is empty", "prompt")
    bad = [t for t in prompt if not 0 <= t < state.vocab]
    if bad:
        raise BadRequest(f"prompt token ids must be in [0, {state.vocab}); got {bad[:5]}", "prompt")
    return list(prompt)


def _chat_prompt(state: ServeState, body) -> list[int]:
    tok = state.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise BadRequest("this model's tokenizer has no chat template: use /v1/completions", "messages")
    if not body.messages or not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                                    for m in body.messages):
        raise BadRequest("messages must be a non-empty list of {\"role\": str, \"content\": str}", "messages")
    try:
        ids = tok.apply_chat_template(body.messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # the template's own words (a jinja error, a role it refuses)
        raise BadRequest(f"the chat template refused these messages: {' '.join(str(exc).split())}",
                         "messages") from None
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return _prompt(state, list(ids))


def _max_tokens(body, chat: bool, room: int) -> int:
    given = body.max_completion_tokens if chat and body.max_completion_tokens is not None else body.max_tokens
    if given is None:
        return room if chat else min(16, room)  # OpenAI's defaults: the rest of the context, 16
    if given < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {given}", "max_tokens")
    if given > room:
        raise BadRequest(f"max_tokens ({given}) and the prompt take more than this model's positions: at most "
                         f"{room} tokens fit after this prompt", "max_tokens")
    return given


def _stop_ids(state: ServeState, body) -> tuple:
    extra = list(body.stop_token_ids or [])
    bad = [t for t in extra if not 0 <= t < state.vocab]
    if bad:
        raise BadRequest(f"stop_token_ids must be in [0, {state.vocab}); got {bad[:5]}", "stop_token_ids")
    return tuple(state.stop_ids) + tuple(extra)


def _sampler(body) -> Sampler:
    """OpenAI's meaning: temperature 0 is greedy, default 1; top_k -1 or absent: off."""
    t = 1.0 if body.temperature is None else float(body.temperature)
    if not (math.isfinite(t) and t >= 0):
        raise BadRequest(f"temperature must be a finite number >= 0 (0: greedy), got {body.temperature}", "temperature")
    top_p = 1.0 if body.top_p is None else float(body.top_p)
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {body.top_p}", "top_p")
    top_k = None if body.top_k in (None, -1) else body.top_k
    if top_k is not None and top_k < 1:
        raise BadRequest(f"top_k must be a positive integer or -1 (off), got {body.top_k}", "top_k")
    seed = secrets.randbits(63) if body.seed is None else body.seed
    if not 0 <= seed < 2 ** 63:
        raise BadRequest(f"seed must be in [0, 2**63), got {seed}", "seed")
    if t == 0:
        return Sampler()
    return Sampler(do_sample=True, temperature=t, top_k=top_k, top_p=top_p, seed=seed)
