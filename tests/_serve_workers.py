"""Workers for tests/test_serve_engine.py (spawned ranks import them)."""
import copy
import random
import warnings

import torch
import torch.distributed as tdist

from tensorpar import distributed as dist
from tensorpar.apply import parallelize
from tensorpar.jobs.serve_job import Job
from tensorpar.jobs.serve_scheduler import Scheduler
from tensorpar.models.engine import Engine
from tensorpar.models.generation import generate
from tensorpar.models.sampling import Sampler
from tensorpar.models.tiny import make_tiny_model

# generate's sampler cases (tests/_generation_workers.py), greedy twice as often
SAMPLERS = [{}, {"do_sample": True, "temperature": 0.7, "seed": 11}, {},
            {"do_sample": True, "top_k": 5, "top_p": 0.8, "seed": 12},
            {"do_sample": True, "top_p": 0.6, "seed": 13},
            {"do_sample": True, "top_k": 40, "seed": 14},  # wider than a shard at tp 4 (33 columns)
            {"do_sample": True, "temperature": 1.3, "seed": 2 ** 40 + 5}]


def requests(count: int, seed: int = 0, positions: int = 64) -> list:
    """``(prompt, max_tokens, sampler kwargs, n)`` of mixed lengths; every third request draws 2 choices."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(130) for _ in range(rng.randrange(1, 30))]
        out.append((prompt, rng.randrange(1, min(24, positions - len(prompt))), SAMPLERS[i % len(SAMPLERS)],
                    2 if i % 3 == 0 else 1))
    return out


LOGPROBS = (None, 0, None, 3, None, 40)  # request i asks for LOGPROBS[i % 6]; 40 > a shard's 33 columns at tp 4


def run_engine(model, reqs, *, slots: int, step_tokens: int, group=None, logits: bool = False) -> dict:
    """Every request through the scheduler and the engine, all submitted at once (they join as
    slots free up): ``{"tokens": [per request, per choice], "steps", "max_rows",
    "max_prefill_tokens", "logits": {(request, choice, step): the (V,) logits its token came from},
    "logprobs": the engine's log-probabilities against the log-softmax of those logits}`` (with
    ``logits``, requests ask for LOGPROBS)."""
    engine = Engine(model, slots=slots, capacity=64, group=group)
    seen = []
    if logits:  # what each step's choice saw, gathered on every rank
        choose = engine._choose

        def spy(step_logits, draws):
            full = step_logits if engine.head is None else dist.all_gather(step_logits, dim=-1, group=group)
            seen.append(full[:, :engine.vocab].double().clone())
            return choose(step_logits, draws)
        engine._choose = spy
    sched = Scheduler(slots, step_tokens, len(reqs))
    asks = [LOGPROBS[i % len(LOGPROBS)] if logits else None for i in range(len(reqs))]
    jobs = [Job(p, n=n, sampler=Sampler(**s), max_tokens=m, emit=lambda e: None, logprobs=k)
            for (p, m, s, n), k in zip(reqs, asks)]
    for job in jobs:
        sched.submit(job)
    index = {id(j): i for i, j in enumerate(jobs)}
    steps, widest, prefill, chosen_from = 0, 0, 0, {}
    while not sched.idle:
        plan = sched.next_plan(0.0)
        widest = max(widest, len(plan.rows))
        prefill = max(prefill, sum(len(r.ids) for r in plan.rows if len(r.ids) > 1))
        sched.finish(*engine.step(plan))
        for run, draw in (sched._drawn if logits and plan.rows else ()):
            for row, c in draw.members:  # the forward gives every row's last position, in row order
                chosen_from[(index[id(run.job)], c, draw.step)] = seen[-1][row]
        steps += 1
    return {"tokens": [[c.ids for c in j.choices] for j in jobs], "steps": steps, "max_rows": widest,
            "max_prefill_tokens": prefill, "logits": chosen_from, "cache_bytes": engine.cache.nbytes(),
            "logprobs": _check_logprobs(jobs, asks, chosen_from) if logits else None}


def _check_logprobs(jobs, asks, chosen_from) -> dict:
    """Each reported log-probability against torch's log-softmax of the logits its token came
    from, and each list of the most likely against those logits' order (value descending, index
    ascending): the worst difference, the lists that differ, how many tokens were checked."""
    worst, wrong, checked = 0.0, 0, 0
    for i, (job, k) in enumerate(zip(jobs, asks)):
        for c, choice in enumerate(job.choices):
            assert (k is None) == (not choice.logprobs) and (k is None or len(choice.logprobs) == len(choice.ids))
            for step, got in enumerate(choice.logprobs):
                want = torch.log_softmax(chosen_from[(i, c, step)], dim=0)                 # (V,) float64
                order = sorted(range(len(want)), key=lambda t: (-float(want[t]), t))[:k]
                wrong += [t for t, _ in got.top] != order or got.token != choice.ids[step]
                worst = max([worst, abs(got.logprob - float(want[got.token]))]
                            + [abs(lp - float(want[t])) for t, lp in got.top])
                checked += 1
    return {"worst": worst, "wrong": wrong, "checked": checked}


def alone(model, reqs) -> list:
    """What generate makes of each request alone: ``n`` copies of its prompt."""
    return [generate(model, [p] * n, m, **s)[:, len(p):].tolist() for p, m, s, n in reqs]


def engine_worker(count: int) -> dict:
    """tp 2 (ranks [0, 1] and [2, 3]) and tp 4: the engine's tokens for ``count`` requests beside
    generate's on each alone (split model), and the logits the engine chose from beside those of
    generate for the requests that draw greedily, one at a time, on the unsplit model."""
    warnings.filterwarnings("ignore")
    r = tdist.get_rank()
    pairs = [tdist.new_group([0, 1]), tdist.new_group([2, 3])]
    dense = make_tiny_model("llama", seed=3)
    reqs = requests(count)
    out = {}
    for tp, group in ((2, pairs[r // 2]), (4, None)):
        split = parallelize(copy.deepcopy(dense), tp_group=group)
        got = run_engine(split, reqs, slots=8, step_tokens=16, group=group, logits=True)
        got.pop("logits")  # checked here (got["logprobs"]); the tests read the tokens
        out[tp] = {**got, "alone": alone(split, reqs)}
    out["dense_alone"] = alone(dense, reqs) if r == 0 else None
    return out


CHAT_TEMPLATE = ("{% for m in messages %}t3 {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}t4{% endif %}")


def make_served_model(path, *, dtype=torch.float64, **sizes):
    """The tiny Llama (seed 3) as a checkpoint with a word-level tokenizer: token ``i`` is the word
    ``t<i>`` (0 is ``<unk>``), so a text of such words is its token ids, and back; and a chat
    template. Returns the path."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tensorpar.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(Path(path), "llama", seed=3, dtype=dtype, **sizes)
    words = ["<unk>"] + [f"t{i}" for i in range(1, 130)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False}))
    return path


def tokenizer(path):
    """The served model's tokenizer, as the server loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
