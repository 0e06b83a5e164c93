"""Workers for tests/test_models_lean.py (spawned ranks import them)."""
import copy
import warnings

import torch
import torch.distributed as tdist

from tensorpar import distributed as dist
from tensorpar.apply import parallelize
from tensorpar.models.generation import generate
from tensorpar.models.lean import lean_decoder
from tensorpar.models.tiny import make_tiny_model

PROMPTS = [[5, 9, 11, 2, 7, 3, 12], [8, 1], [4, 4, 9, 10]]  # left-padded: the mask matters
NEW = 5
# Llama with every bias on (attention_bias adds o_proj's, which a row split must add once, after
# the sum); Qwen2: query/key/value biases, one KV head (replicated over the ranks at tp 2 and 4);
# Mistral: 8 query heads over 4 KV heads.
CASES = {"llama+bias": ("llama", {"attention_bias": True, "mlp_bias": True}), "qwen2": ("qwen2", {}),
         "mistral": ("mistral", {})}
SAMPLERS = {"greedy": {}, "top_k": {"do_sample": True, "top_k": 4, "temperature": 0.8, "seed": 3}}


def _with_biases(model):
    """Transformers initialises biases to zero, where a bias added twice (or not at all) changes
    nothing: random ones, from a seed, so every rank's dense model is the same."""
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return model


def _records(led) -> list:
    return [(r.op, r.module, tuple(r.shape)) for r in led.records]


def lean_worker():
    """Split at tp 2 (ranks [0, 1] and [2, 3]) and tp 4: the lean forward against the unsplit
    model's own forward, and its collectives against the split model's own forward's."""
    warnings.filterwarnings("ignore")
    r = tdist.get_rank()
    pairs = [tdist.new_group([0, 1]), tdist.new_group([2, 3])]
    out = {}
    for tp, group in ((2, pairs[r // 2]), (4, None)):
        for name, (arch, sizes) in CASES.items():
            dense = _with_biases(make_tiny_model(arch, seed=4, **sizes))
            split = parallelize(copy.deepcopy(dense), tp_group=group)
            case = {"why_not": lean_decoder(split, group)[1]}
            for sname, kw in SAMPLERS.items():
                want, want_logits = generate(dense, PROMPTS, NEW, return_logits=True, engine="hf", **kw)
                with dist.ledger() as lean_led:
                    got = generate(split, PROMPTS, NEW, engine="lean", **kw)
                with dist.ledger() as hf_led:
                    generate(split, PROMPTS, NEW, engine="hf", **kw)
                _, logits = generate(split, PROMPTS, NEW, return_logits=True, engine="lean", **kw)
                case[sname] = {"tokens": got[:, -NEW:].tolist(), "want": want[:, -NEW:].tolist(),
                               "err": max((a - b).abs().max().item() for a, b in zip(logits, want_logits)),
                               "varies": bool((want_logits[0] - want_logits[1]).abs().max() > 1e-3),
                               "lean_records": _records(lean_led), "hf_records": _records(hf_led)}
            _, cache = generate(split, [[3, 4, 5]], 2, engine="lean", return_cache=True)
            case["cache_heads"] = [k.shape[1] for k in cache.k]
            case["dense_kv_heads"] = dense.config.num_key_value_heads
            out[(name, tp)] = case
    return out
