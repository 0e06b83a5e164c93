"""Discrete choices made once and replayed: what lets verify compare a mixture of experts below
float64 (see :class:`RoutingReplay`)."""
from __future__ import annotations

import contextlib

import torch


class RoutingReplay(torch.overrides.TorchFunctionMode):
    """Discrete choices made once, by the float64 reference, and replayed in both compared models.

    A mixture-of-experts router picks its experts with ``topk``; where two experts' scores are
    within rounding of each other (common in bfloat16), the split and the unsplit model can pick
    differently with nothing wrong, and the token's output then differs by O(1): a false
    divergence. Inside ``with routing:`` every ``topk`` result is recorded (the input's shape and
    the indices); inside ``with routing.replaying():`` each ``topk`` call, in the same order,
    returns the recorded indices and the caller's own values at them (``gather``, so the routing
    weights still come from the model under test and carry its gradient). A call that does not
    match the recording (another shape, more calls) ends the replay for the rest of that pass and
    is reported. Only verify below float64 replays; the float64 comparison chooses for itself.

    While recording it also notes ``lowest``, the lowest precision of any result gradients flow
    through: a float64 model whose router runs its softmax in float32 is exact to float32 only,
    and is judged by float32's tolerance where float64's is asked for.
    """

    def __init__(self):
        super().__init__()
        self.lowest = torch.float64
        self.calls: list = []  # (input shape, dim, indices)
        self._replay: int | None = None
        self.replayed = 0
        self.mismatch = ""

    @contextlib.contextmanager
    def replaying(self):
        self._replay = 0
        try:
            with self:
                yield self
            if self._replay < len(self.calls):
                self.mismatch = self.mismatch or f"{self._replay} top-k calls where the reference made {len(self.calls)}"
        finally:
            self._replay = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._replay is None:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
                        and torch.finfo(t.dtype).bits < torch.finfo(self.lowest).bits):
                    self.lowest = t.dtype
        if func not in (torch.topk, torch.Tensor.topk):
            return out
        x, dim = args[0], kwargs.get("dim", args[2] if len(args) > 2 else -1)
        if self._replay is None:
            self.calls.append((tuple(x.shape), dim, out.indices.detach().clone()))
            return out
        if self._replay >= len(self.calls) or self.calls[self._replay][:2] != (tuple(x.shape), dim):
            self.mismatch = self.mismatch or (f"top-k call {self._replay + 1} on {tuple(x.shape)} does not match "
                                              f"the reference's {len(self.calls)} calls")
            self._replay = len(self.calls) + 1  # stop replaying for the rest of this pass
            return out
        idx = self.calls[self._replay][2]
        self._replay += 1
        self.replayed += 1
        return torch.return_types.topk((x.gather(dim, idx), idx))

    def message(self) -> str:
        if not self.calls:
            return ""
        return (f"{len(self.calls)} top-k choices (routers) replayed from the float64 reference"
                + (f"; replay stopped: {self.mismatch}" if self.mismatch else ""))
