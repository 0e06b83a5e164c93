"""One request's life on rank 0: its tokens as they are drawn, turned into text, stop strings and
events for the HTTP handler that waits on them.

The engine loop calls :meth:`Job.deliver` after each step that drew the request's tokens; the
job decides which choices have finished (a stop token, a stop string, ``max_tokens``) and emits
events for the handler's asyncio queue from the engine's thread (through the server's outbox,
handed to the event loop once a step: :class:`Outbox`):
``("delta", choice, text, token_ids, logprobs)``, ``("finish", choice, reason)``; ``logprobs``
is None unless the request asked for them, else one :class:`Logprob` per token of ``token_ids``. Text is the tokenizer's
decoding of every token so far, sent as it grows; the tail that could still become a stop string
(or an unfinished UTF-8 character) is held back until it cannot, and a stop string ends the
choice with the text before it (OpenAI's rule).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """A drawn token's log-probability under the model, where its text starts in the choice's
    text (``text_offset``), and the most likely tokens' ``(token id, log-probability)``."""

    token: int
    logprob: float
    top: list
    text_offset: int


@dataclass
class _Choice:
    ids: list = field(default_factory=list)
    sent: str = ""  # text already sent
    done: bool = False
    last_t: float | None = None
    decoded: int = 0  # characters of the decoding of ``ids``
    logprobs: list = field(default_factory=list)  # a Logprob per token, where asked


class Job:
    """``prompt``: token ids; ``sampler``: a :class:`~tensorpar.models.sampling.Sampler`;
    ``stop_ids``: tokens that end a choice (kept in its ids, not in its text); ``stop_texts``:
    strings that end it; ``emit(event)``: how events reach the handler (any thread);
    ``decode(ids) -> str`` or None (no tokenizer: ids only); ``metrics``: observes latencies;
    ``logprobs``: None, or how many most likely tokens to report beside each drawn token's
    log-probability."""

    def __init__(self, prompt, *, n, sampler, max_tokens, stop_ids=(), stop_texts=(), emit, decode=None,
                 metrics=None, logprobs: int | None = None):
        self.prompt, self.n, self.sampler, self.max_tokens = list(prompt), n, sampler, max_tokens
        self.logprobs = logprobs
        self.stop_ids, self.stop_texts = frozenset(stop_ids), tuple(stop_texts)
        self.emit, self.decode, self.metrics = emit, decode, metrics
        self.choices = [_Choice() for _ in range(n)]
        self.cancelled = False
        self.t_arrival = time.perf_counter()
        self.first_token_s: float | None = None

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.ids) for c in self.choices)

    def deliver(self, tokens: dict, logprobs: dict | None = None) -> set:
        """Take each choice's new token (and its :class:`~tensorpar.models.engine.Logprobs`, where
        asked); returns the choices that have finished."""
        now = time.perf_counter()
        finished = set()
        for c, tok in tokens.items():
            self._observe(self.choices[c], now)
            reason = self._take(c, tok, None if logprobs is None else logprobs[c])
            if reason is not None or self.cancelled:
                self.choices[c].done = True
                finished.add(c)
                if not self.cancelled:
                    self.emit(("finish", c, reason))
        return finished

    def _observe(self, choice: _Choice, now: float) -> None:
        first = self.first_token_s is None
        if first:
            self.first_token_s = now - self.t_arrival
        if self.metrics is not None:
            self.metrics.token(self.first_token_s if first else None,
                               None if choice.last_t is None else now - choice.last_t)
        choice.last_t = now

    def _take(self, c: int, tok: int, lp) -> str | None:
        """Record ``tok`` for choice ``c`` and send what it adds; the finish reason, if it ends."""
        ch = self.choices[c]
        ch.ids.append(tok)
        lps = None if lp is None else [Logprob(tok, lp.token, lp.top, ch.decoded)]
        ch.logprobs += lps or []
        stopped = tok in self.stop_ids
        reason = "stop" if stopped else ("length" if len(ch.ids) >= self.max_tokens else None)
        if self.decode is None:
            self._send(c, "", [tok], lps)
            return reason
        text = self.decode(ch.ids[:-1] if stopped else ch.ids)
        ch.decoded = len(text)
        cut = _first_stop(text, self.stop_texts, len(ch.sent))
        if cut is not None:
            text, reason = text[:cut], "stop"
        final = reason is not None
        ready = text if final else text[:len(text) - _held(text, self.stop_texts)]
        grew = ready.startswith(ch.sent)  # a decoding that rewrote sent text: nothing more until it agrees
        self._send(c, ready[len(ch.sent):] if grew else "", [tok], lps)
        ch.sent = ready if grew else ch.sent
        return reason

    def _send(self, c: int, text: str, ids: list, logprobs) -> None:
        if not self.cancelled:
            self.emit(("delta", c, text, ids, logprobs))


def _first_stop(text: str, stops: tuple, sent: int) -> int | None:
    """Where the first stop string starts in ``text`` (searching from where one could still
    start: text already sent held none), or None."""
    longest = max((len(s) for s in stops), default=0)
    begin = max(0, sent - longest)
    found = [i for i in (text.find(s, begin) for s in stops) if i >= 0]
    return min(found) if found else None


def _held(text: str, stops: tuple) -> int:
    """Characters at the end of ``text`` not to send yet: the longest tail that begins a stop
    string, or an unfinished UTF-8 character (decoded as U+FFFD)."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


class Outbox:
    """Events from the engine's thread to the handlers' event loop, handed over once a step: one
    wake-up of the loop a step (:meth:`flush`), not one a token of each stream."""

    def __init__(self):
        self._pending: list = []
        self._lock = threading.Lock()

    def post(self, loop, queue, event) -> None:
        with self._lock:
            self._pending.append((loop, queue, event))

    def flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for loop in {id(loop): loop for loop, _, _ in batch}.values():
            mine = [(q, e) for lp, q, e in batch if lp is loop]
            try:
                loop.call_soon_threadsafe(_hand_over, mine)
            except RuntimeError:  # the loop has closed: the server is gone, nobody listens
                pass


def _hand_over(batch: list) -> None:
    for queue, event in batch:
        queue.put_nowait(event)
