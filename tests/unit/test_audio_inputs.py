"""Audio inputs without an engine: decoding wav / flac / mp3 / ogg (opus) / m4a through PyAV to the model's rate,
(array, rate) resampling, the refusals (empty, not audio, bare arrays, impossible rates, too long), the cut on
silence, the prompt expansion and its limits, subtitles, and the multipart form parser's refusals."""
from __future__ import annotations

import io

import numpy as np
import pytest

from tests.asr_factory import AUDIO_PAD, RATE, tiny_qwen3_asr_config, tone
from vllm_neuron.multimodal.audio import decode_audio, load_audio, resample_array
from vllm_neuron.multimodal.audio_split import split_on_silence


def _encode(fmt: str, codec: str, rate: int, seconds: float = 1.0) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate)
        s.layout = "mono"
        frame = av.AudioFrame.from_ndarray(tone(seconds, 440.0, rate=rate)[None], format="flt", layout="mono")
        frame.sample_rate = rate
        for f in av.AudioResampler(format=s.format.name, layout="mono", rate=rate).resample(frame):
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


@pytest.mark.parametrize("fmt,codec,rate", [("wav", "pcm_s16le", 22050), ("flac", "flac", 16000),
                                            ("mp3", "libmp3lame", 44100), ("ogg", "libopus", 48000),
                                            ("ipod", "aac", 32000)])  # ipod: the m4a container
def test_formats_decode_to_the_model_rate(fmt, codec, rate):
    out = decode_audio(_encode(fmt, codec, rate), RATE)
    assert out.dtype == np.float32 and abs(len(out) - RATE) <= 0.1 * RATE  # codecs pad a little
    spectrum = np.abs(np.fft.rfft(out[:RATE // 2]))
    assert abs(np.argmax(spectrum) * 2 - 440) <= 4  # the tone survives, at the right pitch


def test_array_resampling_and_refusals(monkeypatch):
    x = tone(1.0, 440.0, rate=44100)
    y = resample_array(np.stack([x, x]), 44100, RATE)  # stereo -> mono, 44.1 -> 16 kHz
    assert abs(len(y) - RATE) <= 64 and abs(np.argmax(np.abs(np.fft.rfft(y))) - 440) <= 2
    assert np.array_equal(resample_array(x[:RATE], RATE, RATE), x[:RATE])
    for bad, match in [((x, 0), "sample rate 0"), ((x, "16k"), "sample rate '16k'"), ((np.zeros(0), RATE), "non-empty"),
                       (x, "bare array"), ((np.full(10, np.nan), RATE), "NaN")]:
        with pytest.raises(ValueError, match=match):
            load_audio(bad, RATE)
    for data, match in [(b"", "is empty"), (b"not audio at all" * 50, "cannot decode"),
                        (_encode("flac", "flac", RATE)[:50], "cannot decode|no audio samples")]:
        with pytest.raises(ValueError, match=match):
            decode_audio(data, RATE)
    monkeypatch.setenv("VLLM_NEURON_MAX_AUDIO_SECONDS", "2")
    with pytest.raises(ValueError, match="longer than the 2 s limit"):
        load_audio((np.zeros(3 * RATE, np.float32), RATE), RATE)
    with pytest.raises(ValueError, match="longer than the 2 s limit"):
        decode_audio(_encode("wav", "pcm_s16le", RATE, seconds=3.0), RATE)


def test_split_on_silence_cuts_in_the_quiet_stretch():
    loud = tone(20.0, 300.0)
    x = np.concatenate([loud, np.zeros(RATE // 2, np.float32), loud])  # silence at 20.0-20.5 s
    windows = split_on_silence(x, RATE, 30.0)
    assert windows[0][0] == 0 and windows[-1][1] == len(x) and all(a[1] == b[0] for a, b in zip(windows, windows[1:]))
    assert 20.0 * RATE <= windows[0][1] <= 20.5 * RATE and len(windows) == 2
    noise = tone(70.0, 500.0)  # nowhere quiet: cuts at the limit or near it, never past it
    assert all(b - a <= 30 * RATE for a, b in split_on_silence(noise, RATE, 30.0))
    assert split_on_silence(x[:RATE], RATE, 30.0) == [(0, RATE)]


def test_audio_prompt_expansion_and_limits(tmp_path):
    from tests.asr_factory import feature_extractor
    from vllm_neuron.multimodal.audio_processor import AudioProcessor

    feature_extractor().save_pretrained(tmp_path)
    proc = AudioProcessor(tiny_qwen3_asr_config(), str(tmp_path), limits={"audio": 1}, max_blocks=2)
    ids, items = proc.process([1, AUDIO_PAD, 2], {"audio": (tone(2.0), RATE)})
    assert ids == [1] + [AUDIO_PAD] * 26 + [2] and items[0].offset == 1 and items[0].num_tokens == 26
    again = proc.process([AUDIO_PAD], {"audio": (tone(2.0), RATE)})[1][0]
    assert again.mm_hash == items[0].mm_hash
    for ids, data, match in [([AUDIO_PAD], {"audio": [(tone(1.0), RATE)] * 2}, "At most 1 audio"),
                             ([1], {"audio": (tone(1.0), RATE)}, "0 audio placeholder"),
                             ([AUDIO_PAD], {"image": "x"}, "unknown modality 'image'"),
                             ([AUDIO_PAD], {"audio": (tone(17.0), RATE)}, "needs 3 encoder blocks")]:
        with pytest.raises(ValueError, match=match):
            proc.process(ids, data)


def test_subtitles_and_multipart_refusals():
    from types import SimpleNamespace

    from vllm_neuron.entrypoints.openai.errors import BadRequestError, UnsupportedMediaTypeError
    from vllm_neuron.entrypoints.openai.multipart_form import parse_form
    from vllm_neuron.entrypoints.openai.transcript_formats import to_srt, to_vtt

    segs = [SimpleNamespace(start=0.0, end=29.75, text=" one "), SimpleNamespace(start=29.75, end=3723.5, text="two"),
            SimpleNamespace(start=3723.5, end=3724.0, text=" ")]
    assert to_srt(segs) == "1\n00:00:00,000 --> 00:00:29,750\none\n\n2\n00:00:29,750 --> 01:02:03,500\ntwo\n\n"
    assert to_vtt(segs).startswith("WEBVTT\n\n00:00:00.000 --> 00:00:29.750\none\n\n")
    with pytest.raises(UnsupportedMediaTypeError):
        parse_form("application/json", b"{}")
    for ct, body in [("multipart/form-data", b"x"), ("multipart/form-data; boundary=b", b"--b\r\nno headers\r\n--b--")]:
        with pytest.raises(BadRequestError):
            parse_form(ct, body)


def test_transcript_is_split_at_the_language_marker():
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from tests.asr_factory import SPECIAL
    from tests.model_factory import smollm2_tokenizer_dir
    from vllm_neuron.entrypoints.openai.serving_transcription import OpenAIServingTranscription

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    serving = OpenAIServingTranscription(SimpleNamespace(tokenizer=tok), None)
    ids = tok.encode("language German<asr_text>Guten Tag", add_special_tokens=False)
    assert serving._split(ids, None) == ("German", "Guten Tag")
    head = ids[:ids.index(tok.convert_tokens_to_ids("<asr_text>"))]
    assert serving._split(head, None, final=False) == (None, "")  # the prefix is held back while streaming
    assert serving._split(head, None, final=True) == (None, "language German")  # never closed: all text
    assert serving._split(tok.encode("Hello", add_special_tokens=False), "English") == ("English", "Hello")
    assert serving._split(tok.encode("language None<asr_text>", add_special_tokens=False), None) == (None, "")
    assert serving._join([" a ", "", "b"], "English") == "a b" and serving._join(["你", "好"], "Chinese") == "你好"
