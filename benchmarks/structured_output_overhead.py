"""Per-token cost of structured outputs: the same requests with a JSON schema and unconstrained.

The constrained run goes first; the unconstrained run then generates exactly as many tokens per request
(max_tokens = the constrained length, ignore_eos), so both do the same steps over the same batch. Both
runs are warmed up first (the grammar is compiled and cached then) and timed best of --repeat,
interleaved. The host-side work of the grammar (bitmask fill and matcher advance, EngineCore thread) is
timed separately. The mask itself is applied inside every graph whether a request has a grammar or not
(all-ones rows), so its device cost is in both runs.

    python benchmarks/structured_output_overhead.py [--model PATH] [--num-requests 4] [--max-tokens 160]
"""
from __future__ import annotations

import argparse
import json
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "employed"],
}
PEOPLE = ["a chef from Lyon", "a retired pilot", "a student who loves chess", "a painter in Lisbon",
          "a marathon runner", "a software engineer", "a beekeeper", "a jazz pianist"]


class _HostTimer:
    """Wraps the StructuredOutputManager's per-step calls to time them."""

    def __init__(self, manager) -> None:
        self.seconds = 0.0
        for name in ("bitmask", "accept"):
            setattr(manager, name, self._timed(getattr(manager, name)))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the bundled SmolLM2-135M)")
    p.add_argument("--num-requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--compiled", action="store_true", help="torch.compile the buckets (default: eager)")
    args = p.parse_args()

    from vllm_neuron import LLM, SamplingParams
    from vllm_neuron.structured_output import StructuredOutputsParams

    llm = LLM(args.model, enforce_eager=not args.compiled, max_model_len=1024, max_num_seqs=args.num_requests)
    tok = llm.get_tokenizer()
    prompts = []
    for i in range(args.num_requests):
        msgs = [{"role": "user", "content": f"Describe {PEOPLE[i % len(PEOPLE)]} as a JSON object with name, "
                                            f"age, city, hobbies and employed."}]
        prompts.append({"prompt_token_ids": list(tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                                         tokenize=True, return_dict=False))})
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))

    def timed(params):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, outs

    _, outs = timed(constrained)  # warm-up: compiles and caches the grammar
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    valid = sum(_is_valid(o.outputs[0].text) for o in outs)
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    timed(free)

    host = _HostTimer(llm.llm_engine.core.structured)
    # Interleaved, so that load from elsewhere on the machine hits both sides alike.
    t_con, t_free = float("inf"), float("inf")
    for _ in range(args.repeat):
        t_con = min(t_con, timed(constrained)[0])
        t_free = min(t_free, timed(free)[0])
    host_per_run = host.seconds / args.repeat

    steps, tokens = max(lengths), sum(lengths)
    ms_con, ms_free = 1000 * t_con / steps, 1000 * t_free / steps
    print(f"model: {llm.llm_engine.checkpoint.path}  ({'compiled' if args.compiled else 'eager'}, "
          f"{args.num_requests} concurrent requests, greedy)")
    print(f"output tokens per request: {lengths}  (valid JSON for the schema: {valid}/{len(outs)})")
    print(f"{'':24s}{'total s':>10s}{'ms/step':>10s}{'ms/token':>10s}")
    print(f"{'JSON schema':24s}{t_con:10.3f}{ms_con:10.2f}{1000 * t_con / tokens:10.2f}")
    print(f"{'unconstrained':24s}{t_free:10.3f}{ms_free:10.2f}{1000 * t_free / tokens:10.2f}")
    print(f"overhead per step: {ms_con - ms_free:+.2f} ms ({100 * (t_con / t_free - 1):+.1f}%); ratio "
          f"{t_con / t_free:.3f}")
    print(f"grammar host work (bitmask fill + matcher advance, all requests): "
          f"{1000 * host_per_run / steps:.3f} ms/step")


def _is_valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and all(k in value for k in SCHEMA["required"])


if __name__ == "__main__":
    main()
