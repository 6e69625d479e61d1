"""Room on CPython's frame stack for the engine's loops, so that no call in them maps and unmaps memory.

Since 3.11 CPython keeps a thread's frames in chunks of 16 KiB, each mapped (mmap) when a call does not fit in
the current one and unmapped as soon as that call returns. A function called many times from a depth that ends
near a chunk's end pays an mmap and a munmap on every call, and each munmap of a multi-threaded process
interrupts every other core it runs on to flush their TLBs (an inter-processor interrupt; in a VM, an exit to
the hypervisor). The engine's step calls hundreds of Python functions while its OpenMP threads compute, and
which depths those calls sit at depends on the call path above them: the bundled model in int4 at batch 4
stepped in 5.2-5.5 ms, or in 8.0-8.9 ms with one more wrapper function around the runner's `execute` (40,000
mmap/munmap pairs in 2 s, none without it; 2-core Zen 4 EPYC VM, 2026-12-06).

`call_with_room` runs a function under a frame that takes a chunk of its own, 512 KiB with room for about
250 KiB of frames after it, so a loop run under it never reaches a chunk's end: the engine's loops run so.
Where frames are not kept in chunks (before 3.11) it only calls the function.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, TypeVar

T = TypeVar("T")

# Slots (8 bytes each) the room frame declares beyond its own needs: CPython sizes a new chunk by doubling
# 16 KiB until the frame and 1,000 slots fit, so a frame of ~264 KiB gets 512 KiB, ~248 KiB of it left over.
# The declared slots are never written, so they cost address space, not memory.
ROOM_SLOTS = 33_000
HAS_FRAME_CHUNKS = sys.version_info >= (3, 11)


def _trampoline(fn, args, kwargs):
    return fn(*args, **kwargs)


def _room_frame(slots: int) -> Callable[..., Any]:
    code = _trampoline.__code__
    return type(_trampoline)(code.replace(co_stacksize=code.co_stacksize + slots), globals(), "room")


_ROOM = _room_frame(ROOM_SLOTS) if HAS_FRAME_CHUNKS else _trampoline


def call_with_room(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) under a frame with a chunk of its own (see the module's docstring)."""
    return _ROOM(fn, args, kwargs)
