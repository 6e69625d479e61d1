"""Encoder-disaggregated serving's parts without an engine: --ec-transfer-config's JSON and its errors, the
embedding record's round trip and every integrity check (another key, another model, a flipped byte, a
truncated file are misses), the shared-folder connector (missing / unwritable folder at start-up, a full disk
fails the write and leaves nothing behind), the TCP connector over the KV transport, the consumer's rules
(a miss without a tower is an error naming the item), the encoder server surviving a failed write, the
epd-proxy's job split, and the EPD role options."""
from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from tests.integration.server_utils import free_port
from vllm_neuron.config import ec_transfer as ec_transfer_config
from vllm_neuron.config.ec_transfer import parse_ec_transfer_config
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.distributed.ec_transfer import connectors
from vllm_neuron.distributed.ec_transfer.connectors import ECSharedStorageConnector, ECTcpConnector
from vllm_neuron.distributed.ec_transfer.record import (ECTransferError, decode_record, ec_key, encode_record,
                                                        model_identity)
from vllm_neuron.entrypoints.epd.proxy import encode_body, media_parts
from vllm_neuron.worker.ec_consumer import RemoteEmbeddings


def _tensors(n: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(2, n, 8, generator=g)


def _shared(folder, role: str = "ec_both"):
    return parse_ec_transfer_config({"ec_connector": "ECSharedStorageConnector", "ec_role": role,
                                     "ec_connector_extra_config": {"shared_storage_path": str(folder)}})


def test_ec_transfer_config_vllm_fields_and_errors(tmp_path):
    c = _shared(tmp_path, "ec_producer")
    assert c.is_producer and not c.is_consumer and c.shared_storage_path == str(tmp_path)
    assert parse_ec_transfer_config(json.dumps({"ec_connector": "ECTcpConnector", "ec_role": "ec_consumer",
                                                "ec_connector_extra_config": {"producers": ["h:1", "h:2"]}})
                                    ).producers == ("h:1", "h:2")
    assert parse_ec_transfer_config(None) is None
    for bad, needle in [({"ec_connector": "Nope", "ec_role": "ec_producer"}, "ec_connector"),
                        ({"ec_connector": "ECTcpConnector", "ec_role": "kv_producer"}, "ec_role"),
                        ({"ec_role": "ec_producer"}, "needs ec_connector"),
                        ({"ec_connector": "ECSharedStorageConnector", "ec_role": "ec_producer"}, "shared_storage_path"),
                        ({"ec_connector": "ECTcpConnector", "ec_role": "ec_consumer"}, "producers must list"),
                        ({"ec_connector": "ECTcpConnector", "ec_role": "ec_producer",
                          "ec_connector_extra_config": {"shared_storage_path": "/x"}}, "does not take"),
                        ({"ec_connector": "ECTcpConnector", "ec_role": "ec_producer", "kv_role": "x"}, "unknown field")]:
        with pytest.raises(ValueError, match=needle):
            parse_ec_transfer_config(bad)


def test_record_round_trip_and_integrity():
    e, d = _tensors()
    data = encode_record("h1", "model-a", e, d)
    got = decode_record(data, "h1", "model-a", "test")
    assert torch.equal(got[0], e) and torch.equal(got[1], d)
    bf = decode_record(encode_record("h1", "m", e.bfloat16(), d.bfloat16()), "h1", "m", "test")
    assert bf[0].dtype == torch.bfloat16 and torch.equal(bf[0], e.bfloat16())
    assert decode_record(data, "h2", "model-a", "test") is None  # another item's record
    assert decode_record(data, "h1", "model-b", "test") is None  # another model's
    flipped = bytearray(data)
    flipped[-1] ^= 1
    assert decode_record(bytes(flipped), "h1", "model-a", "test") is None
    assert decode_record(data[:-4], "h1", "model-a", "test") is None
    assert decode_record(b"garbage", "h1", "model-a", "test") is None
    assert ec_key("h1", "model-a") != ec_key("h1", "model-b") != ec_key("h2", "model-a")


def test_model_identity_follows_config_and_weight_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    a = model_identity({"a": 1, "_name_or_path": "/one"}, str(tmp_path))
    assert a == model_identity({"a": 1, "_name_or_path": "/two"}, str(tmp_path))
    assert a != model_identity({"a": 2}, str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert a != model_identity({"a": 1}, str(tmp_path))


def test_shared_storage_round_trip_and_a_file_under_another_key_is_a_miss(tmp_path):
    c = ECSharedStorageConnector(_shared(tmp_path), "model-a")
    e, d = _tensors()
    assert not c.has("h1") and c.load("h1") is None
    n = c.save("h1", e, d)
    assert n == os.path.getsize(c.path("h1")) and c.bytes_written == n and c.has("h1")
    assert torch.equal(c.load("h1")[0], e)
    os.replace(c.path("h1"), c.path("h2"))  # a record renamed to another item's key
    assert c.has("h2") and c.load("h2") is None
    other = ECSharedStorageConnector(_shared(tmp_path), "model-b")
    c.save("h3", e, d)
    assert other.load("h3") is None and not other.has("h3")


def test_shared_folder_keeps_at_most_hold_bytes_oldest_out_first(tmp_path):
    def config(hold):
        return parse_ec_transfer_config({"ec_connector": "ECSharedStorageConnector", "ec_role": "ec_producer",
                                         "ec_connector_extra_config": {"shared_storage_path": str(tmp_path),
                                                                       "hold_bytes": hold}})
    e, d = _tensors()
    size = ECSharedStorageConnector(config(1 << 30), "m").save("probe", e, d)
    os.unlink(os.path.join(tmp_path, os.listdir(tmp_path)[0]))
    a = ECSharedStorageConnector(config(3 * size), "m")
    b = ECSharedStorageConnector(config(3 * size), "m")  # a second encoder on the same folder
    for i, c in enumerate([a, b, a, b, a]):
        c.save(f"h{i}", e, d)
        os.utime(c.path(f"h{i}"), ns=(i * 10**9, i * 10**9))  # mtimes one second apart, in write order
    assert [a.has(f"h{i}") for i in range(5)] == [False, False, True, True, True]
    assert sum(os.path.getsize(os.path.join(tmp_path, f)) for f in os.listdir(tmp_path)) <= 3 * size
    assert torch.equal(b.load("h4")[0], e)
    tiny = ECSharedStorageConnector(config(1), "m")  # a cap below one record keeps the newest only
    tiny.save("h5", e, d)
    assert os.listdir(tmp_path) == [os.path.basename(tiny.path("h5"))]
    with pytest.raises(ValueError, match="hold_bytes"):
        config(0)


def test_missing_or_unwritable_folder_is_a_start_up_error(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="is not an existing folder"):
        ECSharedStorageConnector(_shared(tmp_path / "nope"), "m")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not an existing folder"):
        ECSharedStorageConnector(_shared(tmp_path / "file"), "m")

    def refuse(**kw):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(ec_transfer_config.tempfile, "NamedTemporaryFile", refuse)
    with pytest.raises(ValueError, match="not writable by this encoder instance"):
        ECSharedStorageConnector(_shared(tmp_path, "ec_producer"), "m")
    ECSharedStorageConnector(_shared(tmp_path, "ec_consumer"), "m")  # a reader writes nothing


def test_full_disk_fails_the_write_and_leaves_nothing(tmp_path, monkeypatch):
    c = ECSharedStorageConnector(_shared(tmp_path), "m")
    real = os.fdopen

    class _Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(connectors.os, "fdopen", lambda fd, mode: _Full(real(fd, mode)))
    with pytest.raises(ECTransferError, match="No space left on device"):
        c.save("h1", *_tensors())
    assert os.listdir(tmp_path) == [] and not c.has("h1")
    monkeypatch.setattr(connectors.os, "fdopen", real)
    c.save("h1", *_tensors())  # the next write works
    assert c.has("h1")


def test_tcp_connector_round_trip_and_a_dead_producer_is_skipped():
    port = free_port()
    producer = ECTcpConnector(parse_ec_transfer_config({
        "ec_connector": "ECTcpConnector", "ec_role": "ec_producer",
        "ec_connector_extra_config": {"ec_port": port}}), "m")
    consumer = ECTcpConnector(parse_ec_transfer_config({
        "ec_connector": "ECTcpConnector", "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"producers": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{port}"],
                                      "fetch_timeout_s": 2}}), "m")
    try:
        e, d = _tensors()
        assert not consumer.has("h1") and consumer.load("h1") is None
        producer.save("h1", e, d)
        assert consumer.has("h1")
        got = consumer.load("h1")
        assert torch.equal(got[0], e) and torch.equal(got[1], d) and consumer.bytes_read == producer.bytes_written
    finally:
        producer.close()
        consumer.close()


class _Item:
    def __init__(self, h: str, n: int) -> None:
        self.mm_hash, self.num_tokens = h, n


def test_consumer_takes_what_was_written_and_a_miss_without_a_tower_names_it(tmp_path):
    writer = ECSharedStorageConnector(_shared(tmp_path, "ec_producer"), "m")
    e, d = _tensors(6)
    writer.save("a", e, d)
    writer.save("short", *_tensors(3))
    remote = RemoteEmbeddings(ECSharedStorageConnector(_shared(tmp_path, "ec_consumer"), "m"))
    found, left = remote.fetch({"a": _Item("a", 6), "b": _Item("b", 4)}, can_encode=True)
    assert list(found) == ["a"] and torch.equal(found["a"][0], e) and list(left) == ["b"]
    assert remote.loaded == 1 and remote.computed_here == 1
    found, left = remote.fetch({"short": _Item("short", 6)}, can_encode=True)  # a row count that does not fit
    assert not found and list(left) == ["short"]
    with pytest.raises(ECTransferError, match="no encoder instance provided the embeddings of 1 media item"):
        remote.fetch({"b": _Item("b", 4)}, can_encode=False)
    remote.computed("b", *_tensors(4))  # a consumer only: writes nothing
    assert not writer.has("b")


def test_a_producing_engine_writes_what_its_tower_computed_and_reads_nothing(tmp_path):
    both = RemoteEmbeddings(ECSharedStorageConnector(_shared(tmp_path, "ec_both"), "m"))
    both.computed("x", *_tensors(4))
    assert both.fetch({"x": _Item("x", 4)}, can_encode=False)[0]["x"][0].shape == (4, 8)
    producer = RemoteEmbeddings(ECSharedStorageConnector(_shared(tmp_path, "ec_producer"), "m"))
    found, left = producer.fetch({"x": _Item("x", 4)}, can_encode=True)
    assert found == {} and list(left) == ["x"]


def test_encoder_server_answers_a_failed_write_with_a_500_and_keeps_serving():
    from fastapi.testclient import TestClient

    from vllm_neuron.engine.encoder_engine import EncodeResult
    from vllm_neuron.entrypoints.epd.encoder_server import build_encoder_app

    class _Engine:
        fail = True

        def encode(self, media, kwargs):
            assert list(media) == ["image"]
            if self.fail:
                self.fail = False
                raise ECTransferError("cannot write the embeddings (No space left on device)")
            return EncodeResult(["h"], 1, 0, 123, 0.01)

        def close(self):
            pass

    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]}
    with TestClient(build_encoder_app(_Engine(), "m")) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 500 and "No space left" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["ec_transfer_params"]["bytes"] == 123
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "text only"}]})
        assert r.status_code == 400 and "needs image or video" in r.json()["error"]["message"]
        metrics = client.get("/metrics").text
        assert 'vllm_neuron:ec_encode_requests_total{outcome="transfer_error"} 1.0' in metrics
        assert "vllm_neuron:ec_bytes_written_total 123.0" in metrics
        assert client.get("/health").status_code == 200
    with TestClient(build_encoder_app(_Engine(), "m", api_key="k")) as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 401
        r = client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"})
        assert r.status_code == 500  # past the key: this engine's first write fails


def test_proxy_splits_one_encode_job_per_media_part():
    img = {"type": "image_url", "image_url": {"url": "u1"}}
    vid = {"type": "video_url", "video_url": {"url": "u2"}}
    body = {"model": "m", "max_tokens": 50, "stream": True, "mm_processor_kwargs": {"max_pixels": 9},
            "messages": [{"role": "system", "content": "s"},
                         {"role": "user", "content": [img, {"type": "text", "text": "t"}, vid]}]}
    assert media_parts(body) == [img, vid]
    assert media_parts({"messages": [{"role": "user", "content": "hi"}]}) == []
    job = encode_body(body, vid)
    assert job == {"model": "m", "messages": [{"role": "user", "content": [vid]}], "max_tokens": 1,
                   "stream": False, "mm_processor_kwargs": {"max_pixels": 9}}


def test_epd_role_options(tmp_path):
    ec = json.dumps({"ec_connector": "ECSharedStorageConnector", "ec_role": "ec_consumer",
                     "ec_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    with pytest.raises(ValueError, match="needs --ec-transfer-config with ec_role 'ec_producer'"):
        EngineArgs(mm_encoder_only=True).checked(torch.device("cpu"))
    with pytest.raises(ValueError, match="needs --ec-transfer-config"):
        EngineArgs(mm_encoder_only=True, ec_transfer_config=ec).checked(torch.device("cpu"))
    producer = ec.replace("ec_consumer", "ec_producer")
    with pytest.raises(ValueError, match="mutually exclusive"):
        EngineArgs(mm_encoder_only=True, ec_transfer_config=producer,
                   additional_config={"mm_language_model_only": True}).checked(torch.device("cpu"))
    args = EngineArgs(mm_encoder_only=True, ec_transfer_config=producer).checked(torch.device("cpu"))
    assert args.ec_transfer_config.is_producer
    with pytest.raises(ValueError, match="no embeddings to produce; use 'ec_consumer'"):
        EngineArgs(ec_transfer_config=producer, additional_config={"mm_language_model_only": True}).checked(
            torch.device("cpu"))
    pd = EngineArgs(ec_transfer_config=ec, additional_config={"mm_language_model_only": True}).checked(
        torch.device("cpu"))
    assert pd.ec_transfer_config.is_consumer and pd.additional_config.mm_language_model_only


def test_encoder_instance_refuses_options_it_cannot_honour(tmp_path):
    ec = json.dumps({"ec_connector": "ECSharedStorageConnector", "ec_role": "ec_producer",
                     "ec_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    for kwargs, needle in [({"tensor_parallel_size": 2}, "tensor_parallel_size=2 does not apply to an EPD encoder"),
                           ({"enable_lora": True}, "enable_lora=True does not apply"),
                           ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                    "prompt_lookup_max": 2}}, "speculative_config=")]:
        with pytest.raises(ValueError, match=needle):
            EngineArgs(mm_encoder_only=True, ec_transfer_config=ec, **kwargs).checked(torch.device("cpu"))


def test_a_tower_less_instance_asks_the_connector_once_per_item():
    from vllm_neuron.engine.input_processor import _Admitted

    asked = []
    written = {"a"}
    check = _Admitted(lambda h: asked.append(h) or h in written, size=2)
    assert check("a") and check("a") and asked == ["a"]  # taken once: not asked again
    assert not check("b") and not check("b") and asked == ["a", "b", "b"]  # a miss is asked each time
    written |= {"c", "d"}
    assert check("c") and check("d") and check("a")  # "a" fell out of the two remembered: asked again
    assert asked[-1] == "a"


@pytest.mark.engine
def test_encoder_engine_over_the_tcp_connector(tmp_path):
    """The encoder instance's engine (vision tower only, eager) writes what a consumer reads over TCP: equal to
    the tower's output, once per item (a repeated image is a cache hit), in the request's item order."""
    from tests.vlm_factory import data_url, make_tiny_qwen3_vl, png_bytes, random_image
    from vllm_neuron.engine.encoder_engine import EncoderEngine
    from vllm_neuron.engine.resolve import resolve_engine_config

    model, port = make_tiny_qwen3_vl(str(tmp_path / "model")), free_port()
    ec = {"ec_connector": "ECTcpConnector", "ec_role": "ec_producer", "ec_connector_extra_config": {"ec_port": port}}
    config, ckpt = resolve_engine_config(EngineArgs(model=model, enforce_eager=True, dtype="float32",
                                                    max_model_len=256, mm_encoder_only=True, ec_transfer_config=ec))
    engine = EncoderEngine(config, ckpt)
    assert sum(p.numel() for p in engine.model.parameters()) == sum(
        p.numel() for p in engine.model.model.visual.parameters())  # the vision tower only
    consumer = ECTcpConnector(parse_ec_transfer_config({
        "ec_connector": "ECTcpConnector", "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"producers": [f"127.0.0.1:{port}"]}}), engine.connector.model_id)
    try:
        a, b = (data_url(png_bytes(random_image(56, 84, s))) for s in (1, 2))
        first = engine.encode({"image": [a, b]})
        assert (first.encoded, first.cached) == (2, 0) and first.bytes_written > 0
        again = engine.encode({"image": [b]})
        assert (again.encoded, again.cached) == (0, 1) and again.mm_hashes == first.mm_hashes[1:]
        assert again.bytes_written == 0  # the producer still serves it: not written twice
        for h in first.mm_hashes:
            held = engine.state.encoder_cache.get(h)
            got = consumer.load(h)
            assert torch.equal(got[0], held[0].cpu()) and torch.equal(got[1], held[1].cpu())
            assert got[0].shape == (6, 64)  # 4 x 6 patches merged 2 x 2, the text tower's width
    finally:
        consumer.close()
        engine.close()
