"""KV cache memory budget: the seeds' Memory management formulas, the probes they need, and the
pool-size policy that keeps compiled graphs valid across restarts.

The seeds size the KV cache from a Neuron core's HBM, which no other process shares. A CUDA device
can be shared (two engines on one GPU), so `device_free` below is the device's FREE memory measured
before this engine loaded its weights, not its total: the second engine on a GPU sizes its cache
from what the first one left. Two modes, chosen by VLLM_NEURON_RESERVED_HEADROOM_GIB:

default (unset):
    device: total_budget = int(device_free * gpu_memory_utilization)
            available    = max(min(max(total_budget - model_weight_bytes, 0),
                                   int(total_budget * cap_fraction)), 0)
    CPU:    the same, applied to this worker's share of host available memory
            (host_available / local_workers) with no weight subtraction: loaded weights are
            already reflected in host available memory.
headroom (set, zero included): gpu_memory_utilization treated as 1.0, no fractional cap.
    device: available = max(device_free - model_weight_bytes - headroom_bytes, 0)
    CPU:    available = max(host_available / local_workers - headroom_bytes, 0)

A budget below VLLM_NEURON_MIN_KV_BUDGET_GIB fails fast with the arithmetic in the message.

Pool size across restarts (`plan_kv_pool`): every compiled graph has the KV pool's size baked in,
and free memory moves between starts, so the pool is sized from the budget once per configuration
and recorded in the compile cache manifest together with the sizing inputs (mode,
gpu_memory_utilization, cap fraction, headroom). A later start with the same configuration reuses
the recorded size whatever the free memory, as long as it fits under the budget's limit now
(`KVBudget.limit_bytes`: the budget without the fractional cap); when it no longer fits, start-up is
refused with the arithmetic rather than silently shrinking the pool (and recompiling every graph).
A changed sizing configuration, a max_model_len the recorded pool cannot hold, or
num_gpu_blocks_override decides the size anew.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from vllm_neuron import envs

GIB = 1 << 30
MODE_DEFAULT = "default"
MODE_HEADROOM = "headroom"

_FROM_ENV: Any = object()


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class KVBudget:
    """The outcome of one budget computation, with the inputs that produced it.

    total_bytes is the memory the budget is taken from: the device's free memory before this
    engine loaded its weights, or on CPU this worker's share of host available memory.
    """

    mode: str
    on_cpu: bool
    total_bytes: int
    weights_bytes: int
    gpu_memory_utilization: float
    cap_fraction: float | None
    headroom_bytes: int | None
    available_bytes: int

    @property
    def limit_bytes(self) -> int:
        """The most KV memory this budget allows for a pool sized earlier: the budget without the
        fractional cap, which is a sizing choice rather than a limit (headroom mode: the budget)."""
        if self.mode == MODE_HEADROOM:
            return self.available_bytes
        weights = 0 if self.on_cpu else self.weights_bytes
        return max(int(self.total_bytes * self.gpu_memory_utilization) - weights, 0)

    def describe_limit(self) -> str:
        where = "host available / local_workers" if self.on_cpu else "device free before loading"
        weights = "" if self.on_cpu else f" - weights {_gib(self.weights_bytes)}"
        if self.mode == MODE_HEADROOM:
            return (f"{where} {_gib(self.total_bytes)}{weights} - headroom {_gib(self.headroom_bytes or 0)} = "
                    f"{_gib(self.limit_bytes)}")
        return (f"{where} {_gib(self.total_bytes)} x gpu_memory_utilization {self.gpu_memory_utilization}"
                f"{weights} = {_gib(self.limit_bytes)}")

    def sizing(self) -> dict[str, Any]:
        """The configuration that decides a pool's size from this budget (recorded with the pool)."""
        return {"mode": self.mode, "gpu_memory_utilization": self.gpu_memory_utilization,
                "cap_fraction": self.cap_fraction, "headroom_bytes": self.headroom_bytes}

    def describe(self) -> str:
        """The arithmetic as one line, for the start-up log and error messages."""
        where = "host available / local_workers" if self.on_cpu else "device free before loading"
        if self.mode == MODE_HEADROOM:
            weights = "" if self.on_cpu else f" - weights {_gib(self.weights_bytes)}"
            return (
                f"KV budget (headroom mode, gpu_memory_utilization=1.0, no cap): "
                f"{where} {_gib(self.total_bytes)}{weights} - headroom "
                f"{_gib(self.headroom_bytes or 0)} (VLLM_NEURON_RESERVED_HEADROOM_GIB) = "
                f"{_gib(self.available_bytes)}"
            )
        budget = int(self.total_bytes * self.gpu_memory_utilization)
        cap = int(budget * (self.cap_fraction or 0.0))
        weights = "" if self.on_cpu else f" - weights {_gib(self.weights_bytes)}"
        return (
            f"KV budget (default mode): total_budget = {where} {_gib(self.total_bytes)} x "
            f"gpu_memory_utilization {self.gpu_memory_utilization} = {_gib(budget)}; "
            f"available = min(total_budget{weights}, total_budget x "
            f"VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION {self.cap_fraction} = {_gib(cap)}) = "
            f"{_gib(self.available_bytes)}"
        )


def kv_budget(
    *,
    on_cpu: bool,
    total_bytes: int,
    model_weight_bytes: int,
    gpu_memory_utilization: float,
    local_workers: int = 1,
    cap_fraction: float | None = _FROM_ENV,
    headroom_gib: float | None = _FROM_ENV,
    min_kv_budget_gib: float = _FROM_ENV,
    check_minimum: bool = True,
) -> KVBudget:
    """Compute the KV budget of one worker (see the module docstring).

    on_cpu: total_bytes is host available memory (shared by `local_workers`); otherwise it is
    the device's free memory before the weights were loaded, and model_weight_bytes is
    subtracted. cap_fraction, headroom_gib and min_kv_budget_gib default to
    VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION, VLLM_NEURON_RESERVED_HEADROOM_GIB and
    VLLM_NEURON_MIN_KV_BUDGET_GIB. Raises ValueError ("KV cache budget below minimum
    threshold ...") when the result is below the minimum, unless check_minimum is False
    (`check_budget_minimum` then does it later).
    """
    if cap_fraction is _FROM_ENV:
        cap_fraction = envs.VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION
    if headroom_gib is _FROM_ENV:
        headroom_gib = envs.VLLM_NEURON_RESERVED_HEADROOM_GIB
    if min_kv_budget_gib is _FROM_ENV:
        min_kv_budget_gib = envs.VLLM_NEURON_MIN_KV_BUDGET_GIB
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if local_workers < 1:
        raise ValueError(f"local_workers must be >= 1, got {local_workers}")
    if total_bytes < 0 or model_weight_bytes < 0:
        raise ValueError("total_bytes and model_weight_bytes must be >= 0")

    total = total_bytes // local_workers if on_cpu else total_bytes
    weights = 0 if on_cpu else model_weight_bytes
    if headroom_gib is not None:
        if headroom_gib < 0:
            raise ValueError(f"VLLM_NEURON_RESERVED_HEADROOM_GIB must be >= 0, got {headroom_gib}")
        headroom = int(headroom_gib * GIB)
        available = max(total - weights - headroom, 0)
        budget = KVBudget(MODE_HEADROOM, on_cpu, total, model_weight_bytes, 1.0, None, headroom, available)
    else:
        if cap_fraction is None or not 0.0 < cap_fraction <= 1.0:
            raise ValueError(f"VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION must be in (0, 1], got {cap_fraction}")
        total_budget = int(total * gpu_memory_utilization)
        available = max(min(max(total_budget - weights, 0), int(total_budget * cap_fraction)), 0)
        budget = KVBudget(
            MODE_DEFAULT, on_cpu, total, model_weight_bytes, gpu_memory_utilization, cap_fraction, None, available
        )
    if check_minimum:
        check_budget_minimum(budget, min_kv_budget_gib)
    return budget


def check_budget_minimum(budget: KVBudget, min_kv_budget_gib: float = _FROM_ENV) -> None:
    """ValueError with the arithmetic and the fix when the budget is below the minimum."""
    if min_kv_budget_gib is _FROM_ENV:
        min_kv_budget_gib = envs.VLLM_NEURON_MIN_KV_BUDGET_GIB
    minimum = int(min_kv_budget_gib * GIB)
    if budget.available_bytes >= minimum:
        return
    head = (
        f"KV cache budget below minimum threshold: {_gib(budget.available_bytes)} < "
        f"VLLM_NEURON_MIN_KV_BUDGET_GIB={min_kv_budget_gib} GiB. {budget.describe()}. "
    )
    if budget.mode == MODE_HEADROOM:
        weights = 0 if budget.on_cpu else budget.weights_bytes
        max_headroom = budget.total_bytes - weights - minimum
        if max_headroom >= 0:
            # Rounded down so that the suggested value really satisfies the minimum.
            fix = (
                f"The maximum VLLM_NEURON_RESERVED_HEADROOM_GIB that satisfies the minimum is "
                f"{math.floor(max_headroom / GIB * 100) / 100:.2f}"
            )
        else:
            fix = (
                "No VLLM_NEURON_RESERVED_HEADROOM_GIB value satisfies the minimum: even 0 leaves "
                f"{_gib(max(budget.total_bytes - weights, 0))}"
            )
        raise ValueError(
            head + fix + ". Decrease VLLM_NEURON_RESERVED_HEADROOM_GIB (do not increase it: that "
            "makes the KV budget smaller), or lower VLLM_NEURON_MIN_KV_BUDGET_GIB only when a "
            "smaller KV cache is valid for the workload."
        )
    raise ValueError(
        head + "Increase gpu_memory_utilization or VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION, set "
        "VLLM_NEURON_RESERVED_HEADROOM_GIB for headroom sizing, or lower "
        "VLLM_NEURON_MIN_KV_BUDGET_GIB only when a smaller KV cache is valid for the workload."
    )


def kv_cache_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int
) -> int:
    """Bytes of one KV block across all layers: K and V, each [block_size, kv_heads, head_dim].
    num_kv_heads is the count held by this worker (after TP sharding)."""
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("block_size", block_size), ("dtype_bytes", dtype_bytes)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    return 2 * num_layers * num_kv_heads * head_dim * block_size * dtype_bytes


def num_blocks_from_budget(
    available_bytes: int,
    bytes_per_block: int,
    *,
    max_model_len: int | None = None,
    block_size: int | None = None,
) -> int:
    """Number of KV blocks that fit the budget. With max_model_len and block_size, ValueError
    when not even one request of max_model_len tokens fits."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    blocks = max(available_bytes, 0) // bytes_per_block
    if max_model_len is not None and block_size is not None:
        needed = -(-max_model_len // block_size)
        if blocks < needed:
            max_len = blocks * block_size
            raise ValueError(
                f"To serve at least one request with max_model_len={max_model_len}, "
                f"{needed} KV blocks ({_gib(needed * bytes_per_block)}) are needed, but the KV "
                f"budget ({_gib(available_bytes)}) holds only {blocks}. The largest max_model_len "
                f"this budget supports is {max_len}; decrease max_model_len or enlarge the budget."
            )
    return blocks


@dataclass(frozen=True)
class KVPoolPlan:
    """How many KV blocks to allocate (block 0, the null block, included), and why."""

    num_blocks: int
    sizing: dict[str, Any]  # what decided the size; recorded with it in the compile cache manifest
    reason: str  # one log line


def plan_kv_pool(
    *,
    bytes_per_block: int,
    max_model_len: int,
    block_size: int,
    request_blocks: int | None = None,
    override: int | None = None,
    budget_fn: Any = None,
    recorded_blocks: int | None = None,
    recorded_sizing: dict[str, Any] | None = None,
    record_path: str | None = None,
) -> KVPoolPlan:
    """The pool size under the policy of the module docstring.

    override: num_gpu_blocks_override (used as given). budget_fn: () -> KVBudget computed without
    the minimum check (called only when no override is given). recorded_blocks / recorded_sizing:
    what the compile cache manifest at record_path holds from an earlier start, or None. record_path
    None: nothing is recorded (eager, or the compile cache disabled), so the budget decides every start.
    request_blocks: the most blocks one request of max_model_len holds (KV cache groups, all together);
    default max_model_len / block_size (one group).
    Raises ValueError naming the arithmetic when the configuration cannot be served.
    """
    if request_blocks is None:
        request_blocks = -(-max_model_len // block_size)
    needed = request_blocks + 1  # one request of max_model_len, plus the null block
    if override is not None:
        if override < needed:
            raise ValueError(
                f"num_gpu_blocks_override={override} cannot hold one request of max_model_len={max_model_len} "
                f"({needed} blocks of {block_size} tokens, one of them reserved); raise "
                f"num_gpu_blocks_override or lower max_model_len")
        return KVPoolPlan(override, {"num_gpu_blocks_override": override},
                          f"KV pool: {override} blocks (num_gpu_blocks_override)")
    budget: KVBudget = budget_fn()
    sizing = budget.sizing()
    if recorded_blocks is not None and recorded_sizing == sizing and recorded_blocks >= needed:
        pool = recorded_blocks * bytes_per_block
        if pool > budget.limit_bytes:
            fit = budget.limit_bytes // bytes_per_block
            raise ValueError(
                f"The KV pool recorded in {record_path} ({recorded_blocks} blocks = {_gib(pool)}, sized by the "
                f"first start with this configuration and baked into its compiled graphs) no longer fits in "
                f"memory: the limit now is {budget.describe_limit()} ({fit} blocks). The pool size is kept "
                f"across restarts so that the compiled graphs stay valid, never shrunk silently. Free memory "
                f"and start again, or choose a pool that fits with num_gpu_blocks_override (at most {fit}; "
                f"every graph is compiled again), or delete {record_path} to size the pool from the memory "
                f"available now.")
        return KVPoolPlan(recorded_blocks, sizing, (
            f"KV pool: {recorded_blocks} blocks ({_gib(pool)}) as recorded in {record_path} by the first start "
            f"with this configuration, reused whatever the free memory (it fits: limit now "
            f"{budget.describe_limit()}; the budget alone would size {budget.available_bytes // bytes_per_block} "
            f"blocks)"))
    check_budget_minimum(budget)
    n = num_blocks_from_budget(budget.available_bytes, bytes_per_block, max_model_len=needed * block_size,
                               block_size=block_size)
    # Rounded down to a power of two: slack under the limit, so the recorded size keeps fitting
    # when free memory drops a little before the next start.
    n = max(needed, 1 << (n.bit_length() - 1))
    if record_path is None:
        return KVPoolPlan(n, sizing, (
            f"KV pool: {n} blocks ({_gib(n * bytes_per_block)}) from the budget, rounded down to a power of two "
            f"(not recorded: eager execution or the compile cache disabled)"))
    if recorded_blocks is None:
        why = "first start with this configuration"
    elif recorded_sizing != sizing:
        why = f"sizing configuration changed from {recorded_sizing}"
    else:
        why = f"the recorded {recorded_blocks} blocks cannot hold one request of max_model_len={max_model_len}"
    return KVPoolPlan(n, sizing, (
        f"KV pool: {n} blocks ({_gib(n * bytes_per_block)}) from the budget, rounded down to a power of two "
        f"({why}); recorded in {record_path} and reused by later starts with this configuration"))


def host_available_bytes(meminfo_path: str = "/proc/meminfo") -> int:
    """Host available memory (MemAvailable of /proc/meminfo), in bytes."""
    try:
        with open(meminfo_path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # No /proc (non-Linux): free physical pages is the closest portable figure.
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_free_bytes(device: Any) -> int:
    """Free memory of a torch device now: cuda via torch.cuda.mem_get_info (other processes'
    allocations excluded); cpu: host available memory."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    if dev.type == "cpu":
        return host_available_bytes()
    raise ValueError(f"device type {dev.type!r} is not supported; valid values: cpu, cuda")


def kv_budget_for_device(
    device: Any, *, model_weight_bytes: int, gpu_memory_utilization: float, local_workers: int = 1,
    free_before_load: int | None = None, check_minimum: bool = True,
) -> KVBudget:
    """Probe the device (or host) and compute the budget, environment variables applied.

    On a device, free_before_load is its free memory measured before this engine loaded its
    weights (`device_free_bytes`, probed by the runner); the weights are then subtracted as the
    seeds do. Without it the device is probed now and the weights, already resident, are counted
    back in. On CPU host available memory is probed now (it already reflects loaded weights).
    """
    import torch

    if torch.device(device).type == "cpu":
        return kv_budget(
            on_cpu=True, total_bytes=host_available_bytes(), model_weight_bytes=model_weight_bytes,
            gpu_memory_utilization=gpu_memory_utilization, local_workers=local_workers,
            check_minimum=check_minimum,
        )
    if free_before_load is None:
        free_before_load = device_free_bytes(device) + model_weight_bytes
    return kv_budget(
        on_cpu=False, total_bytes=free_before_load, model_weight_bytes=model_weight_bytes,
        gpu_memory_utilization=gpu_memory_utilization, local_workers=local_workers,
        check_minimum=check_minimum,
    )


def capacity_summary(num_blocks: int, block_size: int, max_model_len: int, request_blocks: int | None = None) -> str:
    """Start-up line: blocks, tokens, and how many max_model_len requests fit at once (request_blocks: the
    blocks one such request holds, KV cache groups together; default max_model_len / block_size)."""
    tokens = num_blocks * block_size
    per_request = request_blocks or -(-max_model_len // block_size)
    concurrency = num_blocks / per_request
    return (
        f"KV cache: {num_blocks} usable blocks (+1 reserved) of {block_size} tokens = {tokens} tokens; maximum "
        f"concurrency for {max_model_len} tokens per request: {concurrency:.2f}x"
    )
