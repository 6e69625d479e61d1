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
    pf = KVPrefaulter(pool, bs, nb, chunk_bytes=8 * per_block)
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


def test_idle_sweeps_go_in_small_pieces_up_to_a_bound_ahead_of_the_newest_block():
    bs, nb = 4, 200
    pool = _pool(nb, bs)
    per_block = sum(t[:bs].nbytes for t in pool)
    pf = KVPrefaulter(pool, bs, nb, chunk_bytes=8 * per_block, idle_ahead_bytes=16 * per_block,
                      idle_piece_bytes=2 * per_block)
    pieces = 0
    while pf.sweep_idle():
        pieces += 1
        assert pf.frontier == 2 * pieces  # a piece at a time
    assert pf.frontier == 16  # idle_ahead_bytes past "no block seen yet"
    pf.before_step([[40]])  # a step past the frontier sweeps at least to its newest block
    assert pf.frontier == 41
    while pf.sweep_idle():
        pass
    assert pf.frontier == 41 + 16
    pool[1][45 * bs].fill_(2.0)
    pf.before_step([[199]])
    while pf.sweep_idle():
        pass
    assert pf.frontier == nb and torch.all(pool[1][45 * bs] == 2.0)
