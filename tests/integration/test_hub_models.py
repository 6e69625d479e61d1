"""Models by Hugging Face id against a local hub (tests/hub_server.py) in the hub's URL layout, HF_ENDPOINT pointing
at it, and the real huggingface_hub client: download into --download-dir, cache reuse, offline mode and a hub that
cannot be reached, revisions, GGUF quantization selection, and every failure as a one-line error. The repositories
hold the tests' tiny Llama (its folder as files), its GGUF, and a few broken ones.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time

import pytest

from tests.hub_server import TOKEN, LocalHub, folder_files
from tests.integration.server_utils import child_env, cli, free_port
from tests.model_factory import make_tiny_gguf, tiny_llm
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.engine.resolve import fetch_hub_models, resolve_engine_config
from vllm_neuron.model.loader import load_checkpoint
from vllm_neuron.model.loader.hub import fetch_model

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



@pytest.fixture(scope="module")
def hub(tiny_llama_dir, tiny_llama_gguf, tmp_path_factory):
    files = folder_files(tiny_llama_dir)
    gguf = open(tiny_llama_gguf, "rb").read()
    h = LocalHub()
    v1 = {**files, "generation_config.json": b'{"temperature": 0.25}'}
    h.add("acme/tiny", {"main": {**files, "pytorch_model.bin": b"pickle", "original/params.json": b"{}"}, "v1": v1})
    h.add("acme/big", {"main": files})  # the interrupted download's (a repository of its own: a cache of its own)
    h.add("acme/secret", {"main": files}, private=True)
    h.add("acme/tiny-GGUF", {"main": {"tiny-Q8_0.gguf": gguf, "tiny-Q4_K_M.gguf": gguf,
                                      "mmproj-tiny-Q8_0.gguf": b"vision tower", "README.md": b"# tiny"}})
    first = make_tiny_gguf(str(tmp_path_factory.mktemp("split") / "tiny-Q8_0.gguf"), quant="Q8_0", tokenizer=False,
                           vocab_size=512, split_max_tensors=12)
    parts = {f"Q8_0/{n}": open(os.path.join(os.path.dirname(first), n), "rb").read()
             for n in sorted(os.listdir(os.path.dirname(first)))}
    h.add("acme/split-GGUF", {"main": {**parts, "README.md": b"# split"},
                              "broken": {n: b for n, b in parts.items() if "00002-of" not in n}})
    h.add("acme/pickled", {"main": {"config.json": files["config.json"], "pytorch_model.bin": b"pickle"}})
    config = {**json.loads(files["config.json"]), "architectures": ["AcmeForCausalLM"],
              "auto_map": {"AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"}}
    h.add("acme/custom", {"main": {**files, "config.json": json.dumps(config).encode()}})
    yield h
    h.close()


@pytest.fixture
def online(hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return hub


def sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_download_cache_reuse_offline_and_unreachable_hub(online, tiny_llama_dir, tmp_path, monkeypatch):
    d = str(tmp_path)
    path = fetch_model("acme/tiny", download_dir=d)
    assert path.startswith(os.path.join(d, "models--acme--tiny", "snapshots"))
    got = sorted(os.listdir(path))
    assert "model.safetensors" in got and "config.json" in got and "tokenizer.json" in got
    assert "pytorch_model.bin" not in got and "original" not in got  # only what the loader reads
    assert sha(os.path.join(path, "model.safetensors")) == sha(os.path.join(tiny_llama_dir, "model.safetensors"))
    assert load_checkpoint(path).hf_config.num_hidden_layers == 2
    gets = len(online.downloads(""))
    assert fetch_model("acme/tiny", download_dir=d) == path and len(online.downloads("")) == gets  # the cache
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens: the network is down
    assert fetch_model("acme/tiny", download_dir=d) == path
    with pytest.raises(ValueError, match=r"cannot be reached \(ConnectError\) and 'acme/big' \(revision 'main'\) is "
                                         r"not in .*: check the network and HF_ENDPOINT"):
        fetch_model("acme/big", download_dir=d)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert fetch_model("acme/tiny", download_dir=d) == path
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1 and 'acme/big' .* run once without HF_HUB_OFFLINE"):
        fetch_model("acme/big", download_dir=d)
    with pytest.raises(ValueError, match="revision 'v1'"):  # offline, a revision never downloaded
        fetch_model("acme/tiny", download_dir=d, revision="v1")


def test_revisions_tokens_and_the_errors_of_a_bad_id(online, tmp_path, monkeypatch):
    d = str(tmp_path)
    v1 = fetch_model("acme/tiny", download_dir=d, revision="v1")
    assert open(os.path.join(v1, "generation_config.json")).read() == '{"temperature": 0.25}'
    assert v1 != fetch_model("acme/tiny", download_dir=d)
    with pytest.raises(ValueError, match=r"revision 'nope' does not exist in 'acme/tiny' .*--revision"):
        fetch_model("acme/tiny", download_dir=d, revision="nope")
    with pytest.raises(ValueError, match=r"there is no model 'acme/nothing' on http://127\.0\.0\.1:\d+ and no local "
                                         "path of that name"):
        fetch_model("acme/nothing", download_dir=d)
    with pytest.raises(ValueError, match=r"'acme/secret' was not found .* or is private, and no token was sent "
                                         r"\(401\): if it exists, set HF_TOKEN"):
        fetch_model("acme/secret", download_dir=d)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(ValueError, match="the HF_TOKEN sent was refused"):
        fetch_model("acme/secret", download_dir=d)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert os.path.isfile(os.path.join(fetch_model("acme/secret", download_dir=d), "model.safetensors"))
    with pytest.raises(ValueError, match=r"'acme/pickled' has only pytorch_model\.bin \(pickle weights"):
        fetch_model("acme/pickled", download_dir=d)


def test_gguf_quantization_selection(online, tiny_llama_gguf, tmp_path):
    d = str(tmp_path)
    path = fetch_model("acme/tiny-GGUF:q8_0", download_dir=d)
    assert os.path.basename(path) == "tiny-Q8_0.gguf" and sha(path) == sha(tiny_llama_gguf)
    assert [p for _, p, _ in online.requests if p.endswith(".gguf") and "/resolve/" in p] == \
        [p for _, p, _ in online.requests if p.endswith("tiny-Q8_0.gguf") and "/resolve/" in p]  # that file only
    assert load_checkpoint(path).hf_config.num_hidden_layers == 2
    assert os.path.basename(fetch_model("acme/tiny-GGUF", download_dir=d)) == "tiny-Q4_K_M.gguf"  # llama.cpp's default
    assert os.path.basename(fetch_model("acme/tiny-GGUF", download_dir=d, hf_file="tiny-Q8_0.gguf")) == "tiny-Q8_0.gguf"
    with pytest.raises(ValueError, match=r"no GGUF file for the quantization 'Q5_K_M'; its GGUF files: "
                                         r"tiny-Q4_K_M\.gguf, tiny-Q8_0\.gguf"):
        fetch_model("acme/tiny-GGUF:Q5_K_M", download_dir=d)
    with pytest.raises(ValueError, match="--hf-file 'nope.gguf' is not in 'acme/tiny-GGUF'"):
        fetch_model("acme/tiny-GGUF", download_dir=d, hf_file="nope.gguf")


def test_a_split_gguf_is_fetched_whole(online, tmp_path):
    d = str(tmp_path)
    path = fetch_model("acme/split-GGUF:Q8_0", download_dir=d)
    assert path.endswith("Q8_0/tiny-Q8_0-00001-of-00002.gguf")
    assert sorted(os.listdir(os.path.dirname(path))) == [f"tiny-Q8_0-0000{i}-of-00002.gguf" for i in (1, 2)]
    ck = load_checkpoint(path)
    assert len(dict(ck.iter_weights())) == 2 * 9 + 3  # both parts' tensors
    with pytest.raises(ValueError, match="one part of a split GGUF of 2 files, and the repository lacks "
                                         "Q8_0/tiny-Q8_0-00002-of-00002.gguf"):
        fetch_model("acme/split-GGUF:Q8_0", download_dir=d, revision="broken")


def test_engine_options_by_id(online, tiny_llama_dir, tmp_path):
    d = str(tmp_path)
    args = fetch_hub_models(EngineArgs.from_kwargs(model="acme/tiny", tokenizer_revision="v1", download_dir=d))
    assert args.served_names() == ["acme/tiny"] and os.path.isfile(os.path.join(args.model, "model.safetensors"))
    tok = os.listdir(args.tokenizer)  # the tokenizer's revision, without the weights
    assert "tokenizer.json" in tok and "model.safetensors" not in tok and args.tokenizer != args.model
    with pytest.raises(ValueError, match="--revision apply to a model given by Hugging Face id"):
        fetch_hub_models(EngineArgs.from_kwargs(model=tiny_llama_dir, revision="v1"))
    with pytest.raises(ValueError, match=r"needs trust_remote_code: its config\.json's auto_map names the "
                                         r"repository's own code \(modeling_acme\.AcmeForCausalLM\)"):
        resolve_engine_config(EngineArgs.from_kwargs(model="acme/custom", download_dir=d))


def test_a_dropped_connection_resumes_where_it_stopped(online, tmp_path):
    online.stall("model.safetensors", after=12 << 20, hang=False)  # past huggingface_hub's 10 MiB write chunk
    path = fetch_model("acme/big", download_dir=str(tmp_path))
    first, retry = online.downloads("model.safetensors")[-2:]
    content = online.repos["acme/big"].revisions["main"]["model.safetensors"]
    assert first is None and 0 < int(retry.removeprefix("bytes=").rstrip("-")) < len(content)  # a Range request
    assert sha(os.path.join(path, "model.safetensors")) == hashlib.sha256(content).hexdigest()


def test_ctrl_c_in_a_download_is_one_line_never_loaded_truncated_and_continued_next_time(online, tmp_path,
                                                                                         monkeypatch):
    """`vllm-neuron serve org/name` interrupted (SIGINT) in the middle of model.safetensors: a one-line message,
    nothing truncated in the snapshot, and the next run continues the weight file from the bytes the first one
    wrote (a Range request from there), ending with the whole, checked file."""
    d = str(tmp_path / "hub")
    online.stall("model.safetensors", after=11 << 20)  # past huggingface_hub's 10 MiB read chunk: 10 MiB written
    proc = subprocess.Popen(cli() + ["serve", "acme/big", "--download-dir", d, "--port", str(free_port())],
                            cwd=_REPO_ROOT, env=child_env(str(tmp_path), HF_ENDPOINT=online.url),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            # A shell's background job ignores SIGINT, and a child inherits that: Ctrl-C is the
                            # default action here whatever ran pytest.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert online.stalled.wait(180), "the download never reached the stall"
        blobs = os.path.join(d, "models--acme--big", "blobs")
        deadline = time.monotonic() + 60  # the bytes sent reach the file a moment after the server stalls
        while time.monotonic() < deadline and sum(
                os.path.getsize(os.path.join(blobs, f)) for f in os.listdir(blobs) if f.endswith(".partial")) < 10 << 20:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        online.release()
    assert proc.returncode == 130, out
    assert "Download of acme/big interrupted: the files it finished stay in" in out and "Traceback" not in out, out
    snapshot = os.path.join(d, "models--acme--big", "snapshots")
    assert not any("model.safetensors" in files for _, _, files in os.walk(snapshot))  # nothing partial to load
    partial = [f for f in os.listdir(blobs) if f.endswith(".partial")]
    assert len(partial) == 1, os.listdir(blobs)
    kept = os.path.getsize(os.path.join(blobs, partial[0]))
    assert kept >= 10 << 20, kept
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"the cached 'acme/big' .* is incomplete, missing .*model\.safetensors.*: "
                                         "an earlier download was interrupted; run once with network access"):
        fetch_model("acme/big", download_dir=d)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    path = fetch_model("acme/big", download_dir=d)
    assert online.downloads("model.safetensors")[-1] == f"bytes={kept}-"  # continued, not fetched again
    assert sha(os.path.join(path, "model.safetensors")) == \
        hashlib.sha256(online.repos["acme/big"].revisions["main"]["model.safetensors"]).hexdigest()
    assert not [f for f in os.listdir(blobs) if f.endswith(".partial")]
    assert load_checkpoint(path).hf_config.num_hidden_layers == 2


def test_a_partial_file_that_does_not_match_is_refused_and_removed(online, tmp_path):
    """A partial weight file whose bytes are not the hub's (another writer, a disk fault): the finished file fails
    its sha256, nothing is linked, the partial goes, and the next run downloads it whole."""
    d = str(tmp_path)
    content = online.repos["acme/big"].revisions["main"]["model.safetensors"]
    blobs = os.path.join(d, "models--acme--big", "blobs")
    os.makedirs(blobs)
    bad = os.path.join(blobs, hashlib.sha256(content).hexdigest() + ".partial")
    with open(bad, "wb") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(ValueError, match=r"model\.safetensors of acme/big downloaded with sha256 [0-9a-f]{64}, not "
                                         r"the hub's [0-9a-f]{64}: the partial file was removed; run again"):
        fetch_model("acme/big", download_dir=d)
    assert not os.path.exists(bad)
    path = fetch_model("acme/big", download_dir=d)
    assert online.downloads("model.safetensors")[-1] is None
    assert sha(os.path.join(path, "model.safetensors")) == hashlib.sha256(content).hexdigest()


@pytest.mark.engine
def test_llm_serves_a_model_by_id(online, tmp_path):
    llm = tiny_llm("acme/tiny", download_dir=str(tmp_path))
    config = llm.llm_engine.config
    assert config.served_names() == ["acme/tiny"] and config.model.startswith(str(tmp_path))
    out = llm.generate(["Hello there"], use_tqdm=False)[0].outputs[0]
    assert out.token_ids
