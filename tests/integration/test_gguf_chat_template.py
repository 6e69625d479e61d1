"""The chat template a GGUF file carries (`tokenizer.chat_template`) is the one the OpenAI server renders
with: a tiny GGUF (split into two parts, so the tokenizer comes from the first part's metadata) carries a
template of its own, its tokenizer is loaded as the engine loads it, and the fake engine (no model) records the
prompt the server sends for a chat request."""
from __future__ import annotations

import httpx

from tests.integration.fake_engine import FakeEngine, serve_app
from tests.model_factory import make_tiny_gguf
from vllm_neuron.entrypoints.openai.api_server import build_app
from vllm_neuron.model.loader import load_checkpoint, load_tokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}]{{ m['content'] }}[/END]{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")


def test_the_server_renders_chats_with_the_gguf_files_template(tmp_path):
    # No weight is read: a 512-row embedding beside the 49k-token vocabulary keeps the file small.
    path = make_tiny_gguf(str(tmp_path / "chat.gguf"), chat_template=TEMPLATE, vocab_size=512,
                          split_max_tensors=12)
    assert path.endswith("chat-00001-of-00002.gguf")
    tok = load_tokenizer(load_checkpoint(path))  # what the engine's front end does with no --tokenizer
    assert tok.chat_template == TEMPLATE
    engine = FakeEngine(tok, max_model_len=256)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    with serve_app(build_app(engine, served_model_names=["tiny"], api_key=None, chat_template=None),
                   log_level="warning") as port:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                       json={"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    want = tok.bos_token + "[SYSTEM]Be brief.[/END][USER]Capital of France?[/END][ASSISTANT]"
    call = list(engine.calls.values())[-1]
    assert call.prompt_ids == tok.encode(want, add_special_tokens=False)
    assert tok.decode(call.prompt_ids) == want
