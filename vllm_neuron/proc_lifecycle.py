"""Process-wide hooks of the serving processes (API server, EngineCore): stack dumps on demand, a quick exit.

`kill -USR1 <pid>` prints every thread's Python stack to the process's stderr (the server log) and the process goes
on: what a stuck shutdown or a hung step is doing, without py-spy on the machine.
"""
from __future__ import annotations

import faulthandler
import gc
import signal
import sys

STACK_DUMP_SIGNAL = signal.SIGUSR1


def install_stack_dumps() -> None:
    """SIGUSR1 prints all threads' stacks to stderr (where the process has one) instead of ending the process."""
    if sys.stderr is not None and hasattr(sys.stderr, "fileno"):
        faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def before_exit() -> None:
    """Called once the process's work is done: the interpreter's final collections would walk the whole heap (torch,
    transformers and the model's objects: a second or more of a 2-core machine, several under load) only to free what
    the exit frees anyway; frozen objects are skipped."""
    gc.freeze()
