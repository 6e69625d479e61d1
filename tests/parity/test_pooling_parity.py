"""Pooling models (issue 48) against transformers' hidden states pooled the reference way (fp32, 1e-5).

Decoder embedders: a bare Qwen3Model checkpoint (Qwen3-Embedding's layout: last-token pooling, normalized,
Matryoshka `dimensions`) and a LlamaForCausalLM converted with convert="embed" whose sentence-transformers
files ask for mean pooling and normalization; CLS pooling through --pooler-config. Prompts longer than one
prefill step (32 tokens) are segmented, so pooling spans chunks; each model runs batched and one prompt at a
time. Classification: a Qwen3ForSequenceClassification head (softmax over its labels, and LLM.score as a
one-label cross-encoder) and the Qwen3-Reranker "no"/"yes" logit form.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from tests.model_factory import TINY_ENGINE, build_tiny_model, make_tiny_model, tiny_llm
from vllm_neuron import PoolingParams

pytestmark = pytest.mark.engine

PROMPTS = [[5, 6, 7], list(range(100, 140)), list(range(300, 371)), [9] * 17]  # 40 and 71: segmented
TOL = 1e-5


def _hidden(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).last_hidden_state[0].float()


def _write_json(path: str, name: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.join(path, name)), exist_ok=True)
    with open(os.path.join(path, name), "w", encoding="utf-8") as f:
        json.dump(obj, f)


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def qwen3_embedder(tmp_path_factory):
    """(LLM, transformers Qwen3Model): a Qwen3-Embedding-shaped checkpoint declared Matryoshka."""
    hf = build_tiny_model("qwen3", seed=1)
    path = make_tiny_model(str(tmp_path_factory.mktemp("q3emb")), "qwen3", model=hf.model)
    cfg = json.load(open(os.path.join(path, "config.json")))
    _write_json(path, "config.json", {**cfg, "is_matryoshka": True})
    return tiny_llm(path), hf.model


def test_qwen3_embeddings_last_token_normalized_batched_and_alone(qwen3_embedder):
    llm, ref_model = qwen3_embedder
    batched = llm.embed(_ids(PROMPTS), use_tqdm=False)
    for p, out in zip(PROMPTS, batched, strict=True):
        ref = F.normalize(_hidden(ref_model, p)[-1], dim=-1)
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() < TOL, f"prompt of {len(p)} tokens"
        alone = llm.embed(_ids([p]), use_tqdm=False)[0]
        assert (torch.tensor(alone.outputs.embedding) - ref).abs().max().item() < TOL
        assert out.prompt_token_ids == p


def test_qwen3_matryoshka_dimensions_truncation_and_no_normalize(qwen3_embedder):
    llm, ref_model = qwen3_embedder
    p = PROMPTS[1]
    h = _hidden(ref_model, p)[-1]
    out = llm.embed(_ids([p]), pooling_params=PoolingParams(dimensions=16), use_tqdm=False)[0]
    assert (torch.tensor(out.outputs.embedding) - F.normalize(h[:16], dim=-1)).abs().max().item() < TOL
    raw = llm.encode(_ids([p]), PoolingParams(normalize=False), use_tqdm=False)[0]
    assert (raw.outputs.data - h).abs().max().item() < TOL
    # truncate_prompt_tokens keeps the last N tokens (vLLM's side)
    cut = llm.embed(_ids([p]), truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert cut.prompt_token_ids == p[-10:]
    assert (torch.tensor(cut.outputs.embedding) - F.normalize(_hidden(ref_model, p[-10:])[-1], dim=-1)
            ).abs().max().item() < TOL


def test_bad_pooling_requests_are_refused(qwen3_embedder):
    llm, _ = qwen3_embedder
    with pytest.raises(ValueError, match="dimensions must be at most"):
        llm.embed(["hi"], pooling_params=PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="cannot be empty"):
        llm.embed([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.embed(_ids([[7] * (TINY_ENGINE["max_model_len"] + 1)]), use_tqdm=False)
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate(["hi"], use_tqdm=False)
    with pytest.raises(ValueError, match="not served by this model"):
        llm.classify(["hi"], use_tqdm=False)
    # the engine still serves after the refusals; a prompt of exactly max_model_len fits
    assert len(llm.embed(_ids([[7] * TINY_ENGINE["max_model_len"]]), use_tqdm=False)[0].outputs.embedding) == 64


def test_llama_convert_embed_reads_sentence_transformers_mean_pooling(tmp_path):
    hf = build_tiny_model("llama", seed=2)
    path = make_tiny_model(str(tmp_path / "llama"), "llama", model=hf)
    _write_json(path, "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}])
    _write_json(path, "1_Pooling/config.json", {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
                                                "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False})
    # sentence_bert_config.json: its max_seq_length is the context (as vLLM: max_model_len derives from it), and
    # do_lower_case lower-cases texts before tokenizing, as sentence-transformers does.
    _write_json(path, "sentence_bert_config.json", {"max_seq_length": 96, "do_lower_case": True})
    with pytest.raises(ValueError, match=r"max_model_len=256 is larger than the model's maximum context \(96"):
        tiny_llm(path, convert="embed")
    llm = tiny_llm(path, convert="embed", max_model_len=None)
    assert llm.llm_engine.config.max_model_len == 96
    outs = llm.embed(_ids(PROMPTS), use_tqdm=False)
    for p, out in zip(PROMPTS, outs, strict=True):
        ref = F.normalize(_hidden(hf.model, p).mean(0), dim=-1)
        assert (torch.tensor(out.outputs.embedding) - ref).abs().max().item() < TOL, f"prompt of {len(p)} tokens"
    upper, lower = llm.embed(["The Capital Of FRANCE", "the capital of france"], use_tqdm=False)
    assert upper.prompt_token_ids == lower.prompt_token_ids
    assert upper.outputs.embedding == lower.outputs.embedding
    tok = llm.get_tokenizer()
    assert tok.encode("The Capital Of FRANCE") != tok.encode("the capital of france")  # the lower-casing mattered
    del llm
    # --pooler-config overrides the checkpoint's files: CLS pooling, not normalized (the older --task spelling)
    llm = tiny_llm(path, task="embed", pooler_config={"pooling_type": "CLS", "normalize": False},
                   max_model_len=None)
    out = llm.embed(_ids([PROMPTS[2]]), use_tqdm=False)[0]
    ref = _hidden(hf.model, PROMPTS[2])[0]
    assert (torch.tensor(out.outputs.embedding) - ref).abs().max().item() < TOL


def _classifier(tmp_path, num_labels: int):
    """(checkpoint dir, transformers Qwen3ForSequenceClassification) with the tiny Qwen3's seeded decoder."""
    import transformers

    base = build_tiny_model("qwen3", seed=3)
    cfg = base.config
    cfg.num_labels, cfg.architectures = num_labels, ["Qwen3ForSequenceClassification"]
    clf = transformers.Qwen3ForSequenceClassification(cfg).eval()
    clf.model.load_state_dict(base.model.state_dict())
    with torch.no_grad():
        clf.score.weight.copy_(torch.randn(clf.score.weight.shape, generator=torch.Generator().manual_seed(4)) / 8)
    return make_tiny_model(str(tmp_path / f"clf{num_labels}"), "qwen3", model=clf), clf


def test_sequence_classification_probs_and_cross_encoder_scores(tmp_path):
    path, clf = _classifier(tmp_path, 3)
    llm = tiny_llm(path)  # *ForSequenceClassification: a pooling model by its architecture
    outs = llm.classify(_ids(PROMPTS), use_tqdm=False)
    for p, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = torch.softmax(clf(torch.tensor([p])).logits[0].float(), -1)
        assert (torch.tensor(out.outputs.probs) - ref).abs().max().item() < TOL
    with pytest.raises(ValueError, match="one label"):
        llm.score("a", ["b"], use_tqdm=False)
    del llm
    path, clf = _classifier(tmp_path, 1)
    llm = tiny_llm(path)
    query, docs = "what is a fox", ["a fox is an animal", "the sky is blue", "foxes run"]
    scores = llm.score(query, docs, use_tqdm=False)
    tok = llm.get_tokenizer()
    ref = []
    for d in docs:
        with torch.no_grad():
            ref.append(torch.sigmoid(clf(torch.tensor([tok(query, d)["input_ids"]])).logits[0, 0].float()).item())
    assert [round(s.outputs.score, 5) for s in scores] == [round(r, 5) for r in ref]
    assert sorted(range(3), key=lambda i: -scores[i].outputs.score) == sorted(range(3), key=lambda i: -ref[i])


def test_qwen3_reranker_yes_no_logit_form(tmp_path):
    hf = build_tiny_model("qwen3", seed=5)
    path = make_tiny_model(str(tmp_path / "rr"), "qwen3", model=hf)
    cfg = json.load(open(os.path.join(path, "config.json")))
    _write_json(path, "config.json", {**cfg, "classifier_from_token": ["no", "yes"]})
    llm = tiny_llm(path, convert="classify")
    tok = llm.get_tokenizer()
    no, yes = (tok.encode(t, add_special_tokens=False)[0] for t in ("no", "yes"))
    outs = llm.classify(_ids(PROMPTS), use_tqdm=False)
    for p, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            last = hf(torch.tensor([p])).logits[0, -1].float()
        ref = torch.softmax(last[[no, yes]], -1)[1].item()  # Qwen3-Reranker's reference scoring
        assert abs(out.outputs.probs[0] - ref) < TOL


def test_compiled_prefill_graph_embeddings_match_eager(qwen3_embedder, tmp_path):
    """The one compiled run: one prefill bucket (no decode graph is built), batched prompts in one step."""
    from vllm_neuron.engine.core import EngineCore

    _, ref_model = qwen3_embedder
    path = make_tiny_model(str(tmp_path / "q3c"), "qwen3", model=ref_model)
    llm = tiny_llm(path, enforce_eager=False, max_model_len=32, max_num_batched_tokens=32,
                   additional_config={"neuron_config": {"num_batched_tokens_buckets": [32]}})
    core: EngineCore = llm.llm_engine.core
    assert [s.name for s in core.runner.graph_names()] == ["prefill_s32"]
    prompts = [[5, 6, 7], list(range(100, 121)), [9] * 8]
    for p, out in zip(prompts, llm.embed(_ids(prompts), use_tqdm=False), strict=True):
        ref = F.normalize(_hidden(ref_model, p)[-1], dim=-1)
        assert (torch.tensor(out.outputs.embedding) - ref).abs().max().item() < TOL


def _encoder(tmp_path, kind: str):
    """(checkpoint dir, transformers BertModel / XLMRobertaModel) with seeded weights (norms perturbed from 1)."""
    import transformers

    common = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  architectures=["BertModel" if kind == "bert" else "XLMRobertaModel"])
    cfg = transformers.BertConfig(max_position_embeddings=64, pad_token_id=0, **common) if kind == "bert" else \
        transformers.XLMRobertaConfig(max_position_embeddings=66, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                      **common)
    torch.manual_seed(6)
    model = (transformers.BertModel if kind == "bert" else transformers.XLMRobertaModel)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape) if p.ndim == 1 else 0.05 * torch.randn(p.shape))
    return make_tiny_model(str(tmp_path / kind), "llama", model=model), model


ENCODER_PROMPTS = [[5, 6, 7], list(range(100, 140)), list(range(300, 330)), [9] * 64]  # 40 + 30 > one 64-token step
ENCODER_ENGINE = dict(max_model_len=64, max_num_batched_tokens=64)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_bidirectional_encoders_cls_and_mean_pooling(tmp_path, kind):
    path, ref_model = _encoder(tmp_path, kind)
    if kind == "bert":  # sentence-transformers files: CLS pooling, normalized (bge-small's modules)
        _write_json(path, "modules.json", [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}])
        _write_json(path, "1_Pooling/config.json", {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
        llm = tiny_llm(path, **ENCODER_ENGINE)
    else:
        llm = tiny_llm(path, **ENCODER_ENGINE, pooler_config={"pooling_type": "MEAN"})
    batched = llm.embed(_ids(ENCODER_PROMPTS), use_tqdm=False)
    for p, out in zip(ENCODER_PROMPTS, batched, strict=True):
        h = _hidden(ref_model, p)
        ref = F.normalize(h[0] if kind == "bert" else h.mean(0), dim=-1)
        assert (torch.tensor(out.outputs.embedding) - ref).abs().max().item() < TOL, f"prompt of {len(p)} tokens"
        alone = llm.embed(_ids([p]), use_tqdm=False)[0]
        assert (torch.tensor(alone.outputs.embedding) - ref).abs().max().item() < TOL
    with pytest.raises(ValueError, match="maximum context length"):
        llm.embed(_ids([[7] * 65]), use_tqdm=False)


def test_bidirectional_encoder_needs_whole_prompts_in_a_step(tmp_path):
    path, _ = _encoder(tmp_path, "bert")
    with pytest.raises(ValueError, match="max_num_batched_tokens=32 must be at least max_model_len=64"):
        tiny_llm(path, max_model_len=64, max_num_batched_tokens=32)


def test_compiled_encoder_matches_transformers(tmp_path):
    """The bidirectional family compiled: one 64-token prefill bucket, several prompts in one step (their
    attention kept apart by the per-row sequence mask inside the graph)."""
    path, ref_model = _encoder(tmp_path, "bert")
    llm = tiny_llm(path, enforce_eager=False, **ENCODER_ENGINE, pooler_config={"pooling_type": "MEAN"},
                   additional_config={"neuron_config": {"num_batched_tokens_buckets": [64]}})
    assert [s.name for s in llm.llm_engine.core.runner.graph_names()] == ["prefill_s64"]
    prompts = ENCODER_PROMPTS[:3]
    for p, out in zip(prompts, llm.embed(_ids(prompts), use_tqdm=False), strict=True):
        ref = F.normalize(_hidden(ref_model, p).mean(0), dim=-1)
        assert (torch.tensor(out.outputs.embedding) - ref).abs().max().item() < TOL, f"prompt of {len(p)} tokens"
