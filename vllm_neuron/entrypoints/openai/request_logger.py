"""--enable-log-requests / --max-log-len / --enable-log-outputs: vLLM's request log lines, in the API server.

One INFO line when a generation request goes to the engine (its id, the prompt and its token ids cut to
`max_log_len` characters / ids, the sampling parameters, the priority), and with `log_outputs` one when each
engine request ends (the text and token ids generated, cut the same way, and the finish reason). Off by
default, as in vLLM: prompts may hold what should not reach a log.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_neuron.logger import init_logger
from vllm_neuron.outputs import RequestOutput
from vllm_neuron.sampling_params import SamplingParams

logger = init_logger(__name__)


def _cut(value: Sequence | None, max_len: int | None) -> Any:
    return value if value is None or max_len is None else value[:max_len]


class RequestLogger:
    def __init__(self, max_log_len: int | None = None, log_outputs: bool = False) -> None:
        if max_log_len is not None and (isinstance(max_log_len, bool) or not isinstance(max_log_len, int)
                                        or max_log_len < 0):
            raise ValueError(f"--max-log-len must be 0 or more (characters or token ids), got {max_log_len!r}")
        self.max_log_len = max_log_len
        self.log_outputs = log_outputs
        self._outputs: dict[str, dict[int, tuple[list[str], list[int]]]] = {}  # request -> choice -> (texts, ids)

    def log_inputs(self, request_id: str, prompt: Any, params: SamplingParams, priority: int = 0) -> None:
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt if isinstance(prompt, list) \
            else None
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, priority: %d.", request_id,
                    _cut(text, self.max_log_len), params, _cut(ids, self.max_log_len), priority)
        if self.log_outputs:
            self._outputs[request_id] = {}

    def observe(self, res: RequestOutput) -> None:
        """A (delta) output of a request being logged; logs each choice that finishes."""
        seen = self._outputs.get(res.request_id)
        if seen is None:
            return
        for o in res.outputs:
            texts, ids = seen.setdefault(o.index, ([], []))
            texts.append(o.text)
            ids.extend(o.token_ids)
            if o.finish_reason is not None:
                logger.info("Generated response %s (choice %d): output: %r, output_token_ids: %s, finish_reason: %s",
                            res.request_id, o.index, _cut("".join(texts), self.max_log_len),
                            _cut(ids, self.max_log_len), o.finish_reason)
        if res.finished:
            self._outputs.pop(res.request_id, None)

    def forget(self, request_id: str) -> None:
        """A request that ended without a final output (aborted, failed)."""
        self._outputs.pop(request_id, None)
