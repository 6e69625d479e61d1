"""int4 / int8 weights with int8 activations (neuron_config.int8_activations, on by default where the kernels
are built) in the engine, fp32: every int4 linear (one row included: its tile copy replaced the bands) and every
int8 linear of two rows and more computes the W4A8 / W8A8 reference of its own inputs (not the full-precision
product), and for int4 compiled graphs give eager's greedy tokens and the engine's log-probabilities stay near a
transformers model whose linears compute W4A8.

Token equality with transformers is not asked: the int8 rounding is discontinuous, so the last-bit
differences between our attention and transformers' flip a few codes, which moves near-tied logits of a
random tiny model (measured: a first token 0.006 ahead in the reference came second in the engine)."""
from __future__ import annotations

import pytest
import torch

from tests.model_factory import build_tiny_llama, hf_greedy_reference, make_tiny_llama
from vllm_neuron import LLM, SamplingParams
from vllm_neuron.model.layers import quant_int4, quant_int8
from vllm_neuron.model.layers.kernels import cpu_caps
from vllm_neuron.model.layers.kernels.ops import has_op

pytestmark = [pytest.mark.engine, pytest.mark.skipif(
    not (cpu_caps.kernels_enabled(torch.device("cpu")) and has_op("linear_int4_tiles")),
    reason="the W4A8 kernel is built for CPUs with AVX512-VNNI only")]

MAX_NEW = 8
PROMPTS = [[(7 * i + 3 * j) % 4000 + 10 for j in range(n)] for i, n in enumerate([5, 12, 40, 70])]
CFG = dict(max_position_embeddings=256)


def _reference(int8_activations: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
    hf = build_tiny_llama(**CFG)
    for module in hf.modules():
        if isinstance(module, torch.nn.Linear):
            q, s = quant_int4.quantize(module.weight)
            deq = quant_int4.dequantize(q, s, torch.float32)
            tiles = quant_int4.to_tiles(q, s) if int8_activations and module.out_features % 16 == 0 else None

            def forward(x, deq=deq, tiles=tiles):
                rows = x.reshape(-1, x.shape[-1])
                if tiles is not None:
                    y = quant_int4.linear_w4a8_reference(rows, *tiles).float()
                else:
                    y = rows @ deq.T
                return y.reshape(*x.shape[:-1], -1)
            module.forward = forward
    return hf_greedy_reference(hf, PROMPTS, MAX_NEW)


def _engine(model_dir: str, eager: bool, scheme: str = "int4") -> LLM:
    return LLM(model_dir, max_model_len=256, max_num_seqs=1, max_num_batched_tokens=64, block_size=16,
               dtype="float32", device="cpu", num_gpu_blocks_override=64, enforce_eager=eager,
               additional_config={"neuron_config": {"quantization": scheme, "num_batched_tokens_buckets": [64],
                                                    "num_seqs_buckets": [1]}})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("w4a8_llama")), **CFG)


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_each_linear_computes_int8_activations_of_its_inputs(model_dir, scheme, tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "cache"))
    llm = _engine(model_dir, eager=True, scheme=scheme)
    mod_q = {"int4": quant_int4, "int8": quant_int8}[scheme]
    reference = {"int4": quant_int4.linear_w4a8_reference, "int8": quant_int8.linear_w8a8_reference}[scheme]
    model = llm.llm_engine.core.runner.model
    calls = []

    def check(mod, inputs, out):
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        rows = min(x.shape[0], 8)  # the prompt's rows (the rest pad the bucket), or the one decode row
        if scheme == "int4":  # every row count
            ref = reference(x[:rows], mod.qtiles, mod.qtile_extra)
            full = x[:rows].double() @ mod_q.dequantize_tiles(mod.qtiles, mod.qtile_extra, torch.float64).T
        elif x.shape[0] >= quant_int8.TILE_ROWS_FROM:
            ref = reference(x[:rows], mod.qweight, mod.qscale)
            full = x[:rows].double() @ mod_q.dequantize(mod.qweight, mod.qscale, torch.float64).T
        else:
            return
        got = out.reshape(-1, out.shape[-1])[:rows].double()
        calls.append((x.shape[0], (got - ref).abs().max().item(), (got - full).abs().max().item()))

    handles = [m.register_forward_hook(check) for m in model.modules() if hasattr(m, "qtiles")]
    assert len(handles) >= 4 * len(model.model.layers) // 2  # qkv, o, gate_up, down of each layer
    llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    assert calls and max(c[1] for c in calls) < 1e-4
    assert max(c[2] for c in calls) > 100 * max(c[1] for c in calls)  # not the full-precision product
    assert (1 in {c[0] for c in calls}) == (scheme == "int4")  # the decode step's one row: int4's tiles only


def test_compiled_gives_eager_tokens_and_logprobs_near_transformers_w4a8(model_dir, tmp_path, monkeypatch):
    (_, lp8), (_, lp16) = _reference(True), _reference(False)
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "cache"))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=20)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    eager = _engine(model_dir, eager=True).generate(prompts, params, use_tqdm=False)
    compiled = _engine(model_dir, eager=False).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in compiled] == [o.outputs[0].token_ids for o in eager]
    off8, off16 = [], []
    for o, r8, r16 in zip(eager, lp8, lp16):
        for step, entries in enumerate(o.outputs[0].logprobs[:1]):  # the prompt's step: the same context
            for token, lp in entries.items():
                off8.append(abs(lp.logprob - r8[step, token].item()))
                off16.append(abs(lp.logprob - r16[step, token].item()))
    # flipped codes move single log-probabilities by up to ~0.03 here; W4A16 sits more than twice as far overall
    assert max(off8) < 0.06 and sum(off8) < sum(off16) / 2, (max(off8), sum(off8), sum(off16))


def test_int8_activations_refused_without_int4_or_int8():
    with pytest.raises(ValueError, match="int8_activations=True applies to int4 and int8 weights only"):
        LLM("unused", additional_config={"neuron_config": {"int8_activations": True}})
    with pytest.raises(ValueError, match="int8_activations"):
        LLM("unused", additional_config={"neuron_config": {"quantization": "int4", "int8_activations": "yes"}})


def test_int8_activations_refused_where_the_kernel_does_not_apply(model_dir):
    with pytest.raises(ValueError, match="int8_activations=True needs the int8-activation kernels"):
        LLM(model_dir, max_model_len=256, dtype="float16", device="cpu", enforce_eager=True,
            additional_config={"neuron_config": {"quantization": "int4", "int8_activations": True}})
