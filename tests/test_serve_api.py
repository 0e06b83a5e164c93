"""The HTTP API of `tensorpar serve` in this process (tensorpar/jobs/serve_api.py, no ranks, no
engine): every malformed request gets a 4xx with an OpenAI error object naming the field, before
anything is queued; a full queue is a 429; with an API key, a request without it is a 401; the
routes and the Prometheus text. The served model's tokenizer is the tests' word-level one."""
import json

import pytest
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from tensorpar.jobs.serve_api import Metrics, ServeState, make_app
from tensorpar.jobs.serve_job import Job
from tensorpar.jobs.serve_scheduler import Scheduler
from tensorpar.models.sampling import Sampler
from tests import _serve_workers as W

OK = {"prompt": "t5 t6", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "t5"}], "max_tokens": 2}
# (route, body: a dict sent as JSON or raw bytes, status, param, words of the message); the model
# has 64 positions and 130 tokens; the server 4 slots
API_ERRORS = [
    ("/v1/completions", b"{\"prompt\": ", 400, None, "the body is not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "the body must be a JSON object, got list"),
    ("/v1/completions", {"max_tokens": 2}, 400, "prompt", "prompt: Field required"),
    ("/v1/completions", {**OK, "max_tokens": "2"}, 400, "max_tokens", "Input should be a valid integer"),
    ("/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature", "temperature"),
    ("/v1/completions", {**OK, "stream": "yes"}, 400, "stream", "valid boolean"),
    ("/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens", "max_tokens must be at least 1, got 0"),
    ("/v1/completions", {**OK, "max_tokens": -3}, 400, "max_tokens", "got -3"),
    ("/v1/completions", {**OK, "max_tokens": 63}, 400, "max_tokens", "at most 62 tokens fit after this prompt"),
    ("/v1/completions", {"prompt": " ".join(["t5"] * 64)}, 400, "prompt",
     "the prompt is 64 tokens; this model takes at most 64 positions"),
    ("/v1/completions", {**OK, "temperature": -0.5}, 400, "temperature",
     "temperature must be a finite number >= 0 (0: greedy), got -0.5"),
    ("/v1/completions", {**OK, "top_p": 0}, 400, "top_p", "top_p must be in (0, 1], got 0"),
    ("/v1/completions", {**OK, "top_k": 0}, 400, "top_k", "top_k must be a positive integer or -1 (off), got 0"),
    ("/v1/completions", {**OK, "seed": -1}, 400, "seed", "seed must be in [0, 2**63), got -1"),
    ("/v1/completions", {**OK, "n": 5}, 400, "n", "n must be in 1..4"),
    ("/v1/completions", {**OK, "stop": ["t7", ""]}, 400, "stop", "stop strings must not be empty"),
    ("/v1/completions", {**OK, "stop_token_ids": [130]}, 400, "stop_token_ids", "must be in [0, 130); got [130]"),
    ("/v1/completions", {"prompt": [5, 130, -1]}, 400, "prompt", "must be in [0, 130); got [130, -1]"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "prompt is empty"),
    ("/v1/completions", {"prompt": ["t5", "t6"]}, 400, "prompt", "one prompt a request (got a list of 2)"),
    ("/v1/completions", {**OK, "logprobs": 21}, 400, "logprobs", "logprobs must be an integer in 0..20 on "
                                                                 "/v1/completions, got 21"),
    ("/v1/completions", {**OK, "logprobs": True}, 400, "logprobs", "got true"),
    ("/v1/completions", {**OK, "logprobs": 2, "top_logprobs": 2}, 400, "top_logprobs", "top_logprobs is a chat"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 3}, 400, "logprobs", "logprobs must be true or false"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", "top_logprobs needs logprobs: true"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs",
     "top_logprobs must be an integer in 0..20, got -1"),
    ("/v1/completions", {**OK, "echo": True}, 400, "echo", "echo is not supported"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "messages must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages", "messages must be a non-empty list"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_tokens", "max_tokens must be at least 1"),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(W.make_served_model(tmp_path_factory.mktemp("served") / "m"))


class _NothingQueued:
    """A scheduler that fails the request it is handed (no engine runs here: a queued request
    would wait forever)."""

    queue_depth = running = 0

    def submit(self, job):
        raise AssertionError(f"a request was queued: {len(job.prompt)} prompt tokens, max_tokens {job.max_tokens}")


def _client(tokenizer, *, scheduler=None, api_key=None):
    state = ServeState(scheduler or _NothingQueued(), "tiny", 64, 130, (2,), 4, tokenizer, api_key)
    return TestClient(make_app(state), raise_server_exceptions=True), state


def _post(client, route, body, **kw):
    if isinstance(body, bytes):
        return client.post(route, content=body, headers={"content-type": "application/json"}, **kw)
    return client.post(route, json=body, **kw)


@pytest.mark.parametrize("route, body, status, param, words", API_ERRORS)
def test_a_malformed_request_is_a_4xx_error_object_and_nothing_is_queued(tokenizer, route, body, status, param,
                                                                        words):
    client, _ = _client(tokenizer)
    r = _post(client, route, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"], error
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == status
    assert client.get("/health").json() == {"status": "ok"}  # and the server goes on


def test_a_full_queue_is_429(tokenizer):
    client, state = _client(tokenizer, scheduler=Scheduler(4, 16, 1))
    state.scheduler.submit(object())  # a request already waiting (no engine runs here)
    r = _post(client, "/v1/completions", OK)
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
    assert "--max-queue 1" in r.json()["error"]["message"]
    assert 'tensorpar_requests_total{route="/v1/completions",status="429"} 1.0' in client.get("/metrics").text


def test_an_api_key_is_required_on_every_route(tokenizer):
    client, _ = _client(tokenizer, api_key="sesame")
    for route in ("/health", "/v1/models", "/metrics"):
        assert client.get(route).status_code == 401
        assert client.get(route, headers={"Authorization": "Bearer sesam"}).status_code == 401
        assert client.get(route, headers={"Authorization": "Bearer sesame"}).status_code == 200
    r = _post(client, "/v1/completions", OK, headers={"Authorization": "sesame"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_models_health_metrics_and_unknown_routes(tokenizer):
    client, _ = _client(tokenizer)
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "/v1/completions" in r.json()["error"]["message"]
    text = client.get("/metrics").text
    for name in ("tensorpar_requests_total", "tensorpar_generated_tokens_total", "tensorpar_queue_depth",
                 "tensorpar_running_requests", "tensorpar_batch_rows_bucket", "tensorpar_step_seconds_bucket",
                 "tensorpar_time_to_first_token_seconds_bucket", "tensorpar_time_per_output_token_seconds_bucket"):
        assert f"\n{name}" in text, name
    assert json.loads(json.dumps(client.get("/health").json())) == {"status": "ok"}


def test_metrics_count_every_token_of_every_choice():
    """n=2: three tokens drawn, one first token (the request's), one gap (choice 0's second)."""
    metrics = Metrics()
    job = Job([1], n=2, sampler=Sampler(), max_tokens=5, emit=lambda e: None, metrics=metrics)
    job.deliver({0: 3, 1: 4})
    job.deliver({0: 5})
    got = {s.name: s.value for m in metrics.registry.collect() for s in m.samples}
    assert got["tensorpar_generated_tokens_total"] == 3
    assert got["tensorpar_time_to_first_token_seconds_count"] == 1
    assert got["tensorpar_time_per_output_token_seconds_count"] == 1
