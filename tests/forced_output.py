"""Tiny models that answer with a fixed script: a logits processor forces the tokens of the script
named in the prompt (`force:NAME` anywhere in the prompt's text), then EOS (or, for a script that
ends with FREE, nothing more: the rest is the model's). Used by the reasoning,
harmony and Responses API tests to get exactly known outputs from random weights.

    vllm-neuron serve DIR --logits-processors tests.forced_output:ForceScript

A prompt without a marker is left to the model. The scripts are in SCRIPTS (name -> text, special tokens
written out as text); `make_tiny_qwen3_thinking` writes a tiny Qwen3 with `<think>` / `</think>` tokens and
Qwen3's `enable_thinking` template switch.
"""
from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

from tests.model_factory import make_tiny_model
from vllm_neuron.logits_processor import PerRequestLogitsProcessor

SCRIPTS: dict[str, str] = {
    "think": "<think>\nLet me count: 1, 2, 3.\n</think>\n\nThe answer is 3.",
    "nothink": "The answer is 3.",
    "think_json": '<think>\nJSON with a city.\n</think>\n\n{"city": "Paris"}',
    "think_tool": '<think>\nI should call the weather tool.\n</think>\n\n<tool_call>\n'
                  '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "cut": "<think>\nI am still thinking about",
    # FREE at the end: forced up to there, then the model (and a grammar) choose
    "think_free": "<think>\nJSON with a city.\n</think>\n\n" + "<<free>>",
    # harmony (gpt-oss)
    "h_final": "<|channel|>analysis<|message|>Thinking about it.<|end|><|start|>assistant<|channel|>final"
               "<|message|>Hello from gpt-oss!<|return|>",
    "h_tool": "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
              'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
    "h_args": '{"city": "Lima"}<|call|>',  # after a named call's prefill
    "h_pick": 'get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>',  # after "required"'s prefill
    "h_stranger": '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"q": 1}<|call|>',
    "h_free": "<|channel|>analysis<|message|>JSON now.<|end|><|start|>assistant<|channel|>final<|message|><<free>>",
}
FREE = "<<free>>"
_MARKER = re.compile(r"force:([a-z_0-9]+)")

QWEN3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")


class ForceScript(PerRequestLogitsProcessor):
    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(vllm_config.tokenizer or vllm_config.model)
        self.eos = self.tokenizer.eos_token_id
        super().__init__()  # rows: index -> (script ids, live output ids)
        self._scripts: dict[str, tuple[list[int], bool]] = {}  # name -> (ids, free after them)

    def _script(self, prompt_ids: list[int]) -> tuple[list[int], bool] | None:
        found = _MARKER.findall(self.tokenizer.decode(prompt_ids))
        if not found or found[-1] not in SCRIPTS:
            return None
        name = found[-1]
        if name not in self._scripts:
            text = SCRIPTS[name]
            free = text.endswith(FREE)
            text = text[:-len(FREE)] if free else text
            self._scripts[name] = (self.tokenizer.encode(text, add_special_tokens=False), free)
        return self._scripts[name]

    def row_state(self, params, prompt_token_ids: list[int], output_token_ids: list[int]):
        script = self._script(list(prompt_token_ids))
        return None if script is None else (script, output_token_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for i, ((script, free), out) in self.rows.items():
            n = len(out)
            if i >= logits.shape[0] or (free and n >= len(script)):
                continue
            token = script[n] if n < len(script) else self.eos
            if logits[i, token] == float("-inf"):
                continue  # a grammar forbids it (the mask comes first): the grammar's choice goes on
            logits[i] = float("-inf")
            logits[i, token] = 0.0
        return logits

    def is_argmax_invariant(self) -> bool:
        return False


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@contextlib.contextmanager
def forced_server(model_dir: str, args: list[str], tmp_dir: str) -> Iterator[tuple[Any, Any]]:
    """`vllm-neuron serve` of `model_dir` with ForceScript, served as "m": (an openai client, the server)."""
    import openai

    from tests.integration.server_utils import serving

    args = [*args, "--logits-processors", "tests.forced_output:ForceScript", "--served-model-name", "m"]
    with serving(model_dir, args, tmp_dir) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0), srv


def chat_forced(client: Any, script: str, **kw: Any) -> Any:
    """A chat completion of the server's model (served as "m") answering with SCRIPTS[script]."""
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"force:{script}"}],
                                          **kw)


def stream_forced(client: Any, script: str, **kw: Any) -> dict[str, Any]:
    """chat_forced's stream, its deltas joined per field: reasoning_content, reasoning, content, calls
    ([name, arguments] per call) and the last finish_reason."""
    out: dict[str, Any] = {"reasoning_content": "", "reasoning": "", "content": "", "calls": [], "finish": None}
    for chunk in chat_forced(client, script, stream=True, **kw):
        for choice in chunk.choices:
            d = choice.delta.model_dump()
            for key in ("reasoning_content", "reasoning", "content"):
                out[key] += d.get(key) or ""
            for tc in d.get("tool_calls") or []:
                if tc.get("id"):
                    out["calls"].append([tc["function"]["name"], ""])
                out["calls"][tc["index"]][1] += tc["function"].get("arguments") or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def make_tiny_qwen3_thinking(path: str) -> str:
    """A tiny random Qwen3 whose tokenizer has `<think>` and `</think>` as single tokens and Qwen3's
    `enable_thinking` switch in its chat template."""
    from transformers import AutoTokenizer

    make_tiny_model(path, "qwen3", vocab_size=49280)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tok.chat_template = QWEN3_TEMPLATE
    tok.save_pretrained(path)
    for name in os.listdir(path):  # a template file beside the tokenizer's config would take precedence
        if name.endswith(".jinja") and name != "chat_template.jinja":
            os.remove(os.path.join(path, name))
    return path
