"""Layer-wise sending (``KVRequest.stream``): ``LayerProgress`` is how far the forward has written
a context request's KV. The step loop advances it; the context side's pair thread
(``kv_sender``) waits on it before sending each layer's chunks. Its own module so that the
sender stays one concept (the pair threads and ``KVSender``).
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kv_groups import Deadline


class LayerProgress:
    """How far the forward has written a context request's KV, and its first token once
    sampled. The step loop advances it (``advance``, ``finish``, ``cancel``); the pair thread
    waits on it within the op's deadline. ``events[i]``: what to synchronize on before reading
    layer i (a CUDA event recorded after the layer on the compute stream; None on CPU, where the
    layer's writes are done when ``advance`` is called)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.cond = threading.Condition()
        self.layers = 0
        self.events: list[object | None] = []
        self.first_token: int | None = None
        self.cancelled = ""

    def advance(self, layers: int, event: object | None = None) -> None:
        with self.cond:
            while len(self.events) < min(layers, self.num_layers):
                self.events.append(event)
            self.layers = max(self.layers, layers)
            self.cond.notify_all()

    def finish(self, first_token: int) -> None:
        """The prefill is over: every layer is written and the first token sampled."""
        with self.cond:
            if self.cancelled:
                return
            self.events.extend([None] * (self.num_layers - len(self.events)))
            self.layers = self.num_layers
            self.first_token = first_token
            self.cond.notify_all()

    def cancel(self, reason: str) -> None:
        with self.cond:
            if self.first_token is None and not self.cancelled:
                self.cancelled = reason or "cancelled"
                self.cond.notify_all()

    def wait_layer(self, layer: int, deadline: Deadline) -> bool:
        """Block until ``layer`` is written: True, or False once cancelled (the rest of the
        payload then goes without waiting, as filler the generation side will discard)."""
        with self.cond:
            while self.layers <= layer and not self.cancelled:
                left = deadline.at - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"layer {layer} was not written before the deadline")
                self.cond.wait(left)
            if self.cancelled:
                return False
            event = self.events[layer]
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]
        return True

    def wait_token(self, deadline: Deadline) -> tuple[int | None, str]:
        """(first token, "") once sampled, or (None, why) once cancelled."""
        with self.cond:
            while self.first_token is None and not self.cancelled:
                left = deadline.at - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the first token was not sampled before the deadline")
                self.cond.wait(left)
            return self.first_token, self.cancelled
