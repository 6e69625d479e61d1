"""Huge-page host memory (vllm_neuron/huge_pages.py): what goes there, that values survive, and that the
mapping really asks the kernel for huge pages."""
import torch
from torch import nn

from vllm_neuron import huge_pages


def _vm_flags(ptr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds address ptr."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


def _force(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(huge_pages, "available", lambda: on)


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert huge_pages.thp_mode(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert huge_pages.thp_mode(str(f)) == "always"
    f.write_text("always madvise [never]\n")
    assert huge_pages.thp_mode(str(f)) == "never"
    assert huge_pages.thp_mode(str(tmp_path / "missing")) == ""


def test_off_by_environment_or_kernel(monkeypatch):
    huge_pages.available.cache_clear()
    monkeypatch.setenv("VLLM_NEURON_HUGE_PAGES", "0")
    assert not huge_pages.available()
    huge_pages.available.cache_clear()
    monkeypatch.setenv("VLLM_NEURON_HUGE_PAGES", "1")
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    assert not huge_pages.available()
    huge_pages.available.cache_clear()
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    assert huge_pages.available()
    huge_pages.available.cache_clear()


def test_zeros_is_zeroed_aligned_and_madvised():
    t = huge_pages.zeros((3, 1 << 20), torch.bfloat16)
    assert t.shape == (3, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.PAGE == 0
    assert not t.any()
    t[2, -1] = 5.0  # the last element lies inside the mapping
    assert t[2, -1].item() == 5.0
    assert "hg" in _vm_flags(t.data_ptr())  # MADV_HUGEPAGE took


def test_zeros_outlives_the_names_that_made_it():
    views = [huge_pages.zeros((1 << 20,), torch.float32)[10:20] for _ in range(3)]
    for i, v in enumerate(views):
        v.fill_(i)
    import gc
    gc.collect()
    assert [v.sum().item() for v in views] == [0.0, 10.0, 20.0]


def test_copy_moves_big_cpu_tensors_only(monkeypatch):
    _force(monkeypatch, True)
    big = torch.randn(1 << 21)  # 8 MiB
    moved = huge_pages.copy(big)
    assert moved is not big and torch.equal(moved, big) and moved.data_ptr() % huge_pages.PAGE == 0
    small = torch.randn(1000)
    assert huge_pages.copy(small) is small
    _force(monkeypatch, False)
    assert huge_pages.copy(big) is big


def test_move_parameters_keeps_values_and_ties(monkeypatch):
    _force(monkeypatch, True)
    emb = nn.Embedding(8192, 256)  # 8 MiB fp32
    head = nn.Linear(256, 8192, bias=False)
    head.weight = emb.weight  # tied, as the bundled model's lm_head
    small = nn.Linear(4, 4)
    model = nn.ModuleList([emb, head, small])
    model.register_buffer("table", torch.arange(1 << 21, dtype=torch.float32))
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    small_ptr = small.weight.data_ptr()
    moved, nbytes = huge_pages.move_parameters_(model)
    assert moved == 2 and nbytes == 2 * (8 << 20)  # the tied weight once, the buffer; not the small linear
    assert head.weight is emb.weight and emb.weight.data_ptr() % huge_pages.PAGE == 0
    assert model.table.data_ptr() % huge_pages.PAGE == 0
    assert small.weight.data_ptr() == small_ptr
    for n, p in model.state_dict().items():
        assert torch.equal(p, before[n]), n



def test_the_kv_pool_goes_to_huge_pages_only_when_asked(monkeypatch):
    from vllm_neuron.worker.model_setup import zeros
    cpu = torch.device("cpu")
    _force(monkeypatch, True)
    shape = (4 * 4096, 3, 64)  # 6 MiB of bf16: above MIN_BYTES
    monkeypatch.setenv("VLLM_NEURON_KV_HUGE_PAGES", "0")
    assert not huge_pages.kv_wanted(6 << 20, cpu)
    made = []
    real = huge_pages.zeros
    monkeypatch.setattr(huge_pages, "zeros", lambda *a: made.append(a) or real(*a))
    plain = zeros(shape, torch.bfloat16, cpu)
    assert made == [] and plain.shape == shape and not plain.any()  # numpy's calloc, not a huge-page mapping
    monkeypatch.setenv("VLLM_NEURON_KV_HUGE_PAGES", "1")
    assert huge_pages.kv_wanted(6 << 20, cpu) and not huge_pages.kv_wanted(1 << 20, cpu)
    assert not huge_pages.kv_wanted(6 << 20, torch.device("meta"))
    pool = zeros(shape, torch.bfloat16, cpu)
    assert made == [(shape, torch.bfloat16)]
    assert pool.shape == shape and pool.data_ptr() % huge_pages.PAGE == 0 and not pool.any()
    assert "hg" in _vm_flags(pool.data_ptr())
    _force(monkeypatch, False)  # VLLM_NEURON_HUGE_PAGES=0 or THP off wins
    assert not huge_pages.kv_wanted(6 << 20, cpu)


def test_an_arena_lays_copies_side_by_side_and_hands_back_what_does_not_fit(monkeypatch):
    _force(monkeypatch, True)
    a, b = torch.randn(3000, 7), torch.randn(64, 32).t()  # 84,000 bytes; a strided view
    arena = huge_pages.Arena(huge_pages.Arena.footprint(a) + huge_pages.Arena.footprint(b))
    pa, pb = arena.place(a), arena.place(b)
    assert torch.equal(pa, a) and torch.equal(pb, b) and pb.is_contiguous()
    assert pa.data_ptr() % huge_pages.PAGE == 0
    assert pb.data_ptr() == pa.data_ptr() + huge_pages.Arena.footprint(a)  # next 4 KiB boundary: 86,016
    # storages of their own: torch.compile would take two tensors on one storage for aliases
    assert pa.untyped_storage().data_ptr() != pb.untyped_storage().data_ptr()
    assert "hg" in _vm_flags(pb.data_ptr())
    full = torch.randn(4)
    assert arena.place(full) is full
    _force(monkeypatch, False)
    assert huge_pages.Arena(1 << 20).place(a) is a


def test_a_models_weights_share_one_mapping_in_order_and_views_keep_their_storage(monkeypatch):
    _force(monkeypatch, True)
    layers = nn.ModuleList([nn.Linear(256, 384, bias=True) for _ in range(3)])  # 384 KiB weights: below MIN_BYTES
    fused = torch.randn(512, 256)
    layers.register_buffer("q_half", fused[:256])  # a slice of a fused weight keeps sharing it
    layers[2].weight = layers[0].weight  # tied
    layers.register_buffer("same", layers[1].weight.data)  # a second tensor on one storage
    before = {n: p.detach().clone() for n, p in layers.state_dict().items()}
    bias_ptr, half_ptr = layers[0].bias.data_ptr(), layers.q_half.data_ptr()
    moved, nbytes = huge_pages.move_parameters_(layers)
    assert (moved, nbytes) == (2, 2 * 384 * 1024)
    w0, w1 = layers[0].weight, layers[1].weight
    assert w0.data_ptr() % huge_pages.PAGE == 0 and w1.data_ptr() == w0.data_ptr() + 384 * 1024
    assert layers[2].weight is w0 and layers.same.data_ptr() == w1.data_ptr()
    assert "hg" in _vm_flags(w1.data_ptr())
    assert layers[0].bias.data_ptr() == bias_ptr and layers.q_half.data_ptr() == half_ptr  # small; a view
    for n, p in layers.state_dict().items():
        assert torch.equal(p, before[n]), n
