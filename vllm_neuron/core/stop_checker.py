"""Token-level stop conditions, checked after each new token (pure; stop strings live in the
detokenizer because they need text)."""
from __future__ import annotations

from collections.abc import Sequence

from vllm_neuron.sampling_params import SamplingParams


def check_stop(output_token_ids: Sequence[int], params: SamplingParams, eos_token_id: int | None,
               num_prompt_tokens: int, max_model_len: int) -> tuple[str, int | None] | None:
    """Returns (finish_reason, stop_reason) if the newest token ends the request, else None.

    Order as vLLM V1: EOS, then stop_token_ids, then the length caps. min_tokens gates only EOS and
    stop_token_ids; the length caps always apply (a request can never run past the context).
    """
    num_output = len(output_token_ids)
    if num_output == 0:
        return None
    if num_output >= params.min_tokens:
        last = output_token_ids[-1]
        if not params.ignore_eos and eos_token_id is not None and last == eos_token_id:
            return "stop", None
        if last in params.stop_token_ids:
            return "stop", last
    if num_prompt_tokens + num_output >= max_model_len:
        return "length", None
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return "length", None
    return None
