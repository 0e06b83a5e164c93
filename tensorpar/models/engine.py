"""One engine step of continuous batching, on every rank: many requests, each in its own slot of a
preallocated sharded KV cache, each decoded as :func:`~tensorpar.models.generation.generate`
decodes it alone.

Rank 0 decides each step's :class:`~tensorpar.models.engine_plan.Plan` (which rows run, and how
each request picks its next token) and sends it to the other ranks
(:class:`~tensorpar.models.engine_plan.PlanWire`: one broadcast); every rank then runs
:meth:`Engine.step` on the same plan and, from the candidates every rank offers, computes the same
tokens (no broadcast of tokens). The other ranks keep no request state: a plan says everything.

A step runs rows of different lengths packed into one sequence of ``N`` tokens: a running
request's last token (a decode row) or a chunk of a prompt (a prefill row, bounded per step by
the scheduler so that running streams are not stalled). Per layer, on each rank::

    a = rms1(x);  q, k, v = a Wq_i, a Wk_i, a Wv_i           # (N, nh hd), (N, nkv hd) x2
    q, k = rope(q, pos), rope(k, pos)                         # each token at its own request's position
    cache[slot, :, pos] = k, v                                # (S, nkv, capacity, hd): one slot a request
    decode rows: one sdpa over slots [0, hi), keys < length    # (hi, nh, 1, hd)
    prefill rows: one sdpa each, causal from its start         # (1, nh, T, hd)
    x = x + o Wo_i  (all-reduce);  x = x + MLP(rms2(x))  (all-reduce)

Why each request gets what it would get alone: its positions are its own (``start ..``), its
keys are its own slot's and masked at its own length, and its token is chosen by
:func:`~tensorpar.models.sampling.choose` from the candidates ``generate`` would offer for it,
with noise keyed by its own seed and its own step (``n`` choices of one request: the rows of
``generate`` on ``n`` copies of the prompt). What batching changes is only the order in which
floating-point sums are taken (other matrix shapes, another attention mask): in float64 the
logits agree with ``generate``'s to about 1e-15 relative, far below any gap between two tokens
of a real distribution; in float32 a near-tie (two logits within ~1e-6) can go the other way.
The forward is the lean one (:mod:`tensorpar.models.lean`, Llama/Mistral/Qwen2): its weights and
modules, its numerics.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tensorpar import distributed as dist
from tensorpar.models.generation import _best_k, _vocab_size
from tensorpar.models.lean import _allowed, _mm, _rope, lean_decoder
from tensorpar.models.engine_plan import Draw, Plan
from tensorpar.models.sampling import Sampler, _order, choose, gumbel
from tensorpar.nn.layers import ColumnParallelLinear


GREEDY = Sampler()


class SlotCache:
    """Every layer's keys and values, ``(slots, nkv, capacity, hd)`` each, allocated once."""

    def __init__(self, layers, slots: int, capacity: int, head_dim: int, dtype, device=None):
        self.k = [torch.zeros(slots, lay.kv_heads, capacity, head_dim, dtype=dtype, device=device)
                  for lay in layers]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.slots, self.capacity = slots, capacity

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)


class Engine:
    """The step of one rank; ``group``: the model's tp group (None: the world)."""

    def __init__(self, model, *, slots: int, capacity: int, group=None):
        decoder, why = lean_decoder(model, group, capacity)
        if decoder is None:
            raise ValueError(f"tensorpar serve runs the lean forward (Llama, Mistral, Qwen2): {why}")
        self.decoder, self.group, self.vocab = decoder, group, _vocab_size(model)
        self.cache = SlotCache(decoder.layers, slots, capacity, decoder.head_dim, decoder.head[0].dtype,
                               decoder.device)
        head = model.get_output_embeddings()
        sharded = isinstance(head, ColumnParallelLinear) and head.tp_size > 1 and head.rows is None
        self.head = head if sharded else None  # as generate decides: each rank holds a vocabulary shard

    @torch.inference_mode()
    def step(self, plan: Plan) -> tuple[list[list[int]], list]:
        """Per draw of ``plan``, the token of each member (in ``members`` order), the same on every
        rank; and per draw, None or (for a draw that asks for them) per member :class:`Logprobs`."""
        if not plan.rows:
            return [], []
        self._check(plan)
        logits = self._forward(plan.rows)  # (R, V or V/tp): every row's last position
        tokens = self._choose(logits, plan.draws)
        if all(d.logprobs is None for d in plan.draws):
            return tokens, [None] * len(plan.draws)
        return tokens, self._logprobs(logits, plan.draws, tokens)

    def _check(self, plan: Plan) -> None:
        for row in plan.rows:  # the scheduler's invariants: a wrong plan would write another request's keys
            assert 0 <= row.slot < self.cache.slots and row.ids, row
            assert row.start + len(row.ids) <= self.cache.capacity, (row, self.cache.capacity)

    # ---- the forward ----------------------------------------------------------------------------

    def _forward(self, rows) -> torch.Tensor:
        d = self.decoder
        lengths = [len(r.ids) for r in rows]
        ids = torch.tensor([t for r in rows for t in r.ids])                                 # (N,)
        pos = torch.tensor([p for r in rows for p in range(r.start, r.start + len(r.ids))])  # (N,)
        slot = torch.tensor([r.slot for r in rows for _ in r.ids])                            # (N,)
        x = d._embed(ids[None])                                                              # (1, N, H)
        cos, sin = d.rope(x, pos[None])                                                      # (1, N, hd)
        rot = (cos[0][:, None], (sin[0] * d.sign.to(sin.dtype))[:, None])                    # (N, 1, hd)
        x = x[0]                                                                             # (N, H)
        layout = _Layout(rows, lengths)
        for i, lay in enumerate(d.layers):
            x = x + self._attention(lay, lay.norm1(x), i, rot, slot, pos, layout)
            x = x + d._mlp(lay, lay.norm2(x), 1)
        h = d.norm(x[layout.last])                                                           # (R, H)
        return _mm(h, d.head)                                                                # (R, V or V/tp)

    def _attention(self, lay, a, i, rot, slot, pos, layout):
        N, hd = a.shape[0], self.decoder.head_dim
        q = _rope(_mm(a, lay.q).view(N, lay.heads, hd), *rot)                               # (N, nh, hd)
        k = _rope(_mm(a, lay.k).view(N, lay.kv_heads, hd), *rot)                            # (N, nkv, hd)
        v = _mm(a, lay.v).view(N, lay.kv_heads, hd)
        K, V = self.cache.k[i], self.cache.v[i]                                              # (S, nkv, C, hd)
        K[slot, :, pos] = k                                                                  # every new key first
        V[slot, :, pos] = v
        gqa = lay.heads != lay.kv_heads
        if layout.packed and not layout.prefill:  # the common step: running streams only
            o = self._decode_attention(lay, q, K, V, layout, gqa)                             # (N, nh, hd)
            return self.decoder._out(o.reshape(N, lay.heads * hd), lay.o, lay.o_module, 1)
        o = torch.empty_like(q)                                                              # (N, nh, hd)
        if layout.packed:
            o[:layout.hi] = self._decode_attention(lay, q, K, V, layout, gqa)
        elif layout.decode:
            o[layout.decode_tokens] = self._decode_attention(lay, q, K, V, layout, gqa)
        for at, r in layout.prefill:
            T, end = len(r.ids), r.start + len(r.ids)
            qr = q[at:at + T].transpose(0, 1)[None]                                         # (1, nh, T, hd)
            out = F.scaled_dot_product_attention(qr, K[r.slot:r.slot + 1, :, :end], V[r.slot:r.slot + 1, :, :end],
                                                 attn_mask=_allowed(None, r.start, T, end), scale=lay.scaling,
                                                 enable_gqa=gqa)                             # (1, nh, T, hd)
            o[at:at + T] = out[0].transpose(0, 1)
        return self.decoder._out(o.view(N, lay.heads * hd), lay.o, lay.o_module, 1)

    def _decode_attention(self, lay, q, K, V, layout, gqa):
        """Every one-token row in one call over slots ``[0, hi)`` (a view, no copy of the cache):
        each slot's query attends to its own keys below its own length; slots without a decode
        row get a zero query and one key, and their output is dropped."""
        hi, L = layout.hi, layout.longest
        if layout.packed:  # decode rows first, in slots 0, 1, ..: the queries as they are (a view)
            qd = q[:hi, :, None]                                                             # (hi, nh, 1, hd)
        else:
            qd = q.new_zeros(hi, lay.heads, 1, q.shape[-1])                                # (hi, nh, 1, hd)
            qd[layout.decode_slots, :, 0] = q[layout.decode_tokens]
        od = F.scaled_dot_product_attention(qd, K[:hi, :, :L], V[:hi, :, :L], attn_mask=layout.decode_mask,
                                            scale=lay.scaling, enable_gqa=gqa)              # (hi, nh, 1, hd)
        return od[:, :, 0] if layout.packed else od[layout.decode_slots, :, 0]             # (nd, nh, hd)

    # ---- the choice -----------------------------------------------------------------------------

    def _choose(self, logits, draws) -> list[list[int]]:
        """Per draw, its members' tokens. Greedy draws (most of a server's) are chosen together:
        one set of candidates for all their rows, one choice (greedy is row by row: the same
        tokens as draw by draw); a sampling draw is chosen on its own ``n`` rows (its noise is
        keyed by its seed, its step and its row)."""
        greedy = [i for i, d in enumerate(draws) if not d.sampler.do_sample]
        rows = torch.tensor([r for i in greedy for r, _ in draws[i].members], dtype=torch.long)
        if self.head is None:  # every rank holds every logit
            full = logits[:, :self.vocab].double()
            out = [None if not d.sampler.do_sample else
                   self._pick(d, *_best_k(_rows(full, d), 0, None if d.sampler.shard_gumbel
                                          else d.sampler.candidates), False) for d in draws]
            tokens = choose(*_best_k(full[rows], 0, 1), GREEDY, 0, self.vocab).tolist() if greedy else []
        else:
            out, tokens = self._exchange(logits, draws, greedy, rows)
        at = 0
        for i in greedy:
            out[i], at = tokens[at:at + len(draws[i].members)], at + len(draws[i].members)
        return out

    def _exchange(self, shard, draws, greedy: list, rows) -> tuple[list, list]:
        """As generate's exchange, for many requests in one step: the greedy draws' rows and each
        sampling draw's rows offer their candidates (each its own ``k``), packed to the step's
        largest ``k`` and gathered once. Returns the sampling draws' tokens (None at the greedy
        ones) and the greedy rows' tokens, in ``rows`` order."""
        start, width = self.head.output_start_index, shard.shape[1]
        valid = max(0, min(self.vocab - start, width))
        local = shard.double()
        local[:, valid:] = -float("inf")  # padding past the vocabulary
        full = None
        if any(d.sampler.candidates is None for d in draws):  # top-p without top-k: every logit
            full = dist.all_gather(shard, dim=-1, group=self.group)[:, :self.vocab].double()  # (R, V)
        sampled = [d for d in draws if d.sampler.do_sample and d.sampler.candidates is not None]
        offers = ([_best_k(local[rows], start, 1)] if greedy else []) + [
            self._offer(local, d, start, valid) for d in sampled]
        K = max((v.shape[1] for v, _ in offers), default=0)
        every = None
        if offers:
            packed = torch.cat([_pad(v, i, K) for v, i in offers])                           # (offers' rows, K, 2)
            every = dist.all_gather(packed, dim=1, group=self.group, module="next_token")    # (.., tp K, 2)
            every = every.view(every.shape[0], -1, K, 2)                                     # (.., tp, K, 2)
        tokens, at = [], len(rows) if greedy else 0
        if greedy:
            mine = every[:at, :, :1].reshape(at, -1, 2)                                      # (G, tp, 2)
            tokens = choose(mine[..., 0], mine[..., 1].long(), GREEDY, 0, self.vocab).tolist()
        out = []
        for d in draws:
            if not d.sampler.do_sample:
                out.append(None)
            elif d.sampler.candidates is None:
                out.append(self._pick(d, *_best_k(_rows(full, d), 0, None), False))
            else:
                k = min(d.sampler.candidates, width)
                mine = every[at:at + d.n, :, :k].reshape(d.n, -1, 2)                        # (n, tp k, 2)
                at += d.n
                out.append(self._pick(d, mine[..., 0], mine[..., 1].long(), d.sampler.shard_gumbel))
        return out, tokens

    def _offer(self, local, d: Draw, start: int, valid: int):
        """This shard's candidates for draw ``d``: (values, indices), ``(n, k)`` each."""
        scores = _rows(local, d)                                                              # (n, V/tp)
        if d.sampler.shard_gumbel:  # this shard's columns of the step's noise, on temperature-scaled scores
            noise = gumbel(d.sampler, d.step, d.n, self.vocab)[:, start:start + valid]      # (n, valid)
            scores = scores / d.sampler.temperature
            scores[:, :valid] += noise
        return _best_k(scores, start, d.sampler.candidates)

    def _pick(self, d: Draw, values, indices, perturbed: bool) -> list[int]:
        tokens = choose(values, indices, d.sampler, d.step, self.vocab, perturbed=perturbed)  # (n,)
        return [int(tokens[c]) for _, c in d.members]


    # ---- log-probabilities ----------------------------------------------------------------------

    def _logprobs(self, logits, draws, tokens) -> list:
        """The model's own distribution (log-softmax of the logits: before temperature, top-k and
        top-p) at each member's row: its token's log-probability and the ``k`` most likely tokens
        (value descending, index ascending). A vocabulary split over ranks is merged from one
        all-gather of each shard's (max, sum of exp, the token's logit, its best ``k``): per row
        ``3 + 2k`` float64 values a rank, nothing for draws that ask for none."""
        want = [(d, i) for i, d in enumerate(draws) if d.logprobs is not None]
        rows = torch.tensor([r for d, _ in want for r, _ in d.members])                     # (L,)
        chosen = torch.tensor([t for _, i in want for t in tokens[i]])                      # (L,)
        k = max(d.logprobs for d, _ in want)
        if self.head is None:
            full = logits[rows, :self.vocab].double()                                        # (L, V)
            norm = torch.logsumexp(full, dim=1)                                              # (L,)
            mine = full.gather(1, chosen[:, None])[:, 0]
            top_v, top_i = _first(*_best_k(full, 0, k), k)
        else:
            norm, mine, top_v, top_i = self._shard_logprobs(logits[rows], chosen, k)
        out, at = [None] * len(draws), 0
        for d, i in want:
            got = []
            for _ in d.members:
                top = [(int(t), float(v - norm[at])) for v, t in zip(top_v[at, :d.logprobs], top_i[at, :d.logprobs])]
                got.append(Logprobs(float(mine[at] - norm[at]), top))
                at += 1
            out[i] = got
        return out

    def _shard_logprobs(self, shard, chosen, k: int):
        """Per row: log of the sum of exp over the whole vocabulary, the chosen token's logit and
        the best ``k`` (values, indices), from every rank's shard."""
        start, width = self.head.output_start_index, shard.shape[1]
        valid = max(0, min(self.vocab - start, width))
        local = shard[:, :valid].double()                                                    # (L, valid)
        top = local.max(dim=1).values if valid else local.new_full((local.shape[0],), -float("inf"))
        safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        total = (local - safe[:, None]).exp().sum(dim=1)                                    # (L,)
        here = (chosen >= start) & (chosen < start + valid)
        mine = torch.full_like(top, -float("inf"))
        mine[here] = local[here, chosen[here] - start]
        v, i = _best_k(local, start, k)
        packed = torch.cat([torch.stack([safe, total, mine], dim=1), _pad(v[:, :k], i[:, :k], k).flatten(1)], dim=1)
        every = dist.all_gather(packed, dim=1, group=self.group, module="logprobs")         # (L, tp (3 + 2k))
        every = every.view(every.shape[0], -1, 3 + 2 * k)                                   # (L, tp, 3 + 2k)
        peak = every[..., 0].max(dim=1).values                                               # (L,)
        norm = peak + (every[..., 1] * (every[..., 0] - peak[:, None]).exp()).sum(dim=1).log()
        mine = every[..., 2].max(dim=1).values
        cand = every[..., 3:].reshape(every.shape[0], -1, 2)                                 # (L, tp k, 2)
        return (norm, mine, *_first(cand[..., 0], cand[..., 1], k))


@dataclass(frozen=True)
class Logprobs:
    """One drawn token's log-probability under the model, and the ``k`` most likely tokens'
    ``(token id, log-probability)``, most likely first."""

    token: float
    top: list


def _first(values, indices, k: int):
    """The ``k`` first of each row by value descending, ties by index ascending: ``(L, k)`` each
    (padding, -inf, sorts last)."""
    order = _order(values, indices)[:, :k]
    return values.gather(1, order), indices.gather(1, order).long()


class _Layout:
    """Where each row's tokens sit in the packed sequence, and the decode rows' attention mask."""

    def __init__(self, rows, lengths):
        ends = torch.tensor(lengths).cumsum(0)
        self.last = ends - 1                                                                 # (R,)
        starts = (ends - torch.tensor(lengths)).tolist()
        one = [(at, r) for at, r in zip(starts, rows) if len(r.ids) == 1]
        self.prefill = [(at, r) for at, r in zip(starts, rows) if len(r.ids) > 1]
        self.decode = bool(one)
        # packed: the decode rows are the first tokens and sit in slots 0, 1, .. in order (the
        # scheduler's usual step), so their queries and outputs need no gather or scatter
        self.packed = bool(one) and [(at, r.slot) for at, r in one] == [(i, i) for i in range(len(one))]
        if not one:
            return
        self.decode_tokens = torch.tensor([at for at, _ in one])                             # (nd,)
        self.decode_slots = torch.tensor([r.slot for _, r in one])                           # (nd,)
        self.hi = int(self.decode_slots.max()) + 1
        length = torch.ones(self.hi, dtype=torch.long)  # a slot without a decode row: one key
        length[self.decode_slots] = torch.tensor([r.start + 1 for _, r in one])
        self.longest = int(length.max())
        self.decode_mask = (torch.arange(self.longest)[None, :] < length[:, None])[:, None, None]  # (hi, 1, 1, L)


def _rows(x: torch.Tensor, d: Draw) -> torch.Tensor:
    """``(n, ...)``: row ``c`` is choice ``c``'s row of ``x``; a choice that has stopped takes
    another's row (its token is never used; ``choose`` treats rows independently)."""
    by_choice = {c: r for r, c in d.members}
    fill = d.members[0][0]
    return x[torch.tensor([by_choice.get(c, fill) for c in range(d.n)])]


def _pad(values, indices, K: int) -> torch.Tensor:
    """``(n, K, 2)`` (value, index) pairs, past a draw's own ``k`` filled with -inf (never read)."""
    n, k = values.shape
    packed = torch.full((n, K, 2), -float("inf"), dtype=torch.float64)
    packed[:, :k, 0], packed[:, :k, 1] = values, indices.double()  # an index is exact in float64
    return packed
