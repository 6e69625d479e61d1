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
    assert M.device_total_bytes("cpu") > 0
    with pytest.raises(ValueError, match="cpu, cuda"):
        M.device_total_bytes("meta")
    monkeypatch.setenv("VLLM_NEURON_MIN_KV_BUDGET_GIB", "0")
    b = M.kv_budget_for_device("cpu", model_weight_bytes=0, gpu_memory_utilization=0.9, local_workers=2)
    assert b.on_cpu and b.mode == "default" and b.available_bytes > 0
    assert b.total_bytes <= M.host_available_bytes()  # one worker's share of host memory


@pytest.mark.gpu
def test_cuda_total_bytes():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert M.device_total_bytes("cuda") == torch.cuda.mem_get_info(0)[1]
