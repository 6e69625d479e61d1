"""KV offloading to a folder tier (--kv-offloading-size) on the tiny Llama with a pool too small for the prompts'
prefixes: the second pass over the prompts reads the evicted prefixes back from the tier with greedy fp32 tokens
equal to transformers' (and so to an engine without the tier), a restarted engine (a real second process) reads
what the first one wrote from its very first request, and corrupted files are counted and prefilled instead, never
served."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.model_factory import build_tiny_llama, greedy_reference, shared_prefix_prompts, tiny_llm
from vllm_neuron import SamplingParams

pytestmark = pytest.mark.engine

# Four prompts of 5-7 blocks sharing a 3-block prefix, in a pool of 9 usable blocks: each prompt's blocks push out
# the ones before, so the second pass finds at most the shared prefix in the pool.
PROMPTS = shared_prefix_prompts([100, 90, 120, 80], 96, 0, seed=1)
ENGINE = dict(num_gpu_blocks_override=10, max_model_len=128)
MAX_NEW = 6
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESTART = """
import json, sys
from tests.model_factory import tiny_llm
from vllm_neuron import SamplingParams
prompts = json.loads(sys.argv[2])
llm = tiny_llm(sys.argv[1], num_gpu_blocks_override=10, max_model_len=128, kv_offloading_size=0.01)
outs = [llm.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=6, temperature=0))[0] for p in prompts]
stats = llm.llm_engine.core.scheduler.kv_tier.stats
print("RESULT", json.dumps([[o.num_cached_tokens, list(o.outputs[0].token_ids)] for o in outs] +
                           [[stats.loaded_blocks, stats.failed_loads]]))
"""


def _passes(llm, passes: int = 2) -> list[tuple[int, list[int]]]:
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    return [(o.num_cached_tokens, list(o.outputs[0].token_ids))
            for _ in range(passes) for o in (llm.generate({"prompt_token_ids": p}, sp)[0] for p in PROMPTS)]


@pytest.fixture(scope="module")
def tier(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("kv_tier"))


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return greedy_reference(build_tiny_llama(), PROMPTS, MAX_NEW)


def test_evicted_prefixes_come_back_from_the_tier_with_the_same_tokens(tiny_llama_dir, tier, expected, monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_KV_OFFLOAD_DIR", tier)
    off = tiny_llm(tiny_llama_dir, **ENGINE)
    without = _passes(off)
    off.llm_engine.shutdown()
    llm = tiny_llm(tiny_llama_dir, **ENGINE, kv_offloading_size=0.01)
    with_tier = _passes(llm)
    stats = llm.llm_engine.core.scheduler.kv_tier.stats
    llm.llm_engine.shutdown()  # the writes queued so far are kept
    assert [t for _, t in with_tier] == [t for _, t in without] == expected * 2
    # First pass: the same hits. Second: the pool kept at most the shared prefix; the tier gives the rest.
    assert [c for c, _ in with_tier[:4]] == [c for c, _ in without[:4]]
    assert all(c_on > c_off for (c_on, _), (c_off, _) in zip(with_tier[4:], without[4:]))
    assert [c for c, _ in with_tier[4:]] == [(len(p) - 1) // 16 * 16 for p in PROMPTS]  # every full block
    assert stats.loaded_blocks > 0 and stats.failed_loads == 0 and stats.stored_blocks > 0


def _restart(model_dir: str, tier: str) -> list:
    env = {**os.environ, "VLLM_NEURON_KV_OFFLOAD_DIR": tier, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-c", RESTART, model_dir, json.dumps(PROMPTS)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_a_restarted_engine_reads_what_the_last_one_wrote(tiny_llama_dir, tier, expected):
    *outs, (loaded, failed) = _restart(tiny_llama_dir, tier)
    assert [t for _, t in outs] == expected
    assert [c for c, _ in outs] == [(len(p) - 1) // 16 * 16 for p in PROMPTS]  # a warm start from request one
    assert loaded > 0 and failed == 0


def test_corrupted_files_are_counted_and_prefilled_never_served(tiny_llama_dir, tier, expected):
    files = [os.path.join(d, f) for d, _, fs in os.walk(tier) for f in fs if f.endswith(".kv")]
    assert files
    for path in files:
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x5A]))
    *outs, (loaded, failed) = _restart(tiny_llama_dir, tier)
    assert [t for _, t in outs] == expected
    assert failed > 0 and loaded == 0
