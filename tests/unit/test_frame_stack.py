"""frame_stack.call_with_room: a call repeated at a depth that ends near a frame stack chunk's end maps and unmaps
a chunk each time (seen here as a page fault per call: a fresh mapping's first write); under the room frame it
does not, at any depth."""
from __future__ import annotations

import resource
import threading

import pytest

from vllm_neuron import frame_stack

CALLS = 200
DEPTHS = range(0, 320, 3)  # ~120-byte frames: 320 of them cross two 16 KiB chunk ends


def _leaf():
    return None


# An 8 KiB frame: from about half the depths in a chunk it does not fit in what is left.
_WIDE_LEAF = type(_leaf)(_leaf.__code__.replace(co_stacksize=1000), globals(), "wide_leaf")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _faults_at(depth: int) -> int:
    """Page faults of CALLS calls of the wide leaf from `depth` frames further down."""
    if depth:
        return _faults_at(depth - 1)
    before = _faults()
    for _ in range(CALLS):
        _WIDE_LEAF()
    return _faults() - before


def _worst_depth() -> int:
    _faults_at(0)  # the pages the scan's own frames use, touched once
    return max(_faults_at(d) for d in DEPTHS)


def _in_thread(fn):
    """fn() on a new thread (a fresh frame stack, whatever this one's depth), its result."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@pytest.mark.skipif(not frame_stack.HAS_FRAME_CHUNKS, reason="frames are kept in chunks from CPython 3.11 on")
def test_a_call_at_a_chunks_end_maps_a_chunk_each_time_but_not_under_the_room_frame():
    # The premise, on this interpreter: without the room some depth pays a fresh chunk per call.
    assert _in_thread(_worst_depth) >= CALLS
    under_room = _in_thread(lambda: frame_stack.call_with_room(_worst_depth))
    assert under_room < CALLS // 20


def test_call_with_room_passes_arguments_and_results_and_exceptions():
    assert frame_stack.call_with_room(lambda a, b=0: (a, b), 1, b=2) == (1, 2)
    with pytest.raises(KeyError, match="x"):
        frame_stack.call_with_room({}.__getitem__, "x")


def test_the_room_frame_fits_in_a_chunk_of_its_own_with_room_to_spare():
    if not frame_stack.HAS_FRAME_CHUNKS:
        assert frame_stack._ROOM is frame_stack._trampoline
        return
    code = frame_stack._ROOM.__code__
    frame_bytes = 8 * (code.co_stacksize + code.co_nlocals + 10)
    chunk = 16 << 10
    while chunk < frame_bytes + 8 * 1000:  # CPython's sizing of a new chunk (push_chunk)
        chunk *= 2
    assert chunk - frame_bytes >= 200 << 10, (chunk, frame_bytes)
