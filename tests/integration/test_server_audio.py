"""`vllm-neuron serve` on the tiny Qwen3-ASR: the openai SDK's `audio.transcriptions.create` in every response
format and streamed gives transformers' greedy text for the same decoded samples; audio longer than a window (30 s,
or what the largest encoder bucket holds: 16 s here) is cut on its silence into windows transcribed and joined in
order; chat takes `input_audio` and `audio_url` parts.
Each bad upload (empty, not audio, truncated, three hours long, an impossible sample rate, an unsupported
format, over the size limit, a translation the model cannot do) is a 400 / 413 with the OpenAI error object and
the server keeps serving; a text model answers the audio routes with a 400."""
from __future__ import annotations

import base64
import io
import json
import struct

import httpx
import numpy as np
import openai
import pytest

from tests.asr_factory import EOS_ID, RATE, asr_prompt, hf_asr_greedy, make_tiny_qwen3_asr, tone
from tests.integration.server_utils import ServerProcess
from vllm_neuron.benchmarks.random_audio import wav_bytes
from vllm_neuron.multimodal.audio import decode_audio
from vllm_neuron.multimodal.audio_split import split_on_silence

pytestmark = pytest.mark.engine

MAX_NEW = 6
# Encoder buckets of 2 blocks: clips of at most 16 s, so the endpoint cuts audio longer than that (30 s otherwise).
ENCODER = {"encoder_attention_block_size": 128, "num_encoder_input_buckets": [2]}


def flac_bytes(seconds: float, rate: int = 8000, silent: bool = True) -> bytes:
    """A mono FLAC file: `seconds` of silence (3 hours of it take 2 MB), or of tone."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="flac") as c:
        s = c.add_stream("flac", rate=rate)
        s.layout = "mono"
        step = min(int(seconds * rate), rate * 60)
        for start in range(0, int(seconds * rate), step):
            n = min(step, int(seconds * rate) - start)
            x = np.zeros(n, np.int16) if silent else (tone(n / rate, rate=rate) * 32767).astype(np.int16)
            frame = av.AudioFrame.from_ndarray(x[None], format="s16", layout="mono")
            frame.sample_rate = rate
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("asr_server")
    model_dir = make_tiny_qwen3_asr(str(root / "model"))
    srv = ServerProcess(model_dir, ["--enforce-eager", "--dtype", "float32", "--max-model-len", "512",
                                    "--num-gpu-blocks-override", "96", "--max-num-seqs", "4",
                                    "--limit-mm-per-prompt", '{"audio": 1}', "--additional-config", json.dumps(
                                        {"encoder_neuron_config": ENCODER})], str(root),
                        VLLM_MAX_AUDIO_CLIP_FILESIZE_MB="2")
    try:
        srv.wait_healthy(timeout=120)
        from transformers import AutoTokenizer

        yield srv, model_dir, AutoTokenizer.from_pretrained(model_dir)
    finally:
        srv.stop()
        srv.kill()


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _expected(tok, samples: np.ndarray, language: str | None = "English") -> str:
    """transformers' greedy transcript of these samples (stopping at EOS, as the server does)."""
    ids = hf_asr_greedy(tok.encode(asr_prompt(language)), samples, MAX_NEW)
    ids = ids[:ids.index(EOS_ID)] if EOS_ID in ids else ids
    return tok.decode(ids, skip_special_tokens=True).strip()


def test_sdk_every_response_format_matches_transformers(setup):
    srv, model_dir, tok = setup
    data = wav_bytes(tone(3.0, 330.0))
    want = _expected(tok, decode_audio(data, RATE))
    assert want
    client = _client(srv)

    def create(fmt: str, **kw):
        return client.audio.transcriptions.create(file=("clip.wav", data), model=model_dir, language="en",
                                                  response_format=fmt, temperature=0.0,
                                                  extra_body={"max_completion_tokens": MAX_NEW}, **kw)

    assert create("json").text == want
    assert create("text").strip() == want
    verbose = create("verbose_json", timestamp_granularities=["segment"])
    assert verbose.text == want and verbose.language == "English" and abs(verbose.duration - 3.0) < 1e-6
    assert [(s.start, s.end, s.text) for s in verbose.segments] == [(0.0, 3.0, want)]
    assert create("srt") == f"1\n00:00:00,000 --> 00:00:03,000\n{want}\n\n"
    assert create("vtt") == f"WEBVTT\n\n00:00:00.000 --> 00:00:03.000\n{want}\n\n"
    chunks = list(create("json", stream=True))
    # vLLM's transcription.chunk objects (the SDK hands them over as they come).
    assert {c.object for c in chunks} == {"transcription.chunk"}
    assert "".join(c.choices[0]["delta"].get("content", "") for c in chunks if c.choices) == want
    assert chunks[-1].choices[0]["finish_reason"] in ("stop", "length")


def test_long_audio_is_cut_on_silence_and_joined_in_order(setup):
    srv, model_dir, tok = setup
    # 12 s of tone, 1 s of silence, 6 s of another tone: one cut (windows of at most 16 s), inside the silence.
    samples = np.concatenate([tone(12.0, 300.0), np.zeros(RATE, np.float32), tone(6.0, 650.0, seed=3)])
    data = wav_bytes(samples)
    decoded = decode_audio(data, RATE)
    windows = split_on_silence(decoded, RATE, 16.0)
    assert len(windows) == 2 and 12.0 * RATE < windows[0][1] < 13.0 * RATE
    parts = [_expected(tok, decoded[a:b]) for a, b in windows]
    r = httpx.post(srv.url + "/v1/audio/transcriptions", files={"file": ("long.wav", data, "audio/wav")},
                   data={"model": model_dir, "language": "English", "response_format": "verbose_json",
                         "max_completion_tokens": str(MAX_NEW)}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [s["text"] for s in body["segments"]] == parts
    assert body["text"] == " ".join(p for p in parts if p) and body["usage"] == {"type": "duration", "seconds": 19}


def test_chat_takes_input_audio_and_audio_url(setup):
    srv, model_dir, tok = setup
    data = wav_bytes(tone(2.0, 480.0, seed=5))
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "audio"}]}], add_generation_prompt=True,
                                   tokenize=False)
    want = hf_asr_greedy(tok.encode(text, add_special_tokens=False), decode_audio(data, RATE), MAX_NEW)
    b64 = base64.b64encode(data).decode()
    for part in ({"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
                 {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + b64}}):
        r = httpx.post(srv.url + "/v1/chat/completions", json={
            "model": model_dir, "messages": [{"role": "user", "content": [part]}], "max_tokens": MAX_NEW,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
    two = [{"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}] * 2
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": model_dir, "messages": [
        {"role": "user", "content": two}], "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "--limit-mm-per-prompt" in r.json()["error"]["message"]


BAD_UPLOADS = [
    ("empty.wav", b"", 400, "is empty"),
    ("notes.wav", b"these are words, not audio samples\n" * 40, 400, "cannot decode"),
    ("cut.flac", None, 400, "cannot decode|no audio samples"),  # the first 60 bytes of a FLAC file
    ("three_hours.flac", None, 400, "longer than the 3600 s limit"),  # 2 MB of silence
    ("rate.wav", None, 400, "cannot decode|sample rate"),  # a WAV header saying 0 Hz
    ("clip.txt", b"RIFF", 400, "Invalid file format 'txt'"),
    ("big.wav", b"\x00" * (2 * 2**20 + 1), 413, "exceeds the 2 MB limit"),
]


def test_bad_uploads_are_refused_and_the_server_keeps_serving(setup):
    srv, model_dir, _ = setup
    zero_rate = bytearray(wav_bytes(tone(0.5)))
    zero_rate[24:28] = struct.pack("<I", 0)
    contents = {"cut.flac": flac_bytes(1.0, silent=False)[:60], "rate.wav": bytes(zero_rate),
                "three_hours.flac": flac_bytes(3 * 3600.0)}
    for name, data, status, pattern in BAD_UPLOADS:
        data = contents.get(name, data)
        r = httpx.post(srv.url + "/v1/audio/transcriptions", files={"file": (name, data)}, data={"model": model_dir},
                       timeout=60)
        assert r.status_code == status, (name, r.text)
        err = r.json()["error"]
        assert err["param"] == "file" and err["code"] == status, (name, err)
        import re

        assert re.search(pattern, err["message"]), (name, err["message"])
    good = wav_bytes(tone(1.0))
    r = httpx.post(srv.url + "/v1/audio/translations", files={"file": ("a.wav", good)}, data={"model": model_dir})
    assert r.status_code == 400 and "does not support translation" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/audio/transcriptions", files={"file": ("a.wav", good)},
                   data={"model": model_dir, "timestamp_granularities[]": "word", "response_format": "verbose_json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "timestamp_granularities"
    r = httpx.post(srv.url + "/v1/audio/transcriptions", json={"model": model_dir})
    assert r.status_code == 415
    r = httpx.post(srv.url + "/v1/audio/transcriptions", files={"file": ("a.wav", good)},
                   data={"model": model_dir, "response_format": "json", "max_completion_tokens": "2"}, timeout=60)
    assert r.status_code == 200 and set(r.json()) == {"text", "usage"}


def test_a_text_model_refuses_the_audio_routes():
    from transformers import AutoTokenizer

    from tests.integration.fake_engine import FakeEngine, serve_app
    from tests.model_factory import smollm2_tokenizer_dir
    from vllm_neuron.entrypoints.openai.api_server import build_app

    engine = FakeEngine(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir()), max_model_len=256)
    with serve_app(build_app(engine, served_model_names=["text"]), log_level="warning") as port:
        for route in ("transcriptions", "translations"):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/audio/{route}", files={"file": ("a.wav", wav_bytes(tone(1.0)))},
                           data={"model": "text"}, timeout=30)
            assert r.status_code == 400, r.text
            assert "does not support transcription" in r.json()["error"]["message"]
            assert json.loads(r.text)["error"]["param"] == "model"
