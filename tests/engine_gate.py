"""A logits processor that holds or slows the engine's sampling steps while a gate file exists, so that a test
can keep requests admitted (running or queued) for as long as it needs, whatever the machine's speed:

    vllm-neuron serve DIR --logits-processors tests.engine_gate:EngineGate   (TEST_ENGINE_GATE=/path/to/gate)

    with gate_closed(path):       # the engine stops at its next step; nothing finishes
        ...
    with gate_paced(path, 0.02):  # every step takes 20 ms more: a 1,000-token request runs for 20 s at least
        ...
    # the file is gone: the engine goes on at its own speed

A step is held for at most HOLD_LIMIT_S, well inside the engine's iteration timeout (a forgotten gate must not
make the engine look hung). Without the variable the processor does nothing.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm_neuron.logits_processor import BatchUpdate, LogitsProcessor

GATE_ENV = "TEST_ENGINE_GATE"
HOLD_LIMIT_S = 30.0


class EngineGate(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        self.path = os.environ.get(GATE_ENV)

    def apply(self, logits: Any) -> Any:
        deadline = time.monotonic() + HOLD_LIMIT_S
        while self.path and time.monotonic() < deadline:
            try:
                with open(self.path) as f:
                    pace = f.read().strip()
            except FileNotFoundError:
                break
            if pace:  # a paced step: one sleep, then on
                time.sleep(float(pace))
                break
            time.sleep(0.01)
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass


def gate_closed(path: str) -> Iterator[None]:
    """The engine holds at its next sampling step until the block ends."""
    return gate_paced(path, None)


@contextmanager
def gate_paced(path: str, seconds: float | None) -> Iterator[None]:
    """Every sampling step takes `seconds` more until the block ends (None: the engine holds instead)."""
    with open(path + ".tmp", "w") as f:
        f.write("" if seconds is None else repr(seconds))
    os.replace(path + ".tmp", path)  # the processor never reads a half-written file
    try:
        yield
    finally:
        os.remove(path)
