"""The engine process's loop fills idle time with the runner's idle work, once it has been idle for a while,
without blocking while some is left, then blocks on its input (and still takes a message: shutdown)."""
import pickle
import threading
import time

import zmq

from vllm_neuron.engine import core_proc


class _IdleCore:
    def __init__(self, pieces: int) -> None:
        self.pieces = pieces
        self.calls = 0
        self.first_call = None
        self.done = threading.Event()

    def has_unfinished(self) -> bool:
        return False

    def tick_ms(self) -> None:
        return None  # no timed work (blocks held for remote readers)

    def idle_work(self) -> bool:
        self.first_call = self.first_call or time.monotonic()
        self.calls += 1
        self.pieces -= 1
        if self.pieces <= 0:
            self.done.set()
        return self.pieces > 0

    def idle_stats(self):
        return None


def test_idle_work_runs_until_done_then_the_loop_blocks_until_shutdown(monkeypatch):
    ctx = zmq.Context.instance()
    inp, feed = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = inp.bind_to_random_port("tcp://127.0.0.1")
    feed.connect(f"tcp://127.0.0.1:{port}")
    out = ctx.socket(zmq.PUSH)
    out.bind_to_random_port("tcp://127.0.0.1")
    core = _IdleCore(pieces=5)
    monkeypatch.setattr(core_proc, "_StatsRecorder", lambda metrics: None)
    monkeypatch.setattr(core_proc, "IDLE_WORK_AFTER_S", 0.3)
    t = threading.Thread(target=core_proc._loop, args=(core, inp, out, None, False), daemon=True)
    start = time.monotonic()
    t.start()
    assert core.done.wait(10)  # five pieces with no message arriving: the loop did not block after the first
    assert core.first_call - start >= 0.3  # not before the engine had been idle that long
    feed.send(pickle.dumps(("shutdown",)))
    t.join(10)
    assert not t.is_alive()
    assert core.calls == 5  # after the last piece said "nothing left" the loop blocked on its input
    for s in (inp, feed, out):
        s.close(0)


def test_poll_timeout_waits_for_idle_work_to_fall_due():
    after_ms = core_proc.IDLE_WORK_AFTER_S * 1000
    assert core_proc.poll_timeout_ms(True, True, 0.0, None) == 0  # requests run: never block
    assert core_proc.poll_timeout_ms(True, False, 9.0, 500) == 0
    assert core_proc.poll_timeout_ms(False, True, 0.0, None) == int(after_ms)  # just busy: block until due
    assert core_proc.poll_timeout_ms(False, True, 0.1, None) == int(after_ms - 100)
    assert core_proc.poll_timeout_ms(False, True, 0.0, 40) == 40  # the stats line comes first
    assert core_proc.poll_timeout_ms(False, True, 5.0, None) == 0  # due: no blocking between pieces
    assert core_proc.poll_timeout_ms(False, False, 5.0, None) is None  # nothing left: block on the input
    assert core_proc.poll_timeout_ms(False, False, 5.0, 700) == 700
