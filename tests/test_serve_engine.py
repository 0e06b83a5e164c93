"""The serving engine, scheduler and job (tensorpar/models/engine.py, jobs/serve_scheduler.py,
jobs/serve_job.py) without HTTP: 32 requests of mixed lengths, samplers and ``n``, submitted at
once through 8 slots and 16 tokens a step, each equal to ``generate`` on it alone, at tp 1
(in this process), 2 and 4 (one 4-rank launch); the scheduler's continuous batching step by step;
a job's stop strings and held-back text."""
import functools
import random

import pytest
import torch

from tensorpar import distributed as dist
from tensorpar.jobs.serve import cache_bytes
from tensorpar.jobs.serve_job import Job
from tensorpar.jobs.serve_scheduler import QueueFull, Scheduler
from tensorpar.models.engine import Engine, _Layout
from tensorpar.models.engine_plan import Draw, Plan, PlanWire, Row
from tensorpar.models.sampling import Sampler
from tensorpar.models.tiny import make_tiny_model
from tests import _serve_workers as W

# float64: the engine's packed rows sum in another order than generate's batch (other matmul
# shapes, another mask), ~1e-16 relative; 1e-10 is far above that and far below any fault
# (a wrong position or key moves logits by >1e-3 on this model).
LOGITS_TOL = 1e-10


@functools.lru_cache(maxsize=None)
def dense_run():
    model = make_tiny_model("llama", seed=3)
    reqs = W.requests(32)
    return model, reqs, W.run_engine(model, reqs, slots=8, step_tokens=16, logits=True)


@functools.lru_cache(maxsize=None)
def split_runs() -> list:
    return dist.launch(W.engine_worker, 4, 32, deadline=600)


def test_tp1_every_request_equals_generate_alone():
    model, reqs, got = dense_run()
    assert got["tokens"] == W.alone(model, reqs)
    # it was batched: up to 8 requests at a time, prefill chunked within the step's 16 tokens
    assert got["max_rows"] == 8 and got["max_prefill_tokens"] == 16, got
    assert got["steps"] < sum(m for _, m, _, _ in reqs) / 2, got["steps"]


def test_tp1_logits_equal_the_model_on_the_request_alone():
    """Every token's logits (request, choice, step) against the model's own forward on that
    request's prompt and the tokens it drew before."""
    model, reqs, got = dense_run()
    worst = 0.0
    with torch.inference_mode():
        for (i, c, step), seen in got["logits"].items():
            prompt = reqs[i][0] + got["tokens"][i][c][:step]
            want = model(torch.tensor([prompt])).logits[0, -1].double()
            worst = max(worst, float((seen - want).abs().max() / want.abs().max()))
    assert len(got["logits"]) == sum(len(t) for choices in got["tokens"] for t in choices)
    assert worst <= LOGITS_TOL, worst


# float64 log-softmax of the same logits, by torch's kernel against the engine's (on a split
# vocabulary: shards' max and sum of exp merged across ranks): a few ulp of values ~5 in size;
# 1e-12 is far above that and far below a fault (a shard's sum left out moves them by >1e-2).
LOGPROBS_TOL = 1e-12


def test_tp1_logprobs_are_the_log_softmax_of_the_logits_drawn_from():
    got = dense_run()[2]["logprobs"]
    assert got["wrong"] == 0 and got["worst"] <= LOGPROBS_TOL, got
    assert got["checked"] >= 100, got


@pytest.mark.parametrize("tp", [2, 4])
def test_split_logprobs_merge_the_shards_into_the_log_softmax(tp):
    for rank, res in enumerate(split_runs()):
        got = res[tp]["logprobs"]
        assert got["wrong"] == 0 and got["worst"] <= LOGPROBS_TOL, (rank, tp, got)
        assert got["checked"] >= 100, got


@pytest.mark.parametrize("tp", [2, 4])
def test_split_every_request_equals_generate_alone(tp):
    runs = split_runs()
    for rank, res in enumerate(runs):
        got = res[tp]
        assert got["tokens"] == got["alone"], (rank, tp)
        assert got["tokens"] == runs[0]["dense_alone"], (rank, tp)
        assert got["max_rows"] == 8, got["max_rows"]
        # the parent's estimate (tensorpar serve's memory check) is this rank's shard of the cache
        assert got["cache_bytes"] == cache_bytes(dense_run()[0].config.to_dict(), tp, 8, 64, 8), got["cache_bytes"]


def test_the_cases_have_power():
    """Requests differ, sampled ones differ from greedy ones on the same prompt, and each finishes
    at its own max_tokens: equal tokens would otherwise prove little."""
    model, reqs, got = dense_run()
    assert len({tuple(t[0]) for t in got["tokens"]}) >= 30  # two greedy runs of this tiny model converge
    assert [len(t[0]) for t in got["tokens"]] == [m for _, m, _, _ in reqs]
    two = [t for (_, _, s, n), t in zip(reqs, got["tokens"]) if n == 2 and s.get("do_sample")]
    assert any(a != b for a, b in two), "n=2 sampled choices must differ"
    prompt, m, _, _ = reqs[1]
    assert W.alone(model, [(prompt, m, {}, 1)])[0] != got["tokens"][1], "temperature 0.7 drew as greedy"


def test_the_parent_s_cache_estimate_is_the_cache_a_rank_allocates():
    """What `tensorpar serve` checks against the machine's memory before any rank starts."""
    model = make_tiny_model("llama", seed=3, dtype=torch.float32)
    config = model.config.to_dict()
    assert Engine(model, slots=8, capacity=64).cache.nbytes() == cache_bytes(config, 1, 8, 64, 4) == 8 * 24576


def test_any_layout_of_rows_gives_each_row_the_model_s_logits():
    """Random steps (tp 1): rows of 1-5 tokens in random slots and orders, slots restarted at
    random, decode rows packed first in slots 0, 1, .. or not: each row's logits against the
    model's forward on its slot's tokens so far. The scheduler's own steps are mostly packed
    (test_tp1_logits_...); this reaches the scatter path and the mixes it rarely makes."""
    model = make_tiny_model("llama", seed=3)
    engine = Engine(model, slots=6, capacity=64)
    rng, seen, worst, kinds = random.Random(0), [[] for _ in range(6)], 0.0, set()
    for _ in range(120):
        rows = []
        for s in rng.sample(range(6), rng.randint(1, 6)):
            if len(seen[s]) > 55 or rng.random() < 0.1:
                seen[s] = []
            T = 1 if seen[s] and rng.random() < 0.7 else rng.randint(1, 5)
            rows.append(Row(s, len(seen[s]), tuple(rng.randrange(130) for _ in range(T))))
            seen[s] += rows[-1].ids
        rows.sort(key=lambda r: (len(r.ids) > 1, r.slot if rng.random() < 0.7 else -r.slot))
        with torch.inference_mode():
            got = engine._forward(tuple(rows)).double()
            for r, g in zip(rows, got):
                want = model(torch.tensor([seen[r.slot][:r.start + len(r.ids)]])).logits[0, -1].double()
                worst = max(worst, float((g - want).abs().max() / want.abs().max()))
        kinds.add(_Layout(rows, [len(r.ids) for r in rows]).packed)
    assert worst <= LOGITS_TOL and kinds == {True, False}, (worst, kinds)


def test_the_plan_wire_is_lossless_and_bounded():
    """What rank 0 sends is what every rank runs: random plans (samplers of every kind, seeds up
    to 2**63 - 1, logprobs, stop) through encode and decode; a plan past the bounds is refused."""
    rng = random.Random(1)
    samplers = [Sampler(), Sampler(do_sample=True, temperature=0.7, top_k=5, top_p=0.8, seed=2 ** 63 - 1),
                Sampler(do_sample=True, temperature=1.3, seed=rng.randrange(2 ** 63)), Sampler(do_sample=True, top_p=0.6)]
    for _ in range(50):
        rows = tuple(Row(rng.randrange(8), rng.randrange(60), tuple(rng.randrange(130) for _ in range(rng.randint(1, 4))))
                     for _ in range(rng.randint(0, 8)))
        draws = tuple(Draw(rng.choice(samplers), rng.randrange(50), 2, ((rng.randrange(8), rng.randrange(2)),) * rng.randint(1, 2),
                           rng.choice([None, 0, 3])) for _ in range(rng.randint(0, 4)))
        plan = Plan(rows, draws, rng.random() < 0.1)
        assert PlanWire.decode(PlanWire.encode(plan)) == plan
        assert len(PlanWire.encode(plan)) <= PlanWire(8, 32).size
    wide = Plan(tuple(Row(s, 0, (1,) * 5) for s in range(8)))  # 8 rows of 5 tokens: past 4 slots, 4 tokens
    with pytest.raises(ValueError, match="needs 68 words; the wire holds 64"):
        PlanWire(4, 4).words(wide)


# ---- the scheduler, step by step (no model: the tokens are made up) -------------------------------

def _job(prompt, max_tokens, n=1, **kw):
    events = []
    return Job(prompt, n=n, sampler=Sampler(), max_tokens=max_tokens, emit=events.append, **kw), events


def _rows(plan):
    return [(r.slot, r.start, len(r.ids)) for r in plan.rows]


def test_requests_join_between_steps_prefill_is_chunked_and_slots_are_reused():
    s = Scheduler(slots=2, step_tokens=4, max_queue=4)
    a, _ = _job([1, 2, 3], max_tokens=3)
    s.submit(a)
    assert _rows(s.next_plan(0)) == [(0, 0, 3)]
    s.finish([[7]])
    b, _ = _job([4, 5, 6, 7, 8, 9], max_tokens=1)
    c, _ = _job([1, 1], max_tokens=1)
    s.submit(b)
    s.submit(c)
    # b joins the running batch: a's decode row first, then 3 of b's 6 prompt tokens (4 - 1)
    plan = s.next_plan(0)
    assert _rows(plan) == [(0, 3, 1), (1, 0, 3)] and len(plan.draws) == 1
    assert plan.rows[0].ids == (7,)
    s.finish([[8]])
    plan = s.next_plan(0)
    assert _rows(plan) == [(0, 4, 1), (1, 3, 3)] and len(plan.draws) == 2  # b's prompt done: its first token
    s.finish([[9], [5]])  # a reaches max_tokens 3, b its 1: both slots free
    assert [ch.ids for ch in a.choices] == [[7, 8, 9]] and (s.queue_depth, s.running) == (1, 0)
    assert _rows(s.next_plan(0)) == [(0, 0, 2)]  # c waited for a slot and takes the lowest
    s.finish([[3]])
    assert s.idle


def test_a_cancelled_request_frees_its_slot_at_the_next_step():
    s = Scheduler(slots=1, step_tokens=2, max_queue=4)
    a, events = _job([1, 2], max_tokens=50)
    b, _ = _job([3], max_tokens=1)
    s.submit(a)
    s.submit(b)
    s.next_plan(0)
    s.finish([[5]])
    a.cancel()
    assert _rows(s.next_plan(0)) == [(0, 0, 1)]  # b in a's slot, a gone
    assert events == [("delta", 0, "", [5], None)]


def test_the_queue_is_bounded():
    s = Scheduler(slots=1, step_tokens=1, max_queue=2)
    for _ in range(2):
        s.submit(_job([1], 1)[0])
    with pytest.raises(QueueFull, match="--max-queue 2"):
        s.submit(_job([1], 1)[0])
    with pytest.raises(ValueError, match=r"max tokens in flight \(3\) must be at least the batch size \(4\)"):
        Scheduler(slots=4, step_tokens=3, max_queue=1)


def test_a_stop_string_across_tokens_is_held_back_and_cut():
    letters = "abcdefgh"
    job, events = _job([0], max_tokens=10, stop_texts=("cd",), decode=lambda ids: "".join(letters[i] for i in ids))
    assert [job.deliver({0: t}) for t in (0, 1, 2)] == [set(), set(), set()]
    assert events == [("delta", 0, "a", [0], None), ("delta", 0, "b", [1], None),
                      ("delta", 0, "", [2], None)]  # "c" may begin "cd"
    assert job.deliver({0: 3}) == {0}
    assert events[3:] == [("delta", 0, "", [3], None), ("finish", 0, "stop")]  # the text before the stop string only


def test_a_stop_token_and_max_tokens_end_a_choice():
    job, events = _job([0], max_tokens=3, n=2, stop_ids=(2,), decode=lambda ids: " ".join(map(str, ids)))
    assert job.deliver({0: 5, 1: 2}) == {1}
    assert job.deliver({0: 6}) == set() and job.deliver({0: 2 + 5}) == {0}
    finishes = [e for e in events if e[0] == "finish"]
    assert finishes == [("finish", 1, "stop"), ("finish", 0, "length")]
    assert "".join(e[2] for e in events if e[0] == "delta" and e[1] == 0) == "5 6 7"
    assert [e[2] for e in events if e[0] == "delta" and e[1] == 1] == [""]  # the stop token is not text
