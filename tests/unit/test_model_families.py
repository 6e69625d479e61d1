"""Families added by issue 52 (Gemma 3, Phi-3, Granite): what each refuses, and Gemma 3's chat template.
Token parity with transformers lives in tests/parity/test_model_parity.py."""
from __future__ import annotations

import pytest
import torch

from tests.model_factory import make_tiny_model, tiny_config
from vllm_neuron.entrypoints.openai.chat_template import render_chat
from vllm_neuron.entrypoints.openai.errors import BadRequestError
from vllm_neuron.model.loader import load_tokenizer
from vllm_neuron.model.phi3.model import uses_long_factors
from vllm_neuron.model.layers.lora import attach_lora
from vllm_neuron.model.registry import model_spec, resolve_model_class

# Gemma 3's chat template as its instruction-tuned tokenizers ship it (system folded into the first user
# turn, the assistant's role called "model", strict user/model alternation).
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim -}}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}"""


def _refused(arch: str, match: str, **kw) -> None:
    with pytest.raises(ValueError, match=match):
        model_spec(tiny_config(arch, **kw))


def test_gemma3_declares_its_local_layers_as_a_sliding_window_group():
    spec = model_spec(tiny_config("gemma3", num_hidden_layers=4,
                                  layer_types=["sliding_attention"] * 3 + ["full_attention"]))
    assert spec.sliding_windows == (24, 24, 24, None)


def test_gemma3_refuses_what_it_cannot_honour():
    _refused("gemma3", r"attn_logit_softcapping=50.0 is not supported", attn_logit_softcapping=50.0)
    _refused("gemma3", r"use_bidirectional_attention=true", use_bidirectional_attention=True)
    cfg = tiny_config("gemma3")
    cfg.vision_config = {"model_type": "siglip_vision_model"}  # a Gemma3ForConditionalGeneration's text side
    with pytest.raises(ValueError, match=r"vision tower \(vision_config"):
        model_spec(cfg)
    cfg = tiny_config("gemma3")
    cfg.architectures = ["Gemma3ForConditionalGeneration"]  # gemma-3-4b-it and up
    with pytest.raises(ValueError, match=r"Gemma 3 with its vision tower .* is not supported.*; supported: \[.*"
                                         r"'Gemma3ForCausalLM'"):
        model_spec(cfg)


def test_gemma3_chat_template_from_the_tokenizer_renders(tmp_path):
    path = make_tiny_model(str(tmp_path / "g"), "gemma3", hidden_size=32, intermediate_size=32)
    with open(f"{path}/chat_template.jinja", "w", encoding="utf-8") as f:
        f.write(GEMMA3_TEMPLATE)
    tok = load_tokenizer(path)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = render_chat(tok, msgs, template=None, add_generation_prompt=True, continue_final_message=False)
    assert text == (f"{tok.bos_token}<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
                    "Hello.<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(BadRequestError, match="roles must alternate"):
        render_chat(tok, msgs[1:2] * 2, template=None, add_generation_prompt=True, continue_final_message=False)


def test_phi3_window_applies_to_every_layer_only_below_the_context():
    # Phi-3-mini-4k sets sliding_window 2047 of 4096 positions; Phi-3.5 / Phi-4 set one beyond their context.
    assert model_spec(tiny_config("phi3", sliding_window=48)).sliding_windows == (48, 48)
    assert model_spec(tiny_config("phi3", sliding_window=262144)).sliding_windows == (None, None)


def test_phi3_long_rope_factor_set_follows_max_model_len():
    cfg = tiny_config("phi3", max_position_embeddings=512, original_max_position_embeddings=64)
    assert [uses_long_factors(cfg, n) for n in (64, 65, None)] == [False, True, True]
    assert not uses_long_factors(tiny_config("qwen3"), 10**6)


@pytest.mark.parametrize("arch", ["gemma3", "phi3", "granite"])
def test_lora_is_refused_at_attach_for_families_without_adapter_paths(arch):
    cfg = tiny_config(arch, vocab_size=256)
    model = resolve_model_class(cfg)(cfg)
    with pytest.raises(ValueError, match=rf"enable_lora=True is not supported yet for {cfg.architectures[0]}"):
        attach_lora(model, 2, 8, torch.float32, torch.device("cpu"))
