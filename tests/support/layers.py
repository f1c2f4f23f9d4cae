"""Stand-ins for the CUDA events layer-wise push waits on (``kvpush.vllm._layers.Event``)."""

from __future__ import annotations

import threading


class Pending:
    """A CUDA event stand-in: ``synchronize`` blocks until the test completes it (``done``)."""

    def __init__(self) -> None:
        self.recorded = False
        self.done = threading.Event()

    def record(self) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        assert self.recorded, "waited on before it was recorded"
        assert self.done.wait(10.0), "never completed"


class Events(list[Pending]):
    """Makes a gate's events (it is called for each), and keeps them for the test to complete."""

    def __call__(self) -> Pending:
        self.append(Pending())
        return self[-1]
