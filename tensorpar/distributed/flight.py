"""The flight recorder: which collective each rank is in, so a hang or a mismatch is named.

Every collective tensorpar issues (:mod:`tensorpar.distributed.collectives`, ``barrier``,
``broadcast_object``) passes through :func:`issuing`: it counts the collectives of each group
(``seq``) and, on a rank started by :func:`~tensorpar.distributed.launcher.launch`, writes what it is
entering into a small shared-memory slot the launching process reads: ``{"state": "in" | "out",
"seq", "op", "shape", "dtype", "group", "module", "t"}`` (``"checking"`` while the rank-side check
below exchanges signatures: the launcher leaves a mismatch there to the ranks, which name it).
Cost: one JSON write of ~150 bytes entering a collective and 9 bytes leaving it, lock-free (a few
microseconds, against ~1 ms for a gloo collective on loopback and tens of microseconds over
shared memory).

The launcher reads the slots every half second and stops the launch with
:class:`CollectiveMismatchError` when two ranks of one group sit in the same collective (same
``seq``) issued differently (another op, shape or dtype), or in different ones for longer than a
peer can take to leave the previous one; when a rank fails, dies or the deadline passes, it
names the collective each rank was in (or that a rank was in none: the stuck one), and
:func:`find_stuck` names the peer a rank has waited for in vain (:mod:`tensorpar.distributed.monitor`).

Rank-side checking (``TENSORPAR_CHECK_COLLECTIVES=1``, or :func:`check_collectives`): before each
collective the group exchanges a signature (one all-gather of 8 int64 per collective) and every
rank raises :class:`CollectiveMismatchError` naming both calls if they differ. This also catches a
mismatch that the backend would complete silently (an all-reduce of a (2, 4) tensor against one of
(4, 2) exchanges the same bytes). It doubles the number of collectives: measured on 2 gloo ranks
over loopback, an all-reduce of 384 floats took 1.1-1.2 ms without it and 1.8-2.3 ms with it. So it
is off by default and on in ``tensorpar verify`` and the test suite.
"""
from __future__ import annotations

import contextlib
import json
import struct
import time

import torch
import torch.distributed as tdist

from tensorpar.distributed import settings

SLOT_BYTES = 1024
_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "broadcast_object",
        "all_gather_object")
_SLOT = None  # this rank's shared slot (set by the launcher in a spawned rank)
_VIEW = None  # its bytes
_SEQ: dict = {}  # group ranks -> collectives issued on it
_OWN = [False]  # between enter and leave of one of tensorpar's own collectives
_GROUP_RANKS: dict = {}
_CHECK = [None]  # None: not yet read from TENSORPAR_CHECK_COLLECTIVES (read at the first collective, not at import)
# Two ranks of a group in different collectives for this long cannot be one still leaving the
# previous collective (that takes microseconds to milliseconds): the schedules differ.
SETTLE_S = 3.0


class CollectiveMismatchError(RuntimeError):
    """The ranks of a group issued different collectives (op, shape, dtype or order)."""


def install(slot) -> None:
    """Called by the launcher in each spawned rank: where this rank reports."""
    global _SLOT, _VIEW
    _SLOT = slot
    _VIEW = memoryview(slot).cast("B")
    _LAST[0] = None  # the new slot holds no call yet


def check_collectives(enabled: bool = True) -> None:
    """Turn the rank-side signature check on or off for this process."""
    _CHECK[0] = bool(enabled)


def _ranks_of(group) -> tuple:
    key = id(group)
    if key not in _GROUP_RANKS:
        _GROUP_RANKS[key] = tuple(tdist.get_process_group_ranks(group if group is not None else tdist.group.WORLD))
    return _GROUP_RANKS[key]


# A slot is a lock-free shared byte array (no semaphore to leak if the launcher is killed): byte 0
# is a sequence counter the writer makes odd while it writes and even when done; a reader retries
# a copy taken while it was odd or changed under it (a seqlock). Bytes 1-17 hold the state, the
# time it was entered (float64) and the collective's number on its group; then the rest of the
# call as JSON up to a NUL byte, written only when it differs from the last call's (a decode
# step repeats a handful of calls): most writes are 17 bytes.
_STATES = ("", "checking", "in", "out")
_CODES = {state: code for code, state in enumerate(_STATES)}
_HEAD = struct.Struct("<BdQ")  # state code, time, seq
_ENCODED: dict = {}  # call key -> its JSON, NUL-terminated
_LAST = [None]  # the key whose JSON the slot holds


def _write(state: str, seq: int = 0, call: tuple | None = None) -> None:
    """``call``: ``(op, shape, dtype, group ranks, module)``, or None to keep the slot's."""
    head = _HEAD.pack(_CODES[state], time.time(), seq)
    data = None
    if call is not None and call != _LAST[0]:
        data = _ENCODED.get(call)
        if data is None:
            op, shape, dtype, group, module = call
            text = json.dumps({"op": op, "shape": list(shape), "dtype": dtype, "group": list(group), "module": module})
            data = _ENCODED[call] = text.encode()[:SLOT_BYTES - 2 - _HEAD.size] + b"\0"
        _LAST[0] = call
    view = _VIEW
    counter = view[0]
    view[0] = (counter + 1) & 255  # odd: writing
    view[1:1 + _HEAD.size] = head
    if data is not None:
        view[1 + _HEAD.size:1 + _HEAD.size + len(data)] = data
    view[0] = (counter + 2) & 255  # even: done


def new_slot(ctx):
    """A slot for one rank, made by the launcher before it spawns the rank."""
    return ctx.RawArray("c", SLOT_BYTES)


def read(slot) -> dict | None:
    """The last state a rank wrote into ``slot`` (None before its first collective)."""
    for _ in range(100):
        raw = bytes(slot[0:SLOT_BYTES])
        if raw[0] % 2 == 0 and slot[0][0] == raw[0]:
            code, t, seq = _HEAD.unpack_from(raw, 1)
            if not code:
                return None
            call = raw[1 + _HEAD.size:].split(b"\0", 1)[0]
            return {**json.loads(call), "seq": seq, "state": _STATES[code], "t": t}
        time.sleep(0.001)
    return None  # a rank writing without pause: its next state will be read next time


@contextlib.contextmanager
def issuing(op: str, tensor: torch.Tensor | None, group, module: str | None = None):
    """Around one collective: counted, reported to the launcher, checked if checking is on."""
    try:
        seq = enter(op, tensor, group, module)
        yield
        leave(seq)
    finally:
        own_done()  # a call that raised is over too: the backend records PyTorch's own calls again


def enter(op: str, tensor: torch.Tensor | None, group, module: str | None = None) -> int:
    """:func:`issuing`'s first half, for a hot path that spares the context manager: returns the
    collective's number, which :func:`leave` takes once it is done (not when it raised: the
    state stays "in", which names where the rank stopped)."""
    _OWN[0] = True
    ranks = _ranks_of(group)
    seq = _SEQ[ranks] = _SEQ.get(ranks, 0) + 1
    check = _CHECK[0]
    if check is None:
        check = _CHECK[0] = settings.check_collectives()
    if _SLOT is None and not check:
        return seq
    call = _CALLS.get((op, tensor.shape, tensor.dtype, ranks, module) if tensor is not None else (op, ranks, module))
    if call is None:
        call = _call(op, tensor, ranks, module)
    if check:  # reported as "checking" first: a mismatch is the ranks' to name, with both calls
        if _SLOT is not None:
            _write("checking", seq, call)
        _check_signature({"seq": seq, "op": op, "shape": list(call[1]), "dtype": call[2], "group": list(ranks),
                          "module": module}, group)
    if _SLOT is not None:
        _write("in", seq, call)
    return seq


def leave(seq: int) -> None:
    _OWN[0] = False
    if _SLOT is not None:
        _write("out", seq)


def own_done() -> None:
    """Mark tensorpar's collective over when it raised (:func:`leave` is not reached then)."""
    _OWN[0] = False


def own_call() -> bool:
    """Whether one of tensorpar's own collectives is being issued (a backend that sees a call can
    tell it from one PyTorch issues itself: DDP's gradient buckets, FSDP's all-gathers)."""
    return _OWN[0]


_CALLS: dict = {}  # (op, shape, dtype, ranks, module) -> the call as the slot describes it


def _call(op: str, tensor: torch.Tensor | None, ranks: tuple, module: str | None) -> tuple:
    shape = tuple(tensor.shape) if tensor is not None else ()
    dtype = (_DTYPE_NAMES.get(tensor.dtype) or str(tensor.dtype).replace("torch.", "")) if tensor is not None else ""
    call = (op, shape, dtype, ranks, module)
    if len(_CALLS) < 4096:  # a decode step repeats a handful of calls; a long varied run stops caching
        _CALLS[(op, tensor.shape, tensor.dtype, ranks, module) if tensor is not None else (op, ranks, module)] = call
    return call


def describe(state: dict | None) -> str:
    if state is None:
        return "no collective yet"
    call = _call_text(state)
    if "t" not in state:  # a peer's call, as its rank described it
        return f"in {call}"
    ago = time.time() - state["t"]
    if state["state"] == "in":
        return f"in {call} for {ago:.1f}s"
    if state["state"] == "checking":
        return f"in {call}, exchanging its signature, for {ago:.1f}s"
    return f"not in a collective for {ago:.1f}s (last: {call})"


def _call_text(state: dict) -> str:
    return (f"{state['op']} #{state['seq']} {state['dtype']}{state['shape']} on group {state['group']}"
            + (f" from {state['module']}" if state.get("module") else ""))


def find_mismatch(states: dict, settle_s: float = SETTLE_S) -> str | None:
    """A message naming two ranks of one group in different collectives, or None.

    ``states``: ``{rank: read(slot)}``. Same ``seq``, another signature: at once. Another ``seq``:
    once both have been inside for ``settle_s`` (a rank may still be leaving the previous one)."""
    inside = {r: s for r, s in states.items() if s is not None and s["state"] == "in"}
    now = time.time()
    for a, sa in inside.items():
        for b, sb in inside.items():
            if b <= a or sa["group"] != sb["group"]:
                continue
            if sa["seq"] == sb["seq"] and _signature(sa) != _signature(sb):
                return _mismatch_message(a, sa, b, sb, "issued different collectives")
            if sa["seq"] != sb["seq"] and now - max(sa["t"], sb["t"]) > settle_s:
                return _mismatch_message(a, sa, b, sb, "are in different collectives of one group "
                                         "(one issued a collective the other did not)")
    return None


def find_stuck(states: dict, returned, waited_s: float) -> tuple[int, str] | None:
    """``(rank, message)`` for the first rank of a group that one of its peers has waited for in
    a collective for ``waited_s`` or longer; None if no rank has waited that long, or every peer
    of the waiting rank reached that collective (then the backend, not a rank, is stuck).

    ``states``: ``{rank: read(slot)}`` of every rank; ``returned``: the ranks that have returned."""
    now = time.time()
    for rank, state in sorted(states.items()):
        if (rank not in returned and state is not None and state["state"] in ("in", "checking")
                and now - state["t"] >= waited_s):
            found = stuck_peer(rank, states, returned)
            if found is not None:
                return found
    return None


def stuck_peer(rank: int, states: dict, returned) -> tuple[int, str] | None:
    """``(peer, message)``: the first peer of ``rank``'s group that has not reached the collective
    ``rank`` is in (it is elsewhere, stopped short of it, or returned without it); None if all have."""
    state = states.get(rank)
    if state is None or state["state"] not in ("in", "checking"):
        return None
    absent = [p for p in state["group"] if p != rank and not _reached(state, states.get(p))]
    if not absent:
        return None
    where = "; ".join(f"rank {p} " + ("returned without issuing it" if p in returned
                                      else describe(states[p]) if states.get(p) else "in no collective yet")
                      for p in absent)
    return absent[0], (f"rank {rank} has waited {time.time() - state['t']:.1f}s in {_call_text(state)} "
                       f"for {_plural(absent)} that never came: {where}")


def _reached(state: dict, peer: dict | None) -> bool:
    """Whether ``peer`` reached the collective ``state`` is in: its last call on the group has that
    number or a later one. (A collective may outlast the timeout while each wait in it is shorter:
    the slowest rank is then still inside after its peers have left, or returned.)"""
    return peer is not None and peer["group"] == state["group"] and peer["seq"] >= state["seq"]


def _plural(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _signature(state: dict) -> tuple:
    return state["op"], tuple(state["shape"]), state["dtype"]


def _mismatch_message(a, sa, b, sb, what) -> str:
    return f"ranks {a} and {b} {what}: rank {a} {describe(sa)}; rank {b} {describe(sb)}"


_DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
                torch.float16: "float16", torch.int64: "int64", torch.int32: "int32"}
_DTYPES = ("float32", "float64", "bfloat16", "float16", "int64", "int32", "uint8", "bool", "int8", "int16")


def _exchange_device(group) -> torch.device:
    """Where the signatures travel: NCCL moves CUDA tensors only (this rank's GPU), the others host ones."""
    if tdist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_signature(state: dict, group) -> None:
    """Exchange ``(seq, op, dtype, ndim, numel, first three dims)`` with the group; raise on any difference."""
    shape = state["shape"]
    mine = torch.tensor([state["seq"], _OPS.index(state["op"]) if state["op"] in _OPS else -1,
                         _DTYPES.index(state["dtype"]) if state["dtype"] in _DTYPES else -1, len(shape),
                         int(torch.tensor(shape).prod().item()) if shape else 1,
                         *(list(shape[:3]) + [-1] * (3 - len(shape[:3])))], dtype=torch.int64,
                        device=_exchange_device(group))
    everyone = mine.new_empty(len(state["group"]) * mine.numel())
    tdist.all_gather_single(everyone, mine, group=group)
    rows = everyone.view(len(state["group"]), -1)
    if bool((rows == mine).all()):
        return
    descriptions = [None] * len(state["group"])  # every rank saw the same rows: all exchange names
    tdist.all_gather_object(descriptions, {k: state[k] for k in ("seq", "op", "shape", "dtype", "module")},
                            group=group)
    me = state["group"].index(tdist.get_rank()) if tdist.get_rank() in state["group"] else 0
    other = next(i for i in range(len(rows)) if not bool((rows[i] == rows[me]).all()))
    a, b = sorted((me, other))
    da, db = ({**descriptions[i], "group": state["group"], "state": "in"} for i in (a, b))
    raise CollectiveMismatchError(_mismatch_message(state["group"][a], da, state["group"][b], db,
                                                    "issued different collectives"))
