"""glibc's malloc_trim: the heap's free pages given back to the system.

Freed memory stays in glibc's heaps (one arena per thread that allocated), so a process that once held a
large request, or compiled grammars in worker threads, keeps its peak RSS. The API server trims after large
requests (entrypoints/openai/http_edge.py), an engine core when it idles and once a minute
(engine/core_proc.py). A trim takes milliseconds.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Callable


def _load() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _load()


def available() -> bool:
    return _TRIM is not None


def trim() -> bool:
    """Gives the free pages of every arena back; False where there is no malloc_trim."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
