"""Progress events from rank 0 of a launch to a callback in the launching process (what
`tensorpar train` draws its progress bar from): a pipe read by a thread of this process while the
launch waits for the ranks, or, under torchrun, where rank 0 is this process, a direct call."""
from __future__ import annotations

import multiprocessing as mp
import threading

from tensorpar.distributed.rendezvous import under_torchrun


class Sink:
    """What rank 0 calls with each event: a pipe's end (spawned ranks) or the callback itself (torchrun)."""

    def __init__(self, conn=None, callback=None):
        self.conn, self.callback = conn, callback

    def send(self, event: dict) -> None:
        if self.callback is not None:
            self.callback(event)
        elif self.conn is not None:
            self.conn.send(event)


class Relay:
    """Events from rank 0 to ``callback``: a thread of this process reads them from a pipe while
    the launch waits for the ranks; under torchrun rank 0 is this process and calls it directly."""

    def __init__(self, callback):
        self.callback, self._thread = callback, None
        if callback is None or under_torchrun():
            self.sink = Sink(callback=callback)
            return
        self._recv, send = mp.get_context("spawn").Pipe(duplex=False)
        self.sink, self._stop = Sink(conn=send), threading.Event()
        self._thread = threading.Thread(target=self._pump, name="tensorpar-train-progress", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while True:
            if not self._recv.poll(0.1):
                if self._stop.is_set():
                    return
                continue
            try:
                event = self._recv.recv()
            except (EOFError, OSError):
                return
            try:
                self.callback(event)
            except Exception:  # noqa: BLE001 - a display error must not stop the reading (rank 0 would block)
                pass

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._recv.close()
            self.sink.conn.close()
