"""What the engine parity tests (test_model_parity, test_mrv2_parity) share: the fp32 CPU engine they build,
generation over token-id prompts, and the greedy-token check naming the prompt that diverged."""
from __future__ import annotations

from typing import Any

from tests.model_factory import tiny_llm
from vllm_neuron import LLM, RequestOutput, SamplingParams

# The tiny Llama's engine (max_position_embeddings 512): room for 8 sequences, 128-token prefill
# segments, 16-token blocks.
LLAMA_ENGINE = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, block_size=16, dtype="float32",
                    device="cpu", num_gpu_blocks_override=512)


def fp32_llm(model_dir: str, base: dict[str, Any], **kw: Any) -> LLM:
    """The tests' engine (model_factory.tiny_llm) on `base` settings, compiled unless they say otherwise, `kw`
    overriding them."""
    return tiny_llm(model_dir, **{"enforce_eager": False, **base, **kw})


def generate_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def greedy_outputs(llm: LLM, prompts: list[list[int]], max_new: int, logprobs: int | None = None
                   ) -> list[RequestOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=logprobs)
    return generate_ids(llm, prompts, params)


def assert_tokens(outs: list[RequestOutput], ref_tokens: list[list[int]], lengths: list[int]) -> None:
    for i, (o, ref) in enumerate(zip(outs, ref_tokens, strict=True)):
        assert o.outputs[0].token_ids == ref, f"prompt {i} (length {lengths[i]}) diverged"
