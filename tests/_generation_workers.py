"""Workers for tests/test_models_generation.py (spawned ranks import them)."""
import copy
import warnings

import torch
import torch.distributed as tdist

from tensorpar import distributed as dist
from tensorpar.apply import parallelize
from tensorpar.models.generation import generate
from tensorpar.models.lean import lean_decoder
from tensorpar.models.tiny import make_tiny_model

# Prompts of three lengths; with the seeds below each tiny model's rows continue differently
# (checked in the test: a model that repeats one token whatever happens proves nothing).
PROMPTS = [[5, 9, 11, 2, 7, 3, 12], [8, 1], [4, 4, 9, 10]]
NEW = 6
# GPT-2 at its default initializer range repeats the prompt's last token whatever happens; wider
# weights make it depend on its context (checked by test_the_cases_have_power).
SIZES = {"llama": {}, "gpt2": {"initializer_range": 0.3}}
SAMPLERS = {
    "greedy": {},
    "temperature": {"do_sample": True, "temperature": 0.7, "seed": 11},
    "top_k+top_p": {"do_sample": True, "top_k": 5, "top_p": 0.8, "seed": 12},
    "top_p": {"do_sample": True, "top_p": 0.6, "seed": 13},
    # more than a shard's columns at tp 4 (130 tokens: 33 a rank, 2 of the last rank's past the
    # vocabulary): padding columns among the candidates
    "top_k wider than a shard": {"do_sample": True, "top_k": 40, "seed": 14},
}


def generation_worker(archs):
    """For tp 2 (ranks [0, 1] and [2, 3]) and tp 4: each arch split over the group against the
    unsplit model built from the same seed, every sampler; HF's own generate for greedy rows."""
    warnings.filterwarnings("ignore")
    r = tdist.get_rank()
    out = {}
    pairs = [tdist.new_group([0, 1]), tdist.new_group([2, 3])]
    for tp, group in ((2, pairs[r // 2]), (4, None)):
        for arch in archs:
            dense = make_tiny_model(arch, seed=3, **SIZES[arch])
            split = parallelize(copy.deepcopy(dense), tp_group=group)
            out[(arch, tp)] = _compare(dense, split)
    out["stop"] = _stop_case(pairs[r // 2])
    return out


def _compare(dense, split) -> dict:
    res = {}
    for name, kw in SAMPLERS.items():
        with dist.ledger() as led:
            got = generate(split, PROMPTS, NEW, **kw)
        got_again, split_logits = generate(split, PROMPTS, NEW, return_logits=True, **kw)
        # the expected side through the model's own forward (Hugging Face's), never the lean one under test
        want, dense_logits = generate(dense, PROMPTS, NEW, return_logits=True, engine="hf", **kw)
        _, hf_logits = generate(split, PROMPTS, NEW, return_logits=True, engine="hf", **kw)
        res[name] = {"tokens": got[:, -NEW:].tolist(), "dense_tokens": want[:, -NEW:].tolist(),
                     "same_again": torch.equal(got, got_again),
                     "logits_err": max((a - b).abs().max().item() for a, b in zip(split_logits, dense_logits)),
                     "hf_engine_logits_err": max((a - b).abs().max().item() for a, b in zip(hf_logits, dense_logits)),
                     "dense_logits": [s.tolist() for s in dense_logits],
                     "ops": sorted({(rec.op, rec.module) for rec in led.records if rec.module in ("", "next_token")})}
    width = max(len(p) for p in PROMPTS)  # the same batch as input_ids + attention_mask, padded with 7
    ids = torch.tensor([[7] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    res["tensor_and_mask"] = generate(split, ids, NEW, attention_mask=mask)[:, -NEW:].tolist()
    res["hf_rows"] = [_hf_greedy(dense, [p]) for p in PROMPTS]  # each row alone, by transformers
    res["hf_batch"] = _hf_greedy(dense, PROMPTS)  # left-padded, by transformers
    res["lean_why_not"] = lean_decoder(split, split.tp_report.tp_group)[1]  # "" where the lean forward ran
    return res


def _hf_greedy(model, prompts) -> list:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None  # no stopping and no eos suppression: NEW greedy tokens, as generate here
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             generation_config=config)
    return out[:, -NEW:].tolist()


def _stop_case(group):
    """A stop token that row 0 first produces after its first step: row 0 stops there and is padded,
    the others go on (unless they produce it too)."""
    dense = make_tiny_model("llama", seed=3)
    split = parallelize(copy.deepcopy(dense), tp_group=group)
    free = generate(dense, PROMPTS, NEW, engine="hf")[:, -NEW:]
    row = free[0].tolist()
    stop = next(t for k, t in enumerate(row) if k >= 1 and t not in row[:k])
    got = generate(split, PROMPTS, NEW, eos_token_id=[stop], pad_token_id=0)[:, -NEW:]
    # no pad id: what follows is the first stop token; the second is one no row produces
    other = max(set(range(dense.config.vocab_size)) - set(free.flatten().tolist()))
    default = {name: generate(m, PROMPTS, NEW, eos_token_id=[stop, other])[:, -NEW:].tolist()
               for name, m in (("split", split), ("dense", dense))}
    return free.tolist(), stop, got.tolist(), default
