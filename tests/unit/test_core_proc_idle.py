"""The engine process's loop fills idle time with the runner's idle work, without blocking while some is
left, then blocks on its input (and still takes a message: shutdown)."""
import pickle
import threading

import zmq

from vllm_neuron.engine import core_proc


class _IdleCore:
    def __init__(self, pieces: int) -> None:
        self.pieces = pieces
        self.calls = 0
        self.done = threading.Event()

    def has_unfinished(self) -> bool:
        return False

    def idle_work(self) -> bool:
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
    t = threading.Thread(target=core_proc._loop, args=(core, inp, out, None, False), daemon=True)
    t.start()
    assert core.done.wait(10)  # five pieces with no message arriving: the loop did not block after the first
    feed.send(pickle.dumps(("shutdown",)))
    t.join(10)
    assert not t.is_alive()
    assert core.calls == 5  # after the last piece said "nothing left" the loop blocked on its input
    for s in (inp, feed, out):
        s.close(0)
