"""Module-level worker functions for tests/test_models_*.py (spawned ranks must import them):
the shared helpers, inference and training; checkpoints and the toy model are in
:mod:`tests._models_checkpoint_workers`.

One launch of 4 ranks covers tp 1, 2, 3 and 4 through sub-groups: tp 1 = [0], tp 2 = [0, 1]
and [2, 3], tp 3 = [0, 1, 2], tp 4 = the world. Every rank builds the dense model from the
same seed, so the reference is local; each rank returns plain data the test asserts on.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from tensorpar import distributed as dist
from tensorpar.apply import parallelize
from tensorpar.models.generation import generate
from tensorpar.models.tiny import make_tiny_model
from tensorpar.models.training import train_step

FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "bert")
DECODERS = ("llama", "mistral", "qwen2", "gpt2")
VOCAB = 130
TP3_DOES_NOT_FIT = ("llama", "mistral")  # 4 and 8 query heads (tiny configs: tensorpar.architecture.registry, Arch.tiny)
# Variants of the tiny models, run at tp 2 only: a tied Llama head; a vocabulary (131) that
# does not divide by 2, padded to 132.
VARIANTS = {"llama_tied": ("llama", {"tie_word_embeddings": True}),
            "gpt2_v131": ("gpt2", {"vocab_size": 131})}


def tiny(name: str, **kw):
    """``make_tiny_model`` of a family or of a :data:`VARIANTS` name."""
    family, sizes = VARIANTS.get(name, (name, {}))
    return make_tiny_model(family, **sizes, **kw)


def tp_groups() -> dict:
    """``{tp: (group, members)}``; every rank calls new_group for every group, in one order."""
    groups = {1: ([0], dist.new_group([0])), 3: ([0, 1, 2], dist.new_group([0, 1, 2]))}
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    r = dist.get_rank()
    groups[2] = ([0, 1] if r < 2 else [2, 3], pair[r // 2])
    groups[4] = ([0, 1, 2, 3], None)
    return {tp: (g, members) for tp, (members, g) in groups.items()}


def _ids(seed, shape=(2, 9)) -> torch.Tensor:
    return torch.randint(2, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _snapshot(model) -> dict:
    """Everything parallelize could change: parameters, module types, hooks, head attributes."""
    attrs = ("num_key_value_groups", "num_heads", "split_size", "num_attention_heads", "all_head_size")
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "types": [(n, type(m).__name__) for n, m in model.named_modules()],
            "hooks": sum(len(m._forward_pre_hooks) for m in model.modules()),
            "heads": [(n, a, getattr(m, a)) for n, m in model.named_modules() for a in attrs if hasattr(m, a)],
            "report": hasattr(model, "tp_report")}


def unchanged(model, snap) -> bool:
    now = _snapshot(model)
    same_state = now["state"].keys() == snap["state"].keys() and all(
        torch.equal(now["state"][k], snap["state"][k]) for k in snap["state"])
    return same_state and all(now[k] == snap[k] for k in ("types", "hooks", "heads", "report"))


def _param_accounting(model, family) -> dict:
    """Per-rank parameter counts, and the vocab shards of the embedding and output head."""
    rep = model.tp_report
    params = list(model.parameters())
    share = sum(p.numel() / p.tp_replicas for p in params)  # summed over the group: dense + padding
    replicated = sum(p.numel() for p in params if p.tp_replicas == rep.tp_size)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    rows = [emb.weight.shape[0]] + ([head.weight.shape[0]] if head is not None else [])
    tied = head is not None and head.weight is emb.weight
    return {"per_rank": rep.params_per_rank, "total": rep.params_total, "share": share,
            "replicated": replicated, "vocab_rows": rows, "tied": tied,
            "vocab_tags": [emb.weight.tp_replicas] + ([head.weight.tp_replicas] if head is not None else [])}


def _whole_matrices(model, dense) -> list[str]:
    """Names of 2-D parameters the split left at their dense shape (independent of tags)."""
    shapes = {n: p.shape for n, p in dense.named_parameters()}
    return sorted(n for n, p in model.named_parameters() if p.dim() == 2 and p.shape == shapes.get(n))


def _forward_case(family, dense, group, tp, ids) -> dict:
    model = parallelize(copy.deepcopy(dense), tp_group=group)
    with torch.no_grad():
        ref = dense(input_ids=ids, output_hidden_states=True)
        out = model(input_ids=ids, output_hidden_states=True)
        with dist.ledger() as led:
            model(input_ids=ids)
    res = {"logits_rel": _rel(out.logits, ref.logits),
           "hidden_rel": max(_rel(a, b) for a, b in zip(out.hidden_states, ref.hidden_states)),
           "params": _param_accounting(model, family), "notes": model.tp_report.notes,
           "fwd_ops": [(r.op, r.phase) for r in led.records], "whole_2d": _whole_matrices(model, dense),
           "counted": sum(p.numel() for p in model.parameters()), "tp_rank": dist.get_rank(group)}
    if family in DECODERS:
        prompt = _ids(7, (2, 5))
        want = generate(dense, prompt, 8, engine="hf")
        got, cache = generate(model, prompt, 8, return_cache=True, engine="hf")
        lean = generate(model, prompt, 8, engine="auto")
        hf = dense.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                            do_sample=False, pad_token_id=0)
        res.update(tokens_equal=torch.equal(got, want) and torch.equal(lean, want), hf_equal=torch.equal(want, hf),
                   cache_heads=cache.layers[0].keys.shape[1], cache_len=cache.layers[0].keys.shape[2])
    if tp > 1:
        with dist.ledger() as led:
            model(input_ids=ids).logits.sum().backward()
        res["bwd_ops"] = [r.op for r in led.records if r.phase == "backward"]
    return res


def _error_case(dense, group) -> dict:
    """tp that does not fit: ValueError naming the valid sizes, and the model untouched."""
    model = copy.deepcopy(dense)
    snap = _snapshot(model)
    try:
        parallelize(model, tp_group=group)
    except ValueError as exc:
        return {"error": str(exc), "unchanged": unchanged(model, snap)}
    return {"error": None, "unchanged": unchanged(model, snap)}


def _frozen_case(group) -> dict:
    """Frozen parameters stay frozen through every style (tp 4: replicated KV heads too)."""
    dense = make_tiny_model("llama")
    for name, p in dense.named_parameters():
        p.requires_grad_(not ("embed_tokens" in name or "k_proj" in name or "down_proj" in name))
    model = parallelize(dense, tp_group=group)
    return {"frozen": sorted(n for n, p in model.named_parameters() if not p.requires_grad),
            "trainable": sum(p.requires_grad for p in model.parameters())}


def _outsider_case(group) -> str | None:
    """A rank outside ``tp_group`` calling parallelize: the ValueError, before any collective."""
    try:
        parallelize(make_tiny_model("gpt2"), tp_group=group)
    except ValueError as exc:
        return str(exc)
    return None


def inference_worker(families=FAMILIES) -> dict:
    """``{(family, tp): result}`` for every case this rank takes part in; the variants at tp 2;
    frozen parameters at tp 4; a parallelize outside the group on the ranks not in [0]."""
    groups, rank, out = tp_groups(), dist.get_rank(), {}
    for family in families:
        dense = make_tiny_model(family)
        ids = _ids(1)
        for tp, (group, members) in groups.items():
            if rank not in members:
                continue
            if tp == 3 and family in TP3_DOES_NOT_FIT:
                out[(family, tp)] = _error_case(dense, group)
            else:
                out[(family, tp)] = _forward_case(family, dense, group, tp, ids)
    for name, (family, _) in VARIANTS.items():
        out[(name, 2)] = _forward_case(family, tiny(name), groups[2][0], 2, _ids(1))
    out["frozen"] = _frozen_case(groups[4][0])
    if rank not in groups[1][1]:
        out["outsider"] = _outsider_case(groups[1][0])
    return out


# ---- training --------------------------------------------------------------------------------

def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def _dense_curve(model, steps, ids, max_norm) -> tuple[list, list]:
    """The single-process reference, in plain torch: full logits, F.cross_entropy, torch's clip."""
    opt, losses, norms = _adamw(model), [], []
    for _ in range(steps):
        opt.zero_grad()
        logits = model(input_ids=ids, use_cache=False).logits  # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        losses.append(loss.item())
    return losses, norms


def _tp_curve(model, steps, ids, max_norm) -> tuple[list, list]:
    opt = _adamw(model)
    runs = [train_step(model, opt, ids, max_norm=max_norm) for _ in range(steps)]
    return [r["loss"] for r in runs], [r["grad_norm"] for r in runs]


def training_worker(cases, steps=20, max_norm=0.5) -> dict:
    """``cases``: ``[(family, tp, dtype_name, members)]``; the group ``members`` runs the case
    (two tp-2 groups run different cases at once); each rank also runs the dense reference."""
    groups, rank, out = tp_groups(), dist.get_rank(), {}
    ids = _ids(3, (4, 16))
    for family, tp, dtype_name, members_wanted in cases:
        group, members = groups[tp]
        if rank not in members or members != members_wanted:
            continue
        dtype = getattr(torch, dtype_name)
        dense = tiny(family, dtype=dtype).train()
        sharded = parallelize(copy.deepcopy(dense), tp_group=group)
        ref_loss, ref_norm = _dense_curve(dense, steps, ids, max_norm)
        tp_loss, tp_norm = _tp_curve(sharded, steps, ids, max_norm)
        out[(family, tp, dtype_name)] = {"ref": ref_loss, "tp": tp_loss, "ref_norm": ref_norm, "tp_norm": tp_norm}
    return out
