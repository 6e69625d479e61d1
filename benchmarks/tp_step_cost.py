"""Tensor parallelism on this machine's CPU: TP=1 (all cores in one process) against TP=2 (two rank
processes, the cores split between them), prefill and decode step times, and the share of rank 0's step
spent in collectives; TP=1 on one thread as a third row (on a busy machine a multi-threaded step waits
for its slowest thread).

    python benchmarks/tp_step_cost.py [--prompt-len 128 --decode-tokens 32 --reps 3 --compiled]

The bundled SmolLM2-135M has 9 attention heads and 3 KV heads, which two ranks cannot split, so the model
here has its shapes (30 layers, hidden 576, intermediate 1536, vocabulary 49152, SmolLM2's tokenizer) with
8 heads of 64 and 2 KV heads, random weights. Prefill: a prompt of --prompt-len tokens, one token out
(prefix caching off). Decode: batch 1, (time for 1 + D tokens - time for 1) / D. Collectives: rank 0's
all-reduces and logit all-gathers timed one by one (eager only: a compiled graph runs them inside), which
includes waiting for the other rank. Run it on an idle machine for absolute numbers.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def scratch_model(prefix: str) -> str:
    """The SmolLM2-shaped model (_model_dir) in a fresh scratch folder, whose compile cache this process then
    uses unless NEURON_COMPILED_ARTIFACTS says otherwise; returns the model's folder."""
    work = tempfile.mkdtemp(prefix=prefix)
    os.environ.setdefault("NEURON_COMPILED_ARTIFACTS", os.path.join(work, "cache"))
    return _model_dir(os.path.join(work, "model"))


def _model_dir(path: str) -> str:
    import sys
    from pathlib import Path

    from transformers import LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repo's tests package
    from tests.model_factory import make_tiny_model, tiny_llama_config

    cfg = tiny_llama_config(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    return make_tiny_model(path, "llama", model=LlamaForCausalLM(cfg).eval())


class _CollectiveClock:
    """Times rank 0's collectives (eager): each waited for where it is issued."""

    def __init__(self) -> None:
        import vllm_neuron.model.layers.parallel as par
        import vllm_neuron.model.llama.model as llama

        self.seconds = 0.0
        self.count = 0
        for mod, name in ((par, "all_reduce"), (llama, "all_reduce"), (llama, "gather_last_dim")):
            setattr(mod, name, self._timed(getattr(mod, name)))

    def _timed(self, fn):
        def run(*args):
            t0 = time.perf_counter()
            y = fn(*args)
            y = y.trigger_wait() if hasattr(y, "trigger_wait") else y
            self.seconds += time.perf_counter() - t0
            self.count += 1
            return y
        return run


def _measure(llm, prompt_len: int, decode_tokens: int, reps: int, clock: _CollectiveClock | None) -> dict:
    from vllm_neuron import SamplingParams

    gen = torch.Generator().manual_seed(1)

    def run(max_tokens: int) -> tuple[float, float]:
        prompt = torch.randint(100, 40000, (prompt_len,), generator=gen).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        c0 = clock.seconds if clock else 0.0
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - t0, (clock.seconds - c0) if clock else 0.0

    run(2)  # warm
    pre = [run(1) for _ in range(reps)]
    full = [run(1 + decode_tokens) for _ in range(reps)]
    t_pre = min(t for t, _ in pre)
    c_pre = min(c for _, c in pre)
    t_dec = (min(t for t, _ in full) - t_pre) / decode_tokens
    c_dec = (min(c for _, c in full) - c_pre) / decode_tokens
    return {"prefill_ms": t_pre * 1e3, "decode_ms": t_dec * 1e3, "prefill_coll": c_pre / t_pre,
            "decode_coll": c_dec / t_dec if t_dec > 0 else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compiled", action="store_true", help="compiled bucket graphs (no collective timing)")
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args()
    from vllm_neuron import LLM

    cores = len(os.sched_getaffinity(0))
    model = scratch_model("tp_step_cost_")
    clock = None if a.compiled else _CollectiveClock()
    rows = []
    # TP=1 on every core and on one (a loaded machine punishes multi-threaded steps), TP=2 split by the executor.
    for tp, threads in ((1, cores), (1, 1), (2, cores)):
        torch.set_num_threads(threads)
        llm = LLM(model, tensor_parallel_size=tp, enforce_eager=not a.compiled, dtype=a.dtype, device="cpu",
                  max_model_len=1024, max_num_seqs=1, max_num_batched_tokens=a.prompt_len, enable_prefix_caching=False,
                  additional_config={"neuron_config": {"num_batched_tokens_buckets": [a.prompt_len],
                                                       "num_seqs_buckets": [1]}})
        threads = torch.get_num_threads()
        r = _measure(llm, a.prompt_len, a.decode_tokens, a.reps, clock if tp > 1 else None)
        llm.llm_engine.shutdown()
        rows.append((tp, threads, r))
    mode = "compiled" if a.compiled else "eager"
    print(f"SmolLM2-shaped model (8 heads / 2 KV heads), {mode}, prompt {a.prompt_len}, {cores} cores; "
          f"collectives: share of rank 0's step")
    print(f"{'TP':>3} {'threads/rank':>12} {'prefill ms':>11} {'decode ms':>10} {'prefill coll':>13} {'decode coll':>12}")
    for tp, threads, r in rows:
        coll = (f"{r['prefill_coll']:>12.0%} {r['decode_coll']:>12.0%}" if tp > 1 and clock else f"{'-':>13} {'-':>12}")
        print(f"{tp:>3} {threads:>12} {r['prefill_ms']:>11.1f} {r['decode_ms']:>10.1f} {coll}")


if __name__ == "__main__":
    main()
