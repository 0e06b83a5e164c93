"""Generation with a KV cache, sharded or not: batches of prompts of different lengths, greedy or
sampled decoding, stop tokens.

Under tensor parallelism each rank's attention modules hold only their own heads, so the
Hugging Face cache each rank builds holds only its own KV heads: ``1/tp`` of the dense cache
(or one replicated KV head per rank when ``n_kv_heads < tp``). Per step, on each rank:

- one forward of the new tokens (the whole prompts at the first step), with the output head
  applied to the last position only (``logits_to_keep=1``) and its logits left sharded by
  vocabulary: one all-reduce per attention and MLP block, no gather of ``B x V`` logits;
- one all-gather of each rank's candidates, ``B x tp x k`` (value, index) pairs as float64
  (16 bytes each; ``k = 1`` for greedy, ``top_k`` when sampling with it), from which every rank
  computes the same next token (:mod:`tensorpar.models.sampling`): no broadcast. Plain
  sampling (no ``top_k``, no ``top_p``) offers each shard's best Gumbel-perturbed score, one
  candidate; ``top_p`` without ``top_k`` gathers the vocabulary shards instead (the nucleus
  needs every probability).

Prompts of different lengths are left-padded: ``attention_mask`` marks the real tokens, and
positions count real tokens only (``cumsum(mask) - 1``, as Hugging Face's ``generate``), so each
row is continued as if it were alone.
"""
from __future__ import annotations

import contextlib
import inspect

import torch

from tensorpar import distributed as dist
from tensorpar.models.lean import lean_decoder
from tensorpar.models.sampling import Sampler, choose, gumbel
from tensorpar.nn.layers import ColumnParallelLinear
from tensorpar.sharding.audit import check_same_inputs
from tensorpar.sharding.pipelined import PipelinedModel

ENGINES = ("auto", "lean", "hf")


@torch.no_grad()
def generate(model, input_ids, max_new_tokens: int, *, attention_mask: torch.Tensor | None = None,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0,
             seed: int = 0, eos_token_id=None, pad_token_id: int | None = None,
             return_cache: bool = False, return_logits: bool = False, engine: str = "auto"):
    """``(B, T + n)`` token ids: the (left-padded) prompts followed by up to ``max_new_tokens`` tokens,
    on the model's device (prompts given on another device, or as lists, are moved there).

    ``model``: a Hugging Face causal LM, dense or parallelized (its tp group is taken from
    ``model.tp_report``). ``input_ids``: a ``(B, T)`` long tensor (with ``attention_mask``, 1 for
    real tokens, 0 for left padding) or a list of token-id lists of any lengths (padded here);
    the longest prompt plus ``max_new_tokens`` within the model's ``max_position_embeddings``.
    ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``: see
    :mod:`tensorpar.models.sampling` (greedy by default). ``eos_token_id``: a stop token or a
    list of them; a row that produced one continues with ``pad_token_id`` (default: the first
    stop token), and generation ends when every row has stopped. ``return_cache``: also return
    this rank's KV cache. ``return_logits``: also return the full logits each step chose from,
    ``[(B, V), ...]`` (gathered for the purpose on a split model: what a comparison of two
    models must look at, since tiny random models often repeat one token whatever happens).
    ``engine``: ``"lean"`` runs the forward of :mod:`tensorpar.models.lean` (Llama-family models;
    ValueError saying why for another), ``"hf"`` the model's own forward, ``"auto"`` the lean one
    where it applies. Both compute the model's function; the lean one spends far less Python per
    step. ``return_cache`` gives a Hugging Face cache or a :class:`~tensorpar.models.lean.LeanCache`
    (made under ``torch.inference_mode``: readable anywhere, writable only there).

    A model cut into pipeline stages is refused (``ValueError``): load it without them.
    """
    if isinstance(model, PipelinedModel):
        raise ValueError("generate does not run a model cut into pipeline stages (each decode step would pass "
                         "through every stage in turn); load or parallelize the model without pipeline stages "
                         "(pipeline=None, tp and dp only) to generate")
    vocab = _vocab_size(model)
    stops = _stop_ids(eos_token_id, vocab)
    if pad_token_id is not None and (isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int)
                                     or not 0 <= pad_token_id < vocab):
        raise ValueError(f"pad_token_id must be a token id in [0, {vocab}), got {pad_token_id!r}")
    pad = pad_token_id if pad_token_id is not None else (stops[0] if stops else 0)
    ids, mask = prompts(input_ids, attention_mask, pad, vocab)
    device = _device(model)
    ids, mask = ids.to(device), mask.to(device)  # the tokens live where the model computes
    _check_count(max_new_tokens)
    _check_positions(model, mask, max_new_tokens)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    sampler = Sampler(do_sample, temperature, top_k, top_p, seed)
    report = getattr(model, "tp_report", None)
    group = report.tp_group if report is not None and report.tp_size > 1 else False
    if group is not False:  # ranks given different prompts or settings would decode a model no one has
        check_same_inputs(group, input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                          sampler=repr(sampler), stops=repr((stops, pad)), engine=engine)
    step = _Stepper(model, group, padded=bool((mask == 0).any()), engine=engine,
                    capacity=ids.shape[1] + max_new_tokens)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # (B, T): real tokens counted
    new, new_pos, cache = ids, positions, None
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    stop_ids = torch.tensor(stops, dtype=torch.long, device=device)
    logits_seen = []
    for t in range(max_new_tokens):
        (values, indices, perturbed), full, cache = step(new, mask, new_pos, cache, sampler, t, vocab, return_logits)
        if return_logits:
            logits_seen.append(full)
        nxt = choose(values, indices, sampler, t, vocab, perturbed=perturbed)  # (B,): the same on every rank
        if stops:
            nxt = nxt.masked_fill(done, pad)
            done |= torch.isin(nxt, stop_ids)
        new, new_pos = nxt[:, None], new_pos[:, -1:] + 1  # (B, 1): the cache holds the rest
        ids, mask = torch.cat([ids, new], dim=1), torch.cat([mask, torch.ones_like(new)], dim=1)
        if stops and bool(done.all()):
            break
    extra = (cache,) * return_cache + (logits_seen,) * return_logits
    return (ids, *extra) if extra else ids


def prompts(input_ids, attention_mask, pad: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)``, both ``(B, T)`` long: lists left-padded with ``pad``, tensors checked."""
    if isinstance(input_ids, str):
        raise ValueError(f"input_ids must be token ids, got a str ({input_ids[:30]!r}): tokenize the text "
                         f"first, e.g. [tokenizer(text)['input_ids']]")
    if isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("attention_mask goes with an input_ids tensor; lists of token ids are padded here")
        if not all(isinstance(r, (list, tuple)) for r in input_ids):
            raise ValueError(f"input_ids must be a list of token-id lists, one per prompt (e.g. [[1, 2, 3]]); "
                             f"got {str(input_ids)[:60]}")
        rows = [list(r) for r in input_ids]
        if not rows or any(not r for r in rows) or any(isinstance(v, bool) or not isinstance(v, int)
                                                       for r in rows for v in r):
            raise ValueError("input_ids must be a non-empty list of non-empty lists of token ids (integers)")
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)  # (B, T)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    else:
        ids, mask = input_ids, attention_mask
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long or ids.numel() == 0:
            got = (tuple(ids.shape), ids.dtype) if isinstance(ids, torch.Tensor) else type(ids)
            raise ValueError(f"input_ids must be a non-empty (batch, seq) torch.long tensor or a list of "
                             f"token-id lists; got {got}")
        mask = torch.ones_like(ids) if mask is None else _checked_mask(mask, ids)
    bad = ids[(mask == 1) & ((ids < 0) | (ids >= vocab))]
    if bad.numel():
        raise ValueError(f"token ids must be in [0, {vocab}); got {bad[:5].tolist()}")
    return ids.masked_fill(mask == 0, pad), mask  # the model embeds padding too: any id there must exist


def _checked_mask(mask, ids) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(ids.shape)}, got "
                         f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
    if bool(((mask != 0) & (mask != 1)).any()):  # before any cast: 0.5 is not padding
        raise ValueError(f"attention_mask must hold 0 and 1 only, got {mask.unique()[:5].tolist()}")
    mask = mask.long()
    if bool((mask[:, 1:] < mask[:, :-1]).any()) or bool((mask[:, -1] == 0).any()):
        raise ValueError("attention_mask must be left padding: per row zeros then ones, the last position 1")
    return mask


def _check_count(max_new_tokens) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")


def _check_positions(model, mask, max_new_tokens: int) -> None:
    """Before any step: the longest prompt (real tokens) and the new tokens fit the positions the
    model declares (past a learned position table a forward fails deep inside, with an IndexError)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    longest = int(mask.sum(dim=1).max())
    if isinstance(limit, int) and longest + max_new_tokens > limit:
        raise ValueError(f"the longest prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) is "
                         f"{longest + max_new_tokens} tokens, more than this model's {limit} positions "
                         f"(max_position_embeddings); use at most {limit} in all")


def _stop_ids(eos_token_id, vocab: int) -> list[int]:
    stops = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < vocab for s in stops):
        raise ValueError(f"eos_token_id must be a token id or a list of them, each in [0, {vocab}); "
                         f"got {eos_token_id!r}")
    return stops


def _device(model) -> torch.device:
    """Where ``model`` computes: its parameters' device (the host for a model without any)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _vocab_size(model) -> int:
    head = model.get_output_embeddings()
    return head.out_features if head is not None else model.config.vocab_size


class _Stepper:
    """One forward of a generation step: ``(candidates, full logits or None, cache)``."""

    def __init__(self, model, group, padded: bool, engine: str, capacity: int):
        self.model, self.group, self.padded = model, group, padded
        head = model.get_output_embeddings()
        sharded = isinstance(head, ColumnParallelLinear) and head.tp_size > 1 and head.rows is None
        self.head = head if sharded else None  # as causal_lm_loss and the planner's inventory decide
        self.lean, why = (None, "") if engine == "hf" else lean_decoder(model, None if group is False else group,
                                                                         capacity)
        self.capacity = capacity
        if self.lean is None and engine == "lean":
            raise ValueError(f"engine='lean' cannot run {type(model).__name__}: {why}")
        params = inspect.signature(type(model).forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.keep = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self.positions = "position_ids" in params

    def __call__(self, new, mask, positions, cache, sampler, t, vocab, want_full):
        logits, cache = (self._lean if self.lean is not None else self._hf)(new, mask, positions, cache)
        if self.head is None:  # every rank holds every logit
            full = logits[:, :vocab].double()
            k = None if sampler.shard_gumbel else sampler.candidates  # here the noise goes on every logit
            return (*_best_k(full, 0, k), False), (full if want_full else None), cache
        candidates, full = self._exchange(logits, sampler, t, vocab, want_full)
        return candidates, full, cache

    def _lean(self, new, mask, positions, cache):
        with torch.inference_mode():  # no autograd bookkeeping at all: ~6% of a decode step
            if cache is None:
                cache = self.lean.new_cache(new.shape[0], self.capacity)
            logits = self.lean(new, mask if self.padded else None, positions, cache)
        return logits.clone(), cache  # an ordinary tensor: what is returned must serve autograd later

    def _hf(self, new, mask, positions, cache):
        """The model's own forward: this rank's logits of the last position, ``(B, V)`` or ``(B, V/tp)``."""
        kwargs = {self.cache_kwarg: cache, "use_cache": True}
        if self.keep:
            kwargs[self.keep] = 1
        if self.padded:  # without padding the model's own causal mask and positions are the same, and cheaper
            kwargs["attention_mask"] = mask
            if self.positions:
                kwargs["position_ids"] = positions
        with _vocab_shards(self.head):
            out = self.model(input_ids=new, **kwargs)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return out.logits[:, -1, :], cache

    def _exchange(self, logits_shard, sampler, t, vocab, want_full):
        """Every rank's candidates from each rank's vocabulary shard ``(B, V/tp)``, in one all-gather:
        ``((values, indices, perturbed), full logits or None)``."""
        start, width = self.head.output_start_index, logits_shard.shape[1]
        valid = max(0, min(vocab - start, width))
        local = logits_shard.double()
        local[:, valid:] = -float("inf")  # padding past the vocabulary
        full, k = None, sampler.candidates
        if k is None or want_full:
            full = dist.all_gather(logits_shard, dim=-1, group=self.group)[:, :vocab].double()  # (B, V)
        if k is None:
            return (*_best_k(full, 0, None), False), full
        if sampler.shard_gumbel:  # this shard's columns of the step's noise, on its temperature-scaled scores
            noise = gumbel(sampler, t, local.shape[0], vocab, local.device)[:, start:start + valid]  # (B, valid)
            local = local / sampler.temperature
            local[:, :valid] += noise
        values, indices = _best_k(local, start, k)  # (B, k)
        packed = torch.stack([values, indices.double()], dim=-1)  # (B, k, 2): an index is exact in float64
        every = dist.all_gather(packed, dim=1, group=self.group, module="next_token")  # (B, tp k, 2)
        return (every[..., 0], every[..., 1].long(), sampler.shard_gumbel), full


def _best_k(values: torch.Tensor, offset: int, k: int | None):
    """A shard's candidates: its ``k`` first by (value descending, index ascending), all if None."""
    width = values.shape[1]
    indices = torch.arange(offset, offset + width, device=values.device).expand(values.shape[0], width)  # (B, n)
    if k is None or k >= width:
        return values, indices
    if k == 1:
        top = values.max(dim=1, keepdim=True).values  # (B, 1)
        first = (values == top).long().argmax(dim=1, keepdim=True)  # the first maximum
        return top, indices.gather(1, first)
    order = values.argsort(dim=1, descending=True, stable=True)[:, :k]  # (B, k)
    return values.gather(1, order), indices.gather(1, order)


@contextlib.contextmanager
def _vocab_shards(head):
    """The head's logits left sharded by vocabulary for one forward (None: nothing to change)."""
    if head is None:
        yield
        return
    before, head.gather_output = head.gather_output, False
    try:
        yield
    finally:
        head.gather_output = before
