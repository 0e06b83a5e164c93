"""`tensorpar serve` as a user runs it (the CLI in a process of its own, its ranks launched), with
the official ``openai`` client: 32 concurrent requests of mixed lengths, samplers, ``n``, stop
strings, stop tokens and ``max_tokens``, some streamed, each equal to ``generate`` on it alone
(float64, the tiny Llama, at tp 1, 2 and 4: one server each, tp 2 through the CLI); log-probabilities
against the model's own; a client that disconnects
mid-stream frees its slot; an API key; SIGTERM drains the streams in flight and exits 0; a rank
that dies ends the server with a named error and no process left; bad command lines."""
import asyncio
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2
import openai
import pytest
import torch

from tensorpar.distributed.launcher import RankFailedError
from tensorpar.jobs.serve import ServeOptions, serve
from tensorpar.models.generation import generate
from tensorpar.models.tiny import make_tiny_model
from tests import _serve_workers as W
from tests._cli_batch import run_all

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
START_S = 120  # a server's start: the ranks' launch and load, on 2 shared cores
EOS = 2  # the tiny checkpoint's eos_token_id: a choice ends there, as generate's rows do with it

# Bad command lines: (argv, words of the one line on stderr); {m} is the served model, {port} a
# port another socket holds.
SERVE_ERRORS = [
    (["serve", "--model", "{m}", "--tp", "3"], "tp_size (3) must divide"),
    (["serve", "--model", "{m}", "--max-batch", "0"], "--max-batch must be an integer >= 1, got 0"),
    (["serve", "--model", "{m}", "--max-queue", "-1"], "--max-queue must be an integer >= 0, got -1"),
    (["serve", "--model", "{m}", "--max-batch", "8", "--max-tokens-in-flight", "4"],
     "--max-tokens-in-flight must be an integer >= 8 (at least --max-batch (8)"),
    (["serve", "--model", "{m}", "--max-model-len", "65"], "--max-model-len 65 is more than this model's 64 positions"),
    (["serve", "--model", "{m}", "--max-batch", "100000000", "--max-tokens-in-flight", "100000000"],
     "the KV cache of --max-batch 100000000 slots x 64 positions takes 2288.8 GiB over 1 rank(s), more than"),
    (["serve", "--model", "{m}", "--port", "70000"], "--port must be in 0..65535 (0: any free port), got 70000"),
    (["serve", "--model", "{m}", "--port", "{port}"], "cannot listen on 127.0.0.1:{port}: Address already in use"),
    (["serve", "--model", "{m}", "--host", "no-such-host.invalid"], "--host 'no-such-host.invalid' is not an address"),
    (["serve", "--model", "{m}", "--api-key", ""], "--api-key '' is empty"),
    (["serve", "--model", "{m}", "--dtype", "float8"], "float8"),
    (["serve", "--model", "/nonexistent/dir"], "model directory '/nonexistent/dir' does not exist"),
]


class Server:
    """``tensorpar serve`` started with ``args``; ``info``: its ready line (url, pids)."""

    def __init__(self, model, *args):
        cmd = [sys.executable, "-m", "tensorpar", "serve", "--model", str(model), "--port", "0", "--json",
               "--dtype", "float64", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                                     cwd=ROOT)
        self.info = json.loads(self._line(START_S))
        self.url = self.info["url"]

    def _line(self, timeout: float) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            self.stop()
            raise AssertionError(f"no ready line within {timeout} s: {self.proc.stderr.read()}")
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        return line

    def metric(self, name: str) -> float:
        auth = {"Authorization": f"Bearer {self.key}"}
        for line in httpx2.get(f"{self.url}/metrics", headers=auth).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class InProcess(Server):
    """:func:`tensorpar.jobs.serve.serve` in a thread of this process (its imports and fork server
    already warm: a CLI process pays ~30 s of imports on the shared cores); ``outcome``: what
    serve returned or raised."""

    def __init__(self, model, tp: int, **opts):
        ready, self.halt, self.outcome = threading.Event(), threading.Event(), {}

        def run():
            try:
                self.outcome["summary"] = serve(ServeOptions(str(model), tp=tp, port=0, dtype="float64", **opts),
                                                on_ready=lambda info: (self.__dict__.update(info=info), ready.set()),
                                                stop=self.halt)
            except BaseException as exc:
                self.outcome["error"] = exc
            ready.set()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(START_S), f"no ready line within {START_S} s"
        assert "error" not in self.outcome, self.outcome
        self.url = self.info["url"]

    def stop(self) -> None:
        self.halt.set()
        self.thread.join(60)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return W.make_served_model(tmp_path_factory.mktemp("served") / "m")


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def server(request, served):
    """One server a tp: tp 2 through the CLI, ending with SIGTERM; tp 1 (an API key) and tp 4
    (ending with a rank killed) in this process."""
    tp, key = request.param, ("sesame" if request.param == 1 else None)
    sizes = {"max_batch": 8, "max_tokens_in_flight": 16, "max_queue": 64}
    if tp == 2:
        s = Server(served, "--tp", "2", *[f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()])
    else:
        s = InProcess(served, tp, api_key=key, **sizes)
    s.tp, s.key = tp, key or "none"
    yield s
    s.stop()


# ---- what each request gets alone ------------------------------------------------------------------

def _cases() -> list:
    """W.requests(32) with a stop string on every fourth (a word its greedy continuation holds
    on the dense model, or one that never comes), stop_token_ids on every fifth, every other one streamed."""
    out = []
    for i, (prompt, m, s, n) in enumerate(W.requests(32, seed=5)):
        out.append({"prompt": prompt, "max_tokens": m, "sampler": s, "n": n, "stream": i % 2 == 1,
                    "stop": None, "stop_ids": [7, 11] if i % 5 == 2 else []})
    return out


@pytest.fixture(scope="module")
def expected(served):
    """Per case, per choice: (token ids, text, finish reason) of generate on it alone, cut as the
    server must cut it: at the first stop token (kept in the ids) or stop string (text before it)."""
    model = make_tiny_model("llama", seed=3)
    tok = W.tokenizer(served)
    cases, out = _cases(), []
    for i, c in enumerate(cases):
        rows = generate(model, [c["prompt"]] * c["n"], c["max_tokens"], **c["sampler"])[:, len(c["prompt"]):]
        if i % 4 == 0:  # the text of the greedy row's 3rd token, when it has one (else one that never comes)
            words = _text(tok, rows[0].tolist()).split()
            c["stop"] = [words[2] + " ", "t999"] if len(words) > 3 else ["t999"]
        out.append([_cut(row.tolist(), c, tok) for row in rows])
    return cases, out


def _cut(ids, case, tok):
    for k in range(1, len(ids) + 1):
        if ids[k - 1] in case["stop_ids"] + [EOS]:
            return ids[:k], _text(tok, ids[:k - 1]), "stop"
        text = _text(tok, ids[:k])
        found = [text.find(s) for s in case["stop"] or () if s in text]
        if found:
            return ids[:k], text[:min(found)], "stop"
    return ids, _text(tok, ids), "length"


def _text(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True)  # as the server decodes: <unk> (0) is special


async def _ask(client, c) -> list:
    """One case through the openai client: per choice (token ids, text, finish reason)."""
    kw = dict(model="m", prompt=c["prompt"], max_tokens=c["max_tokens"], n=c["n"], stop=c["stop"],
              temperature=c["sampler"].get("temperature", 1.0) if c["sampler"].get("do_sample") else 0,
              top_p=c["sampler"].get("top_p", 1.0), seed=c["sampler"].get("seed", 0),
              extra_body={"top_k": c["sampler"].get("top_k", -1), "stop_token_ids": c["stop_ids"]})
    got = [[[], "", None] for _ in range(c["n"])]
    if not c["stream"]:
        r = await client.completions.create(**kw)
        for ch in r.choices:
            got[ch.index] = [ch.token_ids, ch.text, ch.finish_reason]
        return [tuple(g) for g in got]
    async for chunk in await client.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            g = got[ch.index]
            g[0] += getattr(ch, "token_ids", None) or []
            g[1] += ch.text
            g[2] = ch.finish_reason or g[2]
    return [tuple(g) for g in got]


async def _ask_all(url, key, cases) -> list:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120) as client:
        return await asyncio.gather(*(_ask(client, c) for c in cases))


def test_32_concurrent_requests_each_equal_generate_alone(server, expected):
    cases, want = expected
    t0 = server.metric("tensorpar_batch_rows_count")
    got = asyncio.run(_ask_all(server.url, server.key, cases))
    for i, (g, w) in enumerate(zip(got, want)):
        assert [tuple(x) for x in g] == [tuple(x) for x in w], (server.tp, i, cases[i])
    steps = server.metric("tensorpar_batch_rows_count") - t0
    tokens = sum(len(ids) for w in want for ids, _, _ in w)
    assert steps < tokens / 3, (steps, tokens)  # batched: many requests' tokens per step


def test_the_cases_have_power(expected):
    cases, want = expected
    reasons = [r for w in want for _, _, r in w]
    assert reasons.count("stop") >= 4 and reasons.count("length") >= 16, reasons
    cut_by_string = [i for i, c in enumerate(cases) if c["stop"] and c["stop"] != ["t999"] and want[i][0][2] == "stop"]
    assert len(cut_by_string) >= 3, cut_by_string
    assert sum(c["stream"] for c in cases) >= 10 and any(c["n"] == 2 and c["stream"] for c in cases)


def test_chat_streams_generate_on_the_chat_template(server, served):
    if server.tp != 1:
        pytest.skip("one server is enough")
    messages = [{"role": "system", "content": "t7 t8"}, {"role": "user", "content": "t9 t10 t11"}]
    ids = W.tokenizer(served).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    row = generate(make_tiny_model("llama", seed=3), [ids], 6)[0, len(ids):].tolist()
    want = _cut(row, {"stop_ids": [], "stop": None}, W.tokenizer(served))

    async def ask():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.key, max_retries=0) as client:
            got, text, usage, reason = [], "", None, None
            async for chunk in await client.chat.completions.create(
                    model="m", messages=messages, max_tokens=6, temperature=0, stream=True,
                    stream_options={"include_usage": True}):
                for ch in chunk.choices:
                    got += getattr(ch, "token_ids", None) or []
                    text += ch.delta.content or ""
                    reason = ch.finish_reason or reason
                usage = chunk.usage or usage
            return got, text, reason, usage
    got, text, reason, usage = asyncio.run(ask())
    assert (got, text, reason) == want, (got, text, reason, want)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(want[0]))


# float64 throughout: the server's log-softmax of its packed rows' logits against torch's of the
# model's forward on the request alone; the logits agree to ~1e-15 relative (LOGITS_TOL of
# test_serve_engine.py is 1e-10), log-probabilities of size ~5 to a few 1e-15: 1e-9 is far below
# a fault (the tempered distribution, a shard's sum left out: >1e-2).
LOGPROBS_TOL = 1e-9


def _model_logprobs(prompt, ids):
    """The dense model's log-softmax (V,) before each of ``ids``."""
    model = make_tiny_model("llama", seed=3)
    with torch.inference_mode():
        logits = model(torch.tensor([list(prompt) + list(ids)])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, dim=-1)


def _top(want, k):
    return sorted(range(want.shape[0]), key=lambda t: (-float(want[t]), t))[:k]


def test_logprobs_are_the_model_s_own_in_openai_s_formats(server, served):
    """Completions (logprobs: 3, whole; logprobs: 0 streamed, sampled at temperature 1.7: the
    model's distribution, not the tempered one) and chat (top_logprobs: 2)."""
    tok = W.tokenizer(served)
    text = lambda t: tok.decode([t])  # noqa: E731
    prompt = [5, 9, 17, 3]

    async def ask():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.key, max_retries=0) as client:
            whole = await client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0,
                                                    logprobs=3, extra_body={"stop_token_ids": []})
            streamed = {"ids": [], "tokens": [], "lps": [], "tops": []}
            async for chunk in await client.completions.create(model="m", prompt=prompt, max_tokens=6, seed=4,
                                                               temperature=1.7, logprobs=0, stream=True,
                                                               extra_body={"stop_token_ids": []}):
                for ch in chunk.choices:
                    streamed["ids"] += getattr(ch, "token_ids", None) or []
                    if ch.logprobs is not None:
                        streamed["tokens"] += ch.logprobs.tokens
                        streamed["lps"] += ch.logprobs.token_logprobs
                        streamed["tops"] += ch.logprobs.top_logprobs
            chat = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "t9 t10"}],
                                                        max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
            return whole, streamed, chat
    whole, streamed, chat = asyncio.run(ask())

    ch = whole.choices[0]
    ids, lp = ch.token_ids, ch.logprobs
    want = _model_logprobs(prompt, ids)
    assert len(ids) == 6 and lp.tokens == [text(t) for t in ids]
    assert max(abs(g - float(w[t])) for g, w, t in zip(lp.token_logprobs, want, ids)) <= LOGPROBS_TOL
    for got, w, t in zip(lp.top_logprobs, want, ids):  # the 3 most likely and the drawn one
        assert set(got) == {text(u) for u in _top(w, 3) + [t]}, (got, _top(w, 3))
        assert all(abs(got[text(u)] - float(w[u])) <= LOGPROBS_TOL for u in _top(w, 3) + [t])
    offsets = [len(tok.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids))]
    assert lp.text_offset == offsets, (lp.text_offset, offsets)

    sampled = streamed["ids"]
    want = _model_logprobs(prompt, sampled)
    assert len(sampled) == 6 and streamed["tokens"] == [text(t) for t in sampled]
    assert [list(t) for t in streamed["tops"]] == [[text(t)] for t in sampled]
    assert max(abs(g - float(w[t])) for g, w, t in zip(streamed["lps"], want, sampled)) <= LOGPROBS_TOL
    assert any(float(w[t]) < float(w.max()) for w, t in zip(want, sampled)), "every sampled token was greedy's"

    ids = W.tokenizer(served).apply_chat_template([{"role": "user", "content": "t9 t10"}], add_generation_prompt=True,
                                                  tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    drawn = chat.choices[0].token_ids
    want = _model_logprobs(ids, drawn)
    content = chat.choices[0].logprobs.content
    assert [e.token for e in content] == [text(t) for t in drawn] and len(drawn) == 4
    for e, w, t in zip(content, want, drawn):
        assert abs(e.logprob - float(w[t])) <= LOGPROBS_TOL and e.bytes == list(text(t).encode())
        assert [x.token for x in e.top_logprobs] == [text(u) for u in _top(w, 2)]
        assert all(abs(x.logprob - float(w[u])) <= LOGPROBS_TOL for x, u in zip(e.top_logprobs, _top(w, 2)))


def _stream_lines(url, body, headers=None):
    """An open streaming response (a context manager) and its data lines."""
    client = httpx2.Client(timeout=60)
    response = client.stream("POST", f"{url}/v1/completions", json=body, headers=headers or {})
    return client, response


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    if server.tp != 2:
        pytest.skip("one server is enough")
    before = server.metric("tensorpar_generated_tokens_total")
    client, response = _stream_lines(server.url, {"prompt": [5], "max_tokens": 60, "stream": True,
                                                  "temperature": 0, "stop_token_ids": []})
    with client, response as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 10
    while server.metric("tensorpar_running_requests") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("tensorpar_running_requests") == 0
    drawn = server.metric("tensorpar_generated_tokens_total") - before
    assert 1 <= drawn < 60, drawn  # it stopped before its 60 tokens
    # greedy: without a temperature a request samples (OpenAI's default of 1) with a random seed,
    # and may draw the end-of-sequence token first (about 1 run in 100 on this model)
    r = httpx2.post(f"{server.url}/v1/completions", json={"prompt": [5], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [18, 128]  # generate's


def test_it_listens_on_127_0_0_1_unless_told(server):
    if server.tp != 2:
        pytest.skip("the CLI's default")
    assert server.info["host"] == "127.0.0.1" and server.url.startswith("http://127.0.0.1:"), server.info


def test_an_api_key_is_needed(server):
    if server.tp != 1:
        pytest.skip("the tp 1 server has a key")
    with pytest.raises(openai.AuthenticationError):
        asyncio.run(_ask_all(server.url, "sesam", _cases()[:1]))
    assert httpx2.get(f"{server.url}/health").status_code == 401


def _gone(pids, timeout=10.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and _state(p) != "Z"]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def _state(pid) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_sigterm_finishes_the_streams_in_flight_then_exits_0(server):
    if server.tp != 2:
        pytest.skip("the tp 2 server ends this way")
    client, response = _stream_lines(server.url, {"prompt": [9, 4], "max_tokens": 40, "stream": True,
                                                  "temperature": 0, "stop_token_ids": []})
    with client, response as r:
        lines = r.iter_lines()
        first = next(lines)
        server.proc.send_signal(signal.SIGTERM)
        rest = [ln for ln in lines if ln]
    chunks = [json.loads(ln[6:]) for ln in [first] + rest[:-1]]
    assert rest[-1] == "data: [DONE]"
    assert sum(len(c["choices"][0].get("token_ids", [])) for c in chunks) == 40
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(30) == 0, server.proc.stderr.read()
    assert json.loads(server.proc.stdout.readline())["event"] == "stopped"
    assert _gone(server.info["pids"]) == []
    with pytest.raises(httpx2.ConnectError):
        httpx2.get(f"{server.url}/health")


def test_a_rank_that_dies_ends_the_server_named(server):
    if server.tp != 4:
        pytest.skip("the tp 4 server ends this way")
    os.kill(server.info["pids"][3], signal.SIGKILL)
    t0 = time.monotonic()
    server.thread.join(60)
    took = time.monotonic() - t0
    error = server.outcome.get("error")
    assert isinstance(error, RankFailedError) and "rank 3" in str(error) and "SIGKILL" in str(error), error
    assert took < 30, took  # the launcher's watch, not a collective's timeout (120 s)
    assert _gone(server.info["pids"]) == []


def test_under_torchrun_each_process_is_a_rank_and_rank_0_serves(served, expected):
    """torchrun starts the ranks (2 processes, tp 2); SIGTERM to torchrun reaches each, they
    drain and stop; one ready line and one stopped line on stdout (rank 0's)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "tensorpar",
           "serve", "--model", str(served), "--tp", "2", "--port", "0", "--json", "--dtype", "float64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
                            start_new_session=True)
    try:
        s = Server.__new__(Server)
        s.proc, s.key = proc, "none"
        s.info = json.loads(s._line(START_S))
        cases, want = expected
        got = asyncio.run(_ask_all(s.info["url"], "none", cases[:4]))
        assert [[tuple(x) for x in g] for g in got] == [[tuple(x) for x in w] for w in want[:4]]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert [json.loads(line)["event"] for line in out.splitlines()] == ["stopped"], out
    assert _gone(s.info["pids"]) == []


@pytest.fixture(scope="module")
def error_runs(served):
    """Each bad command line through ``tensorpar.cli.main`` in this process, as the entry point
    calls it (a process each would pay the imports again): ``(fill, [{"rc", "stdout", "stderr"}])``."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        fill = {"m": str(served), "port": str(held.getsockname()[1])}
        runs = run_all([[a.format(**fill) for a in args] for args, _ in SERVE_ERRORS])
    return fill, runs


@pytest.mark.parametrize("case", range(len(SERVE_ERRORS)))
def test_bad_command_lines_are_one_line_with_exit_code_2(error_runs, case):
    fill, runs = error_runs
    run, words = runs[case], SERVE_ERRORS[case][1].format(**fill)
    assert run["rc"] == 2, run["stderr"]
    lines = [ln for ln in run["stderr"].splitlines() if ln.strip()]
    assert len(lines) == 1 and words in lines[0], run["stderr"]
    assert run["stdout"] == ""
