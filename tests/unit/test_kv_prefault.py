import numpy as np
import pytest
import torch

from vllm_neuron.worker.kv_prefault import KVPrefaulter, next_sweep


def test_next_sweep_waits_for_the_frontier_then_takes_at_least_a_chunk():
    assert next_sweep(frontier=10, newest=9, chunk=4, num_blocks=100) is None
    assert next_sweep(frontier=0, newest=0, chunk=4, num_blocks=100) == (0, 4)
    assert next_sweep(frontier=10, newest=10, chunk=4, num_blocks=100) == (10, 14)
    # A step that jumps past a chunk is covered whole.
    assert next_sweep(frontier=10, newest=30, chunk=4, num_blocks=100) == (10, 31)
    # Never past the pool; nothing left once it is all backed.
    assert next_sweep(frontier=98, newest=98, chunk=4, num_blocks=100) == (98, 100)
    assert next_sweep(frontier=100, newest=120, chunk=4, num_blocks=100) is None


def _pool(num_blocks, block_size):
    return [torch.from_numpy(np.zeros((num_blocks * block_size, 2, 8), dtype=np.int16)).view(torch.bfloat16)
            for _ in range(4)]


def _resident_pages(t: torch.Tensor) -> int:
    """Pages of t's memory that are mapped (mincore), to see the sweep touch them."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.nbytes - start
    vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0
    return sum(v & 1 for v in vec)


def test_sweeps_follow_the_newest_block_and_keep_contents():
    bs, nb = 16, 64
    pool = _pool(nb, bs)
    per_block = sum(t[:bs].nbytes for t in pool)
    pf = KVPrefaulter(pool, bs, nb, chunk_bytes=8 * per_block, page_bytes=1)  # a page per block at most
    assert pf.chunk == 8
    pool[0][3 * bs + 1].fill_(1.5)  # data in a block below the first sweep's end survives it
    pf.before_step([[1, 2], [3]])
    assert pf.frontier == 8 and pf.swept_bytes == 8 * per_block
    assert torch.all(pool[0][3 * bs + 1] == 1.5)
    pf.before_step([[1, 2, 7]])  # still below the frontier: nothing to do
    assert pf.frontier == 8 and pf.swept_bytes == 8 * per_block
    pf.before_step([[4], [5, 20]])
    assert pf.frontier == 21
    pf.before_step([[], [63]])
    assert pf.frontier == nb
    pf.before_step([[63]])
    assert pf.swept_bytes == nb * per_block


def _fresh_pool(num_blocks, block_size):
    """K/V tensors on fresh anonymous mappings: none of their pages is mapped until written."""
    import mmap
    maps = [mmap.mmap(-1, num_blocks * block_size * 16 * 2) for _ in range(4)]
    return maps, [torch.frombuffer(m, dtype=torch.bfloat16).view(num_blocks * block_size, 2, 8) for m in maps]


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="mincore as Linux has it")
def test_a_sweep_maps_the_pages_of_the_swept_blocks_and_no_others():
    bs, nb = 256, 256  # one block = 256 slots x 16 bf16 = 8 KiB: two pages per tensor
    maps, pool = _fresh_pool(nb, bs)
    swept = [t[:41 * bs] for t in pool]
    rest = [t[48 * bs:] for t in pool]
    assert all(_resident_pages(t) == 0 for t in swept)
    KVPrefaulter(pool, bs, nb, chunk_bytes=1).before_step([[0, 40]])
    assert all(_resident_pages(t) == t.nbytes // __import__("mmap").PAGESIZE for t in swept)
    assert all(_resident_pages(t) == 0 for t in rest)
    del pool, swept, rest
    for m in maps:
        m.close()


def test_idle_sweeps_go_one_tensor_at_a_time_up_to_a_bound_ahead_of_the_newest_block():
    bs, nb = 4, 200
    pool = _pool(nb, bs)
    per_block = sum(t[:bs].nbytes for t in pool)
    per_tensor = pool[0][:bs].nbytes
    pf = KVPrefaulter(pool, bs, nb, chunk_bytes=8 * per_block, idle_ahead_bytes=16 * per_block,
                      idle_piece_bytes=8 * per_tensor, page_bytes=1)
    touched = []
    real_touch = pf._touch
    pf._touch = lambda t, start, end: (touched.append(([x is t for x in pool].index(True), start, end)), real_touch(t, start, end))
    pieces = 0
    while pf.sweep_idle():
        pieces += 1
        # a piece is one tensor's 8 blocks; the frontier moves once all four tensors hold them
        assert touched[-1] == ((pieces - 1) % 4, 8 * ((pieces - 1) // 4), 8 * ((pieces - 1) // 4) + 8)
        assert pf.frontier == 8 * (pieces // 4)
    assert pf.frontier == 16 and pieces == 8  # idle_ahead_bytes past "no block seen yet"
    pf.sweep_idle()
    pf.sweep_idle()  # two tensors hold blocks 16-23 when a step needs block 40: every tensor is swept
    pf.before_step([[40]])  # a step past the frontier sweeps at least to its newest block
    assert pf.frontier == 41 and touched[-1][1:] == (16, 41)
    while pf.sweep_idle():
        pass
    assert pf.frontier == 41 + 16
    pool[1][45 * bs].fill_(2.0)
    pf.before_step([[199]])
    while pf.sweep_idle():
        pass
    assert pf.frontier == nb and torch.all(pool[1][45 * bs] == 2.0)


def test_pages_holding_many_blocks_move_the_frontier_to_a_page_boundary():
    """With the pool in pages of 8 blocks (2 MiB huge pages hold ~170 of the bundled model's), a sweep
    that needs block 10 backs the whole page 8-15 anyway: the frontier goes to 16, and a step reaching
    block 15 sweeps nothing."""
    bs, nb = 4, 100
    pool = _pool(nb, bs)
    per_tensor = pool[0][:bs].nbytes
    pf = KVPrefaulter(pool, bs, nb, chunk_bytes=1, page_bytes=8 * per_tensor, idle_ahead_bytes=1,
                      idle_piece_bytes=1)
    assert pf.page_blocks == 8
    pf.before_step([[10]])
    assert pf.frontier == 16
    pf.before_step([[15]])
    assert pf.frontier == 16
    assert pf.sweep_idle() and pf._idle_tensor == 1  # an idle piece rounds up to a page too
    for _ in range(3):
        pf.sweep_idle()
    assert pf.frontier == 24
    pf.before_step([[97]])
    assert pf.frontier == nb  # never past the pool
