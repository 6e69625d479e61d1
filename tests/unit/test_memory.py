"""KV budget formulas (seeds' Memory management) on hand-computed numbers, and the probes."""

import re

import pytest

from vllm_neuron.worker import memory as M

GIB = 1 << 30


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION", "VLLM_NEURON_RESERVED_HEADROOM_GIB",
                 "VLLM_NEURON_MIN_KV_BUDGET_GIB"):
        monkeypatch.delenv(name, raising=False)


def device(**kw):
    args = dict(on_cpu=False, total_bytes=16 * GIB, model_weight_bytes=10 * GIB, gpu_memory_utilization=0.9)
    args.update(kw)
    return M.kv_budget(**args)


# --- default mode, device ---

def test_device_default_cap_binds():
    # total_budget = int(17179869184 * 0.9) = 15461882265
    # budget - weights = 15461882265 - 10737418240 = 4724464025
    # cap = int(15461882265 * 0.3) = 4638564679  -> the cap is the smaller
    b = device()
    assert b.mode == "default" and b.available_bytes == 4638564679
    assert b.cap_fraction == 0.30 and b.headroom_bytes is None


def test_device_default_weights_bind():
    # 15461882265 - 12 GiB (12884901888) = 2576980377 < cap 4638564679
    assert device(model_weight_bytes=12 * GIB).available_bytes == 2576980377


def test_device_default_cap_fraction_from_env(monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION", "0.25")
    # cap = int(15461882265 * 0.25) = 3865470566
    assert device().available_bytes == 3865470566


def test_device_default_weights_exceed_budget():
    b = device(model_weight_bytes=15 * GIB, min_kv_budget_gib=0.0)
    assert b.available_bytes == 0
    with pytest.raises(ValueError, match="^KV cache budget below minimum threshold"):
        device(model_weight_bytes=15 * GIB)


# --- headroom mode, device ---

def test_device_headroom_ignores_utilization_and_cap(monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_RESERVED_HEADROOM_GIB", "4")
    b = device(gpu_memory_utilization=0.5)
    # 16 GiB - 10 GiB - 4 GiB = 2 GiB, whatever gpu_memory_utilization and the cap say
    assert b.mode == "headroom" and b.available_bytes == 2 * GIB
    assert b.gpu_memory_utilization == 1.0 and b.cap_fraction is None and b.headroom_bytes == 4 * GIB


def test_headroom_zero_is_explicit():
    b = device(headroom_gib=0.0)
    assert b.mode == "headroom" and b.available_bytes == 6 * GIB  # not capped at 30%


# --- CPU ---

def test_cpu_default_applies_utilization_and_cap_to_worker_share():
    b = M.kv_budget(on_cpu=True, total_bytes=24 * GIB, model_weight_bytes=100 * GIB,
                    gpu_memory_utilization=0.9, local_workers=2)
    # share = 12 GiB = 12884901888; int(share * 0.9) = 11596411699; int(11596411699 * 0.3) = 3478923509
    # weights are not subtracted (already reflected in host available memory)
    assert b.total_bytes == 12 * GIB and b.available_bytes == 3478923509


def test_cpu_headroom():
    b = M.kv_budget(on_cpu=True, total_bytes=24 * GIB, model_weight_bytes=100 * GIB,
                    gpu_memory_utilization=0.9, local_workers=2, headroom_gib=4.0)
    assert b.available_bytes == 8 * GIB  # 24 / 2 - 4
    b = M.kv_budget(on_cpu=True, total_bytes=24 * GIB, model_weight_bytes=0,
                    gpu_memory_utilization=0.9, local_workers=3, headroom_gib=0)
    assert b.available_bytes == 8 * GIB


# --- minimum threshold errors ---

def test_minimum_error_headroom_reports_max_headroom():
    with pytest.raises(ValueError) as e:
        device(headroom_gib=5.5)  # 16 - 10 - 5.5 = 0.5 GiB < 1.0
    msg = str(e.value)
    assert msg.startswith("KV cache budget below minimum threshold")
    assert "VLLM_NEURON_RESERVED_HEADROOM_GIB" in msg and "VLLM_NEURON_MIN_KV_BUDGET_GIB=1.0" in msg
    assert "maximum VLLM_NEURON_RESERVED_HEADROOM_GIB that satisfies the minimum is 5.00" in msg
    assert "16.00 GiB" in msg and "10.00 GiB" in msg and "0.50 GiB" in msg  # the arithmetic
    assert "do not increase" in msg


def test_suggested_max_headroom_really_satisfies_the_minimum():
    kw = dict(on_cpu=False, total_bytes=16 * GIB + 123_456_789, model_weight_bytes=10 * GIB,
              gpu_memory_utilization=0.9, min_kv_budget_gib=1.5)
    with pytest.raises(ValueError) as e:
        M.kv_budget(headroom_gib=6.0, **kw)
    suggested = float(re.search(r"satisfies the minimum is (\d+\.\d\d)", str(e.value)).group(1))
    assert M.kv_budget(headroom_gib=suggested, **kw).available_bytes >= int(1.5 * GIB)
    with pytest.raises(ValueError):
        M.kv_budget(headroom_gib=suggested + 0.02, **kw)


def test_minimum_error_headroom_without_solution():
    with pytest.raises(ValueError, match="No VLLM_NEURON_RESERVED_HEADROOM_GIB value satisfies"):
        device(model_weight_bytes=15 * GIB + GIB // 2, headroom_gib=0)


def test_minimum_error_default_mode_advice(monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_MIN_KV_BUDGET_GIB", "5")
    with pytest.raises(ValueError) as e:
        device()
    msg = str(e.value)
    assert msg.startswith("KV cache budget below minimum threshold")
    assert "gpu_memory_utilization" in msg and "VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION" in msg
    assert "VLLM_NEURON_MIN_KV_BUDGET_GIB=5.0" in msg


def test_invalid_inputs():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        device(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="local_workers"):
        device(on_cpu=True, local_workers=0)


def test_describe_shows_arithmetic():
    text = device().describe()
    assert "default mode" in text and "0.9" in text and "0.3" in text and "16.00 GiB" in text
    text = device(headroom_gib=2).describe()
    assert "headroom mode" in text and "2.00 GiB" in text and "4.00 GiB" in text


# --- blocks and capacity ---

def test_bytes_per_block_and_blocks():
    # SmolLM2-135M: per token per layer K+V = 2 * 3 heads * 64 * 2 bytes = 768; x 30 layers x 32 tokens
    per_block = M.kv_cache_bytes_per_block(30, 3, 64, 32, 2)
    assert per_block == 737280
    assert M.kv_cache_bytes_per_block(30, 3, 64, 32, 1) == per_block // 2  # fp8
    assert M.num_blocks_from_budget(GIB, per_block) == 1456
    assert M.num_blocks_from_budget(GIB, per_block, max_model_len=8192, block_size=32) == 1456
    with pytest.raises(ValueError, match="max_model_len=8192.*256 KV blocks.*holds only 100.*3200"):
        M.num_blocks_from_budget(100 * per_block, per_block, max_model_len=8192, block_size=32)
    with pytest.raises(ValueError, match="num_kv_heads"):
        M.kv_cache_bytes_per_block(30, 0, 64, 32, 2)


def test_capacity_summary():
    assert M.capacity_summary(1456, 32, 8192) == (
        "KV cache: 1456 usable blocks (+1 reserved) of 32 tokens = 46592 tokens; maximum concurrency for 8192 tokens "
        "per request: 5.69x"
    )
    # a max_model_len that is not a multiple of the block size needs a whole extra block
    assert M.capacity_summary(10, 32, 33).endswith("5.00x")


# --- probes ---

def test_host_available_bytes(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:  4000 kB\nMemFree:  10 kB\nMemAvailable:   1000 kB\n")
    assert M.host_available_bytes(str(f)) == 1024000
    assert M.host_available_bytes() > 0


def test_device_probes(monkeypatch):
    assert M.device_free_bytes("cpu") > 0
    with pytest.raises(ValueError, match="cpu, cuda"):
        M.device_free_bytes("meta")
    monkeypatch.setenv("VLLM_NEURON_MIN_KV_BUDGET_GIB", "0")
    b = M.kv_budget_for_device("cpu", model_weight_bytes=0, gpu_memory_utilization=0.9, local_workers=2)
    assert b.on_cpu and b.mode == "default" and b.available_bytes > 0
    assert b.total_bytes <= M.host_available_bytes()  # one worker's share of host memory


@pytest.fixture
def partly_used_gpu(monkeypatch):
    """A 141 GiB CUDA device of which another process holds 101 GiB: 40 GiB free."""
    torch = pytest.importorskip("torch")
    calls = []

    def mem_get_info(device=None):
        calls.append(device)
        return 40 * GIB, 141 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return calls


def test_budget_comes_from_free_device_memory_not_total(partly_used_gpu):
    assert M.device_free_bytes("cuda:0") == 40 * GIB
    assert str(partly_used_gpu[-1]) == "cuda:0"
    # Probed before our 10 GiB of weights were loaded: the seeds' formula on the 40 GiB free.
    b = M.kv_budget_for_device("cuda", model_weight_bytes=10 * GIB, gpu_memory_utilization=0.9,
                               free_before_load=M.device_free_bytes("cuda"))
    # total_budget = int(40 GiB * 0.9) = 38654705664; - weights = 27917287424; cap = int(38654705664 * 0.3)
    assert b.total_bytes == 40 * GIB and b.available_bytes == min(38654705664 - 10 * GIB, int(38654705664 * 0.3))
    assert b.available_bytes == 11596411699  # the cap binds; from the total (141 GiB) it would be ~38 GiB
    assert "device free before loading 40.00 GiB" in b.describe()
    # Probed after loading, the resident weights are counted back in: the same budget.
    assert M.kv_budget_for_device("cuda", model_weight_bytes=10 * GIB, gpu_memory_utilization=0.9) == \
        M.kv_budget(on_cpu=False, total_bytes=50 * GIB, model_weight_bytes=10 * GIB, gpu_memory_utilization=0.9)


def test_second_engine_on_a_shared_gpu_sizes_from_what_is_left(partly_used_gpu, monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_RESERVED_HEADROOM_GIB", "2")
    b = M.kv_budget_for_device("cuda", model_weight_bytes=10 * GIB, gpu_memory_utilization=0.9,
                               free_before_load=40 * GIB)
    assert b.available_bytes == 28 * GIB  # 40 free - 10 weights - 2 headroom, not 141 - 10 - 2
    with pytest.raises(ValueError, match="device free before loading 40.00 GiB"):
        M.kv_budget_for_device("cuda", model_weight_bytes=39 * GIB, gpu_memory_utilization=0.9,
                               free_before_load=40 * GIB)


# --- the pool size across restarts (issue: free memory moved, 4096 blocks became 2048, every graph
# recompiled) ---

PER_BLOCK = 1 << 20  # 1 MiB per block keeps the arithmetic readable


def cpu_budget(free_gib: float, gmu: float = 0.9, **kw):
    """A budget computed on a host with `free_gib` available, minimum not checked (plan_kv_pool does)."""
    return lambda: M.kv_budget(on_cpu=True, total_bytes=int(free_gib * GIB), model_weight_bytes=0,
                               gpu_memory_utilization=gmu, check_minimum=False, **kw)


def plan(free_gib: float, recorded=None, gmu: float = 0.9, max_model_len: int = 4096, **kw):
    blocks, sizing = recorded if recorded is not None else (None, None)
    return M.plan_kv_pool(bytes_per_block=PER_BLOCK, max_model_len=max_model_len, block_size=32,
                          budget_fn=cpu_budget(free_gib, gmu), recorded_blocks=blocks, recorded_sizing=sizing,
                          record_path="/cache/key/manifest.json", **kw)


def test_first_start_sizes_from_the_budget_rounded_to_a_power_of_two():
    p = plan(20)
    # budget = int(int(20 GiB * 0.9) * 0.3) = 5.4 GiB = 5529 blocks of 1 MiB -> 4096
    assert p.num_blocks == 4096
    assert p.sizing == {"mode": "default", "gpu_memory_utilization": 0.9, "cap_fraction": 0.3,
                        "headroom_bytes": None}
    assert "first start with this configuration" in p.reason and "/cache/key/manifest.json" in p.reason


def test_restart_with_less_free_memory_keeps_the_recorded_pool():
    first = plan(20)
    again = plan(10, recorded=(first.num_blocks, first.sizing))  # the budget alone would give 2048
    assert again.num_blocks == 4096 and again.sizing == first.sizing
    assert "reused whatever the free memory" in again.reason and "would size 2764 blocks" in again.reason
    more = plan(200, recorded=(first.num_blocks, first.sizing))  # nor does it grow with more memory
    assert more.num_blocks == 4096


def test_restart_refused_with_the_arithmetic_when_the_recorded_pool_no_longer_fits():
    first = plan(20)
    # limit = int(4 GiB * 0.9) = 3.6 GiB < 4 GiB of recorded pool
    with pytest.raises(ValueError) as e:
        plan(4, recorded=(first.num_blocks, first.sizing))
    msg = str(e.value)
    assert "4096 blocks = 4.00 GiB" in msg and "/cache/key/manifest.json" in msg
    assert "host available / local_workers 4.00 GiB x gpu_memory_utilization 0.9 = 3.60 GiB (3686 blocks)" in msg
    assert "num_gpu_blocks_override (at most 3686" in msg
    # Just above the limit still starts: 4 GiB / 0.9 = 4.45 GiB free
    assert plan(4.5, recorded=(first.num_blocks, first.sizing)).num_blocks == 4096


def test_changed_sizing_configuration_sizes_again():
    first = plan(20)
    p = plan(20, recorded=(first.num_blocks, first.sizing), gmu=0.5)
    # int(int(20 GiB * 0.5) * 0.3) = 3 GiB = 3072 blocks -> 2048
    assert p.num_blocks == 2048 and p.sizing["gpu_memory_utilization"] == 0.5
    assert "sizing configuration changed" in p.reason
    headroom = M.plan_kv_pool(bytes_per_block=PER_BLOCK, max_model_len=4096, block_size=32,
                              budget_fn=cpu_budget(20, headroom_gib=18.0), recorded_blocks=first.num_blocks,
                              recorded_sizing=first.sizing, record_path="/m.json")
    assert headroom.num_blocks == 2048 and headroom.sizing["mode"] == "headroom"  # 2 GiB


def test_recorded_pool_too_small_for_a_longer_max_model_len_sizes_again():
    p = plan(20, recorded=(100, plan(20).sizing), max_model_len=8192)  # 100 blocks < 257 needed
    assert p.num_blocks == 4096 and "cannot hold one request of max_model_len=8192" in p.reason


def test_override_wins_and_is_checked():
    p = plan(0.001, recorded=(4096, plan(20).sizing), override=300)
    assert p.num_blocks == 300 and p.sizing == {"num_gpu_blocks_override": 300}
    with pytest.raises(ValueError, match="num_gpu_blocks_override=100 cannot hold one request of max_model_len=4096"):
        plan(20, override=100)


def test_minimum_applies_to_a_new_decision_only(monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_MIN_KV_BUDGET_GIB", "1.0")
    with pytest.raises(ValueError, match="^KV cache budget below minimum threshold"):
        plan(3)  # int(int(3 GiB * 0.9) * 0.3) = 0.81 GiB
    small = plan(5, max_model_len=1024)  # int(int(5 GiB * 0.9) * 0.3) = 1.35 GiB = 1382 blocks -> 1024
    assert small.num_blocks == 1024
    # 1.5 GiB free: a new budget (0.41 GiB) would be refused, but the recorded 1 GiB pool fits under the
    # limit (1.35 GiB) and was checked when it was sized.
    assert plan(1.5, recorded=(small.num_blocks, small.sizing), max_model_len=1024).num_blocks == 1024


def test_not_recorded_without_a_persistent_cache():
    p = M.plan_kv_pool(bytes_per_block=PER_BLOCK, max_model_len=4096, block_size=32, budget_fn=cpu_budget(10))
    assert p.num_blocks == 2048 and "not recorded" in p.reason


@pytest.mark.gpu
def test_cuda_free_bytes():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    free = M.device_free_bytes("cuda")
    assert 0 < free <= torch.cuda.mem_get_info(0)[1]
