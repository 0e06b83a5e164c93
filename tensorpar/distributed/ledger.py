"""The communication ledger: every collective this rank issues, with the bytes it sends.

``with ledger() as led:`` opens a recording scope on this process; collectives issued inside it
(through :mod:`tensorpar.distributed.collectives`) append a :class:`CollectiveRecord`. Bytes sent per
rank follow the ring algorithms (Patarasuk & Yuan 2009; NCCL docs, "PERFORMANCE.md"):

    all-reduce                  2 (p - 1) / p * N
    all-gather, reduce-scatter      (p - 1) / p * N
    broadcast                              per rank, by the backend's algorithm:
                                           NCCL, a pipelined chain src -> src+1 -> ...: N each,
                                           the chain's last rank 0; gloo, a binomial tree
                                           (gloo/broadcast.cc): N per child, ceil(log2 p) at src

where N is the full tensor's bytes: the all-reduced tensor, the all-gather's result, the
reduce-scatter's input. These are the formula (:func:`tensorpar.architecture.ring.ring_bytes_sent`)
applied to the recorded calls, the same formula the planner predicts with: "ledger equals
planner" checks the calls and their sizes. What the sockets really carried is a separate measure: ``ledger(wire=True)`` also records, for each synchronous
collective on gloo, the bytes this process's TCP sockets sent and received during the call
(:mod:`tensorpar.distributed.wire`, from the kernel's counters), in ``wire_bytes_sent`` /
``wire_bytes_received`` (``None`` where not measured: NCCL, asynchronous calls).

While a ledger is open, global module hooks keep a stack of the modules being run, so each record
names the innermost module that issued it; a collective issued in backward is named after the
forward that created it. With no ledger open nothing is recorded and no hook is installed.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace

import torch
from torch.nn.modules import module as nn_module

from tensorpar.architecture.ring import ring_bytes_sent

# The open ledger of this execution context. A ContextVar rather than a module global: it is
# scoped by the `with` block that sets it, and threads or tasks never see each other's.
_ACTIVE: contextvars.ContextVar["Ledger | None"] = contextvars.ContextVar("tensorpar_ledger", default=None)


@dataclass(frozen=True)
class CollectiveRecord:
    op: str
    module: str
    phase: str  # "forward" or "backward"
    shape: tuple
    dtype: str
    group_size: int
    payload_bytes: int
    bytes_sent: int  # the ring formula for this call
    wire_bytes_sent: int | None = None  # what the TCP sockets carried (``ledger(wire=True)``)
    wire_bytes_received: int | None = None
    seconds: float | None = None  # this rank's wall time in the call (synchronous calls; None: async)
    group: str = ""  # the process group's name (``ProcessGroup.group_name``): which mesh dimension

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclass
class Ledger:
    """Records of the collectives issued while open, with summaries."""

    names: dict = field(default_factory=dict)  # id(module) -> qualified name
    records: list = field(default_factory=list)
    is_open: bool = True
    wire: bool = False  # also count the bytes on the wire (tensorpar.distributed.wire) of each synchronous call
    _stack: list = field(default_factory=list)

    def current_module(self) -> str:
        return self._stack[-1] if self._stack else ""

    def record(self, op: str, tensor: torch.Tensor, group_size: int, *, phase: str, module: str | None = None,
               shape: tuple | None = None, rank: int = 0, src: int = 0, broadcast_algorithm: str = "chain",
               group: str = "") -> None:
        shape = tuple(tensor.shape) if shape is None else tuple(shape)
        payload = math.prod(shape) * tensor.element_size()
        self.records.append(CollectiveRecord(
            op=op, module=self.current_module() if module is None else module, phase=phase, shape=shape,
            dtype=str(tensor.dtype).removeprefix("torch."), group_size=group_size,
            payload_bytes=payload, bytes_sent=ring_bytes_sent(op, payload, group_size, rank=rank, src=src,
                                                               broadcast_algorithm=broadcast_algorithm),
            group=group))

    def set_wire(self, record_index: int, sent: int, received: int) -> None:
        self.records[record_index] = replace(self.records[record_index], wire_bytes_sent=sent,
                                             wire_bytes_received=received)

    def set_seconds(self, record_index: int, seconds: float) -> None:
        self.records[record_index] = replace(self.records[record_index], seconds=seconds)

    def seconds_in_collectives(self) -> float:
        """Wall time this rank spent inside the recorded synchronous calls (waiting for peers included)."""
        return sum(r.seconds for r in self.records if r.seconds is not None)

    def total_bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.records)

    def wire_bytes_sent(self) -> int | None:
        """Bytes the sockets carried over every recorded call, or None unless each call was measured."""
        sent = [r.wire_bytes_sent for r in self.records]
        return None if any(b is None for b in sent) else sum(sent)

    def by_module(self) -> dict:
        return _summarise(self.records, lambda r: r.module)

    def by_op(self) -> dict:
        return _summarise(self.records, lambda r: r.op)

    def to_dict(self) -> dict:
        return {"records": [r.to_dict() for r in self.records], "by_module": self.by_module(),
                "by_op": self.by_op(), "total_bytes_sent": self.total_bytes_sent(),
                "wire_bytes_sent": self.wire_bytes_sent()}

    def name_of(self, module) -> str:
        """What the records call ``module``: its qualified name in the model the ledger was opened
        on, else its class name."""
        return self.names.get(id(module), type(module).__name__)

    def _push(self, module, _inputs):
        self._stack.append(self.name_of(module))

    def _pop(self, _module, _inputs, _output):
        if self._stack:
            self._stack.pop()


def _summarise(records, key) -> dict:
    out = defaultdict(lambda: {"count": 0, "payload_bytes": 0, "bytes_sent": 0})
    for r in records:
        s = out[key(r)]
        s["count"] += 1
        s["payload_bytes"] += r.payload_bytes
        s["bytes_sent"] += r.bytes_sent
    return dict(out)


def active_ledger() -> Ledger | None:
    return _ACTIVE.get()


def ledger_for_backward(captured: Ledger | None) -> Ledger | None:
    """The ledger a backward collective records into: the one open when its forward ran.

    The autograd engine may run backward on its own threads (always on CUDA), which do not see
    this thread's context; the forward captures its ledger so that backward still records.
    """
    if captured is not None and captured.is_open:
        return captured
    return active_ledger()


@contextlib.contextmanager
def ledger(model: torch.nn.Module | None = None, *, wire: bool = False):
    """Record every collective issued on this rank inside the block.

    ``model``: name records by ``model.named_modules()`` (e.g. ``"layers.0.mlp.down_proj"``);
    without it, by class name. Ledgers nest: the inner one records, the outer resumes after.
    ``wire``: also count each synchronous call's bytes on the wire (gloo on Linux; tens of
    microseconds a call, see :mod:`tensorpar.distributed.wire`).
    """
    led = Ledger(names={id(m): (name or type(m).__name__) for name, m in model.named_modules()} if model else {},
                 wire=wire)
    pre = nn_module.register_module_forward_pre_hook(led._push)
    post = nn_module.register_module_forward_hook(led._pop, always_call=True)
    token = _ACTIVE.set(led)
    try:
        yield led
    finally:
        led.is_open = False
        _ACTIVE.reset(token)
        pre.remove()
        post.remove()
