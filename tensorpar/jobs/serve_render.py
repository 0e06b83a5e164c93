"""The answers of ``tensorpar serve``'s generation routes, in OpenAI's formats: a stream of
server-sent events (one chunk per token, then ``data: [DONE]``) or one whole body, each choice
with its ``token_ids`` (an extension) and, where asked, its log-probabilities; ``state`` is the
server's :class:`~tensorpar.jobs.serve_api.ServeState`.
"""
from __future__ import annotations

import asyncio
import functools
import json

from fastapi import Request
from fastapi.responses import Response


async def _events(job, events, request: Request | None = None):
    """The job's events until every choice has finished; on a client gone (or this task
    cancelled), the job is cancelled and its slots are freed at the next step."""
    left = job.n
    try:
        while left:
            try:
                event = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    return
                continue
            left -= event[0] == "finish"
            yield event
    finally:
        if left:
            job.cancel()


async def stream(state, job, events, meta, chat: bool, include_usage: bool):
    kind = "chat.completion.chunk" if chat else "text_completion"
    if chat:  # the role first, as OpenAI streams it
        for c in range(job.n):
            yield _sse({**meta, "object": kind, "choices": [{"index": c, "delta": {"role": "assistant", "content": ""},
                                                            "finish_reason": None}]})
    async for event in _events(job, events):
        if event[0] == "delta":
            _, c, text, ids, lps = event
            part = {"delta": {"content": text}} if chat else {"text": text}
            part["logprobs"] = _format_logprobs(state, lps, chat)
            yield _sse({**meta, "object": kind, "choices": [{"index": c, **part, "finish_reason": None,
                                                            "token_ids": ids}]})
        else:
            _, c, reason = event
            part = {"delta": {}} if chat else {"text": "", "logprobs": None}
            yield _sse({**meta, "object": kind, "choices": [{"index": c, **part, "finish_reason": reason}]})
    if include_usage:
        yield _sse({**meta, "object": kind, "choices": [], "usage": _usage(job)})
    yield "data: [DONE]\n\n"


async def whole(state, request, job, events, meta, chat: bool):
    texts, reasons = [""] * job.n, [None] * job.n
    async for event in _events(job, events, request):
        if event[0] == "delta":
            texts[event[1]] += event[2]
        else:
            reasons[event[1]] = event[2]
    if job.cancelled:
        return Response(status_code=499)  # the client went away: nobody reads this
    choices = []
    for c in range(job.n):
        ids = job.choices[c].ids
        body = {"message": {"role": "assistant", "content": texts[c]}} if chat else {"text": texts[c]}
        body["logprobs"] = _format_logprobs(state, job.choices[c].logprobs if job.logprobs is not None else None, chat)
        choices.append({"index": c, **body, "finish_reason": reasons[c], "token_ids": ids})
    return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
            "usage": _usage(job)}


def _format_logprobs(state, entries, chat: bool):
    """:class:`~tensorpar.jobs.serve_job.Logprob` entries in OpenAI's format (None: not asked)."""
    if entries is None:
        return None
    text = functools.partial(_token_text, state.tokenizer)
    if chat:
        def item(token, lp):
            t = text(token)
            return {"token": t, "logprob": lp, "bytes": list(t.encode())}
        return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}
    return {"tokens": [text(e.token) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{**{text(t): lp for t, lp in e.top}, text(e.token): e.logprob} for e in entries],
            "text_offset": [e.text_offset for e in entries]}


def _token_text(tokenizer, token: int) -> str:
    return f"token_id:{token}" if tokenizer is None else tokenizer.decode([token])


def _usage(job) -> dict:
    return {"prompt_tokens": len(job.prompt), "completion_tokens": job.completion_tokens,
            "total_tokens": len(job.prompt) + job.completion_tokens}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"
