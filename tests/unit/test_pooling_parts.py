"""Pooling models' parts without an engine (issue 48): which runner a checkpoint gets, --pooler-config and the
sentence-transformers files, PoolingParams against the model, the pooler across segmented chunks, and the
scheduler's handling of pooling requests (prefill only, no prefix cache, finished by their last chunk)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from vllm_neuron.config.pooler_config import (PoolerConfig, PoolingSetup, SentenceTransformersInfo,
                                              parse_pooler_config, read_sentence_transformers, resolve_runner)
from vllm_neuron.core.request import Request
from vllm_neuron.core.scheduler import Scheduler, SchedulerConfig
from vllm_neuron.pooling_params import PoolingParams
from vllm_neuron.sampling_params import SamplingParams
from vllm_neuron.step import ModelRunnerOutput, NewRequestData, ScheduledChunk
from vllm_neuron.worker.pooling import Pooler


@pytest.mark.parametrize("runner,convert,task,arch,want", [
    ("auto", "auto", None, "Qwen3ForCausalLM", ("generate", "none")),
    ("auto", "auto", None, "Qwen3Model", ("pooling", "embed")),
    ("auto", "auto", None, "Qwen3ForSequenceClassification", ("pooling", "classify")),
    ("pooling", "auto", None, "LlamaForCausalLM", ("pooling", "embed")),
    ("auto", "classify", None, "Qwen3ForCausalLM", ("pooling", "classify")),
    ("auto", "auto", "embedding", "LlamaForCausalLM", ("pooling", "embed")),
    ("auto", "auto", "score", "Qwen3ForCausalLM", ("pooling", "classify")),
])
def test_runner_and_convert_from_flags_and_architecture(runner, convert, task, arch, want):
    assert resolve_runner(runner, convert, task, (arch,)) == want


@pytest.mark.parametrize("runner,convert,task,arch,match", [
    ("generate", "auto", None, "Qwen3Model", "is a pooling model"),
    ("generate", "embed", None, "Qwen3ForCausalLM", "needs runner='pooling'"),
    ("auto", "classify", "embed", "Qwen3ForCausalLM", "contradicts"),
    ("sideways", "auto", None, "Qwen3ForCausalLM", "runner='sideways' is not valid"),
    ("auto", "auto", "reward", "Qwen3ForCausalLM", "task='reward' is not valid"),
])
def test_refused_runner_combinations(runner, convert, task, arch, match):
    with pytest.raises(ValueError, match=match):
        resolve_runner(runner, convert, task, (arch,))


def test_pooler_config_parsing():
    assert parse_pooler_config('{"pooling_type": "mean", "normalize": false}') == PoolerConfig("MEAN", False)
    assert parse_pooler_config({"activation": False}).use_activation is False  # vLLM's older key
    for bad, match in [({"pooling_type": "MAX"}, "not valid"), ({"nope": 1}, "unknown key"),
                       ({"max_embed_len": 8}, "not supported yet"), ({"dimensions": 0}, "dimensions"), ("[1]", "JSON")]:
        with pytest.raises(ValueError, match=match):
            parse_pooler_config(bad)


def test_sentence_transformers_files(tmp_path):
    assert read_sentence_transformers(str(tmp_path)) == SentenceTransformersInfo()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True,
                                                                    "pooling_mode_mean_tokens": False}))
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "Instruct: find\nQuery: ", "document": ""}, "default_prompt_name": "query"}))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": True}))
    info = read_sentence_transformers(str(tmp_path))
    assert (info.pooling_type, info.normalize, info.default_prompt_name) == ("CLS", False, "query")
    assert (info.max_seq_length, info.do_lower_case) == (512, True)
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": "long"}))
    with pytest.raises(ValueError, match="sentence_bert_config.json: max_seq_length must be a positive integer"):
        read_sentence_transformers(str(tmp_path))
    (tmp_path / "sentence_bert_config.json").unlink()
    (tmp_path / "modules.json").write_text(json.dumps([{"idx": 2, "path": "2_Dense",
                                                        "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match="Dense"):
        read_sentence_transformers(str(tmp_path))


def test_pooling_params_against_the_model():
    assert PoolingParams().verify("embed", 64, False).task == "embed"
    for params, match in [(PoolingParams(dimensions=8), "matryoshka"), (PoolingParams(task="classify"), "not served"),
                          (PoolingParams(task="embed", dimensions=8), "matryoshka")]:
        with pytest.raises(ValueError, match=match):
            params.verify("embed", 64, False)
    with pytest.raises(ValueError, match="not supported by this model"):
        PoolingParams(dimensions=8).verify("embed", 64, (16, 32))
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)


def _setup(kind: str) -> PoolingSetup:
    return PoolingSetup("embed", kind, normalize=False, use_activation=True, dimensions=None, matryoshka=True,
                        hidden_size=4, num_labels=0)


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_pooler_spans_segmented_chunks(kind):
    pooler = Pooler(_setup(kind))
    params = PoolingParams(task="embed")
    pooler.add(NewRequestData("a", [1] * 5, SamplingParams(), None, pooling_params=params))
    pooler.add(NewRequestData("b", [1] * 2, SamplingParams(), None, pooling_params=params))
    hidden = torch.randn(10, 4)  # a: 3 rows then 2 rows (next step); b: 2 rows; padding after
    first = pooler.pool([ScheduledChunk("a", [1] * 3, 0, [], sample=False),
                         ScheduledChunk("b", [1] * 2, 0, [], sample=True)], hidden[:8])
    second = pooler.pool([ScheduledChunk("a", [1] * 2, 3, [], sample=True)], hidden[5:])
    a_rows, b_rows = torch.cat([hidden[:3], hidden[5:7]]), hidden[3:5]
    want = {"LAST": lambda r: r[-1], "MEAN": lambda r: r.mean(0), "CLS": lambda r: r[0]}[kind]
    assert set(first) == {"b"} and set(second) == {"a"}
    assert torch.allclose(first["b"], want(b_rows), atol=1e-6)
    assert torch.allclose(second["a"], want(a_rows), atol=1e-6)
    pooler.states["a"].params = PoolingParams(task="embed", dimensions=2, normalize=True)
    assert torch.allclose(pooler._heads([("a", want(a_rows))])["a"], F.normalize(want(a_rows)[:2], dim=-1))


def test_scheduler_finishes_pooling_requests_with_their_last_chunk():
    s = Scheduler(SchedulerConfig(4, 8, 64, 4, 32, enable_prefix_caching=True))
    prompt = list(range(10, 22))
    for rid in ("p1", "p2"):  # the same prompt twice: a pooling request takes no prefix-cache hit
        s.add_request(Request(rid, prompt, SamplingParams(max_tokens=1), pooling_params=PoolingParams()))
        steps = []
        while s.has_unfinished():
            out = s.schedule()
            steps.append(out)
            assert out.kind == "prefill"  # never a decode step
            done = s.update(out, ModelRunnerOutput({}, pooled={c.req_id: torch.zeros(1) for c in out.chunks
                                                               if c.sample}))
        assert [len(c.token_ids) for o in steps for c in o.chunks] == [8, 4]
        assert steps[0].chunks[0].start_pos == 0
        assert [f.request.request_id for f in done] == [rid] and done[0].finish_reason == "stop"
    assert s.kv.usage == 0.0
