"""The decoder task of `tensorpar run`: prompts and generation options checked in the parent,
generated on every rank (and by the unsplit model on rank 0), compared row by row.

The options are :func:`tensorpar.models.generation.generate`'s, under the same names, passed to
it unchanged: several prompts of different lengths (left-padded by ``generate``), ``do_sample``,
``temperature``, ``top_k``, ``top_p``, ``seed``, ``eos_token_id`` (one or several), ``pad_token_id``,
``engine`` (the split model's forward; the unsplit reference always runs its own).
They are checked before any rank starts by the rules ``generate`` applies (its ``Sampler``, its
stop tokens), against the checkpoint's ``config.json``. The split and the unsplit model draw the
same token from the same logits (the same sampler and seed), so each row's tokens must be equal.
"""
from __future__ import annotations

import inspect
from pathlib import Path

import torch

from tensorpar import distributed as dist
from tensorpar.architecture.registry import LEAN_TYPES
from tensorpar.data.tokens import has_tokenizer
from tensorpar.jobs.common import check_length, vocab_size
from tensorpar.models.generation import ENGINES, _stop_ids, generate, prompts
from tensorpar.models.sampling import Sampler

DEFAULT_PROMPT = "Tensor parallelism splits a model across"
SAMPLING = ("do_sample", "temperature", "top_k", "top_p", "seed")
NOT_PREDICTED = ("top-p sampling without top_k gathers every logit at each step (B x V), which the planner "
                 "does not predict: the generation's bytes are recorded, not compared")


# ---- in the parent, before any rank starts -------------------------------------------------------

def generation_task(ckpt, prompt, prompt_ids, max_new_tokens: int, options: dict) -> dict:
    """The spec of a generation run: ``ValueError`` naming the value and its valid range for
    anything a rank would refuse. ``options``: ``generate``'s keyword arguments (see the module)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be a positive integer, got {max_new_tokens!r}")
    vocab = vocab_size(ckpt)
    # generate's own rules (its sampler, its stop tokens), applied here before any rank starts
    Sampler(**{k: options[k] for k in SAMPLING})
    _stop_ids(options["eos_token_id"], vocab)
    pad = options["pad_token_id"]
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < vocab):
        raise ValueError(f"pad_token_id must be a token id in [0, {vocab}), got {pad!r}")
    engine = options.get("engine", "auto")
    if engine not in ENGINES:
        raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "lean" and ckpt.config.get("model_type") not in LEAN_TYPES:
        raise ValueError(f"--engine lean runs {', '.join(LEAN_TYPES)} models; {ckpt.path.name} is a "
                         f"{ckpt.config.get('model_type')!r} model (--engine auto uses its own forward)")
    rows = prompt_rows(ckpt, prompt, prompt_ids)
    check_length(ckpt, max(map(len, rows)) + max_new_tokens, "the longest prompt plus --max-new-tokens")
    return {"task": "generation", "prompt_ids": rows, "max_new_tokens": max_new_tokens,
            "has_tokenizer": has_tokenizer(ckpt.path), "options": dict(options)}


def options_given(options: dict) -> list[str]:
    """The options (as ``--option value``) that differ from ``generate``'s defaults."""
    defaults = inspect.signature(generate).parameters
    return [f"--{k.replace('_', '-')} {v}" for k, v in options.items() if v != defaults[k].default]


def prompt_rows(ckpt, prompt, prompt_ids) -> list[list[int]]:
    """One token-id list per prompt. ``prompt``: a text or a list of texts; ``prompt_ids``: a list
    of token ids or a list of such lists; neither: the default prompt (fixed ids without a tokenizer)."""
    if prompt is not None and prompt_ids is not None:
        raise ValueError("give the prompts as text (--prompt) or as token ids (--prompt-ids), not both")
    if prompt_ids is not None:
        rows, names = _id_rows(prompt_ids), None
    elif prompt is not None or has_tokenizer(ckpt.path):
        texts = [DEFAULT_PROMPT] if prompt is None else [prompt] if isinstance(prompt, str) else list(prompt)
        rows, names = _tokenize(ckpt.path, texts), [f" (--prompt {t!r})" for t in texts]
    else:
        rows, names = [list(range(1, 9))], None  # no tokenizer and no prompt: fixed ids
    vocab = vocab_size(ckpt)
    for i, ids in enumerate(rows):
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if not ids or bad:
            where = names[i] if names else f" (prompt {i + 1} of {len(rows)})" if len(rows) > 1 else ""
            raise ValueError(f"prompt token ids must be a non-empty list of integers in [0, {vocab}); "
                             f"invalid{where}: {bad or ids}")
    return rows


def _id_rows(prompt_ids) -> list[list]:
    """A list of token ids is one prompt; a list of lists, one per list."""
    if not isinstance(prompt_ids, (list, tuple)):
        raise ValueError(f"prompt_ids must be a list of token ids or a list of such lists, got {prompt_ids!r}")
    if prompt_ids and all(isinstance(r, (list, tuple)) for r in prompt_ids):
        return [list(r) for r in prompt_ids]
    if any(isinstance(r, (list, tuple)) for r in prompt_ids):
        raise ValueError(f"prompt_ids mixes token ids and lists of them: {prompt_ids!r}")
    return [list(prompt_ids)]


def _tokenize(path: Path, texts: list) -> list[list[int]]:
    if not texts:
        raise ValueError("need at least one prompt, got []")
    if not all(isinstance(t, str) for t in texts):
        raise ValueError(f"prompt must be a text or a list of texts, got {texts!r}")
    if not has_tokenizer(path):
        raise ValueError(f"{path} has no tokenizer for --prompt; give token ids with --prompt-ids 1,2,3")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    return [tok(t)["input_ids"] for t in texts]


# ---- on every rank ---------------------------------------------------------------------------

@torch.no_grad()
def generate_rows(model, spec) -> dict:
    """The compared forward of the (left-padded) prompts, then ``generate`` under a ledger of its
    own, then again with the logits of every step, off the record. The split model runs
    ``generate``'s default engine (the lean forward where it applies); the unsplit one, the
    reference, its own forward (``engine="hf"``): the comparison shares no forward code."""
    rows, n, options = spec["prompt_ids"], spec["max_new_tokens"], spec["options"]
    if getattr(model, "tp_report", None) is None:
        options = {**options, "engine": "hf"}
    ids, mask = prompts(rows, None, 0, model.config.vocab_size)  # (B, T): the pad id is masked out
    logits = _forward(model, ids, mask)  # (tokens, V): the real positions only
    # Generation's own collectives (one forward per token, each rank's candidates exchanged) go to
    # a ledger of their own, apart from the forward that is compared with the planner.
    with dist.ledger(wire=True) as gen:
        tokens = generate(model, rows, n, **options)
    with dist.ledger():  # a ledger of its own: the gathers made for the comparison are not the run's
        again, steps = generate(model, rows, n, return_logits=True, **options)
    if not torch.equal(again, tokens):
        raise RuntimeError("generate chose other tokens when asked for its logits: it is not deterministic")
    return {"output": logits, "tokens": tokens[:, ids.shape[1]:].tolist(), "input_shape": list(ids.shape),
            "step_logits": torch.stack(steps),  # (n, B, V): what each step chose from
            "generation_bytes_sent": gen.total_bytes_sent(), "generation_wire_bytes_sent": gen.wire_bytes_sent(),
            "generation_collectives": len(gen.records)}


def _forward(model, ids, mask) -> torch.Tensor:
    """Logits ``(tokens, V)`` at the real positions of left-padded rows, positions counted as
    ``generate`` counts them (padded queries see no key: their logits are nobody's)."""
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    kwargs = {"attention_mask": mask, "use_cache": False}
    if "position_ids" in inspect.signature(type(model).forward).parameters:
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # (B, T)
    logits = model(input_ids=ids, **kwargs).logits  # (B, T, V)
    return logits[mask.bool()]  # (tokens, V)


# ---- the report --------------------------------------------------------------------------------

def generation_result(task, rank0, path) -> dict:
    """Per row: prompt, tokens (a stopped row padded), the unsplit model's tokens, how many tokens
    it produced, the worst relative difference of its step logits; the totals; one prompt also
    flat at the top (the keys of a one-prompt run: ``prompt_ids``, ``tokens``, ``dense_tokens``,
    ``text``), several as lists per row."""
    split, dense = rank0["split"]["tokens"], rank0["dense"]["tokens"]
    stops = _stops(task["options"]["eos_token_id"])
    tok = _tokenizer(path) if task["has_tokenizer"] else None
    rows = [_row(i, ids, split[i], dense[i], rank0, stops, tok) for i, ids in enumerate(task["prompt_ids"])]
    flat = (lambda key: rows[0][key]) if len(rows) == 1 else (lambda key: [r[key] for r in rows])
    return {"prompt_ids": flat("prompt_ids"), "tokens": flat("tokens"), "dense_tokens": flat("dense_tokens"),
            "tokens_match": all(r["tokens_match"] for r in rows),
            "decode_max_rel_diff": max(r["decode_max_rel_diff"] for r in rows), "text": flat("text"),
            "generation_collectives": rank0["split"]["generation_collectives"], "steps": len(split[0]),
            "options": task["options"], "rows": rows}


def _row(i, prompt_ids, tokens, dense, rank0, stops, tok) -> dict:
    produced = _produced(tokens, stops)
    return {"prompt_ids": prompt_ids, "tokens": tokens, "dense_tokens": dense, "tokens_match": tokens == dense,
            "new_tokens": produced, "stopped": produced > 0 and tokens[produced - 1] in stops,
            "decode_max_rel_diff": _steps_rel(rank0, i) if tokens == dense else float("inf"),
            "text": tok.decode(prompt_ids + tokens[:produced]) if tok is not None else None}


def _stops(eos_token_id) -> list:
    return [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)


def _produced(tokens: list, stops: list) -> int:
    """Tokens a row produced: up to its first stop token, included (the rest is padding)."""
    return next((j + 1 for j, t in enumerate(tokens) if t in stops), len(tokens))


def _steps_rel(rank0, row: int) -> float:
    """Worst relative difference of row ``row``'s logits over every step (a tiny random model may
    repeat one token whatever its cache holds: equal tokens alone prove little)."""
    s, d = rank0["split"]["step_logits"][:, row].double(), rank0["dense"]["step_logits"][:, row].double()
    return max(((a - b).abs().max() / (b.abs().max() or 1.0)).item() for a, b in zip(s, d))


def _tokenizer(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
