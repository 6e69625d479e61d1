"""LoRA's pure parts: option parsing, PEFT folder checks, the slot table and host LRU, prefix-cache keys, the
scheduler's adapter limit, the gathered delta and the server's adapter registry (no engine)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.model_factory import build_tiny_llama, make_peft_adapter
from vllm_neuron.config.compatibility import Features, check
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.config.lora import LoRAModulePath, check_lora_options, parse_lora_modules
from vllm_neuron.core.block_hash import prompt_block_hashes
from vllm_neuron.core.request import Request
from vllm_neuron.core.scheduler import Scheduler, SchedulerConfig
from vllm_neuron.entrypoints.openai.errors import BadRequestError, NotFoundError
from vllm_neuron.entrypoints.openai.serving_models import OpenAIServingModels
from vllm_neuron.lora.peft_adapter import AdapterChecker, BaseShapes, inspect_adapter, load_adapter
from vllm_neuron.lora.request import LoRARequest
from vllm_neuron.model.layers.linear import Linear
from vllm_neuron.model.layers.lora import LoRASlots
from vllm_neuron.sampling_params import SamplingParams
from vllm_neuron.worker.lora.host_cache import HostLRU
from vllm_neuron.worker.lora.slots import SlotTable


# -- options -----------------------------------------------------------------------------------------
def test_lora_modules_both_forms():
    mods = parse_lora_modules(["a=/x/a", '{"name": "b", "path": "/x/b", "base_model_name": "base"}',
                               {"name": "c", "path": "/x/c"}])
    assert mods == (LoRAModulePath("a", "/x/a"), LoRAModulePath("b", "/x/b", "base"), LoRAModulePath("c", "/x/c"))


@pytest.mark.parametrize("bad, words", [
    (["nopath"], "name=path"), (['{"name": "a"}'], "path must be"), (['{"name": "a", "path": "/p", "x": 1}'],
                                                                     "unknown keys"),
    (["a=/p", "a=/q"], "unique"), (['{"name": '], "not valid JSON"),
])
def test_lora_modules_refused(bad, words):
    with pytest.raises(ValueError, match=words):
        parse_lora_modules(bad)


def test_lora_option_checks():
    assert check_lora_options(False, None, 1, 16, None) == (None, ())
    cfg, _ = check_lora_options(True, None, 3, 8, None)
    assert (cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras) == (3, 8, 3)
    with pytest.raises(ValueError, match="max_cpu_loras=1 must be at least max_loras=2"):
        check_lora_options(True, None, 2, 16, 1)
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        EngineArgs.from_kwargs(lora_modules=["a=/p"])
    with pytest.raises(ValueError, match=r"max_lora_rank must be an integer in \[1, 512\], got 1024"):
        EngineArgs.from_kwargs(enable_lora=True, max_lora_rank=1024)


def test_lora_refused_with_moe_and_draft_models():
    with pytest.raises(ValueError, match="mixture-of-experts"):
        check(Features(moe=True, lora=True))
    with pytest.raises(ValueError, match="use method 'ngram'"):
        check(Features(moe=False, lora=True, speculative="eagle3"))
    check(Features(moe=False, lora=True, speculative="ngram"))  # n-gram drafts come from the request's tokens


# -- PEFT folders ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base():
    return build_tiny_llama()


@pytest.fixture(scope="module")
def shapes(base) -> BaseShapes:
    return BaseShapes.from_hf_config(base.config)


@pytest.fixture(scope="module")
def good(base, tmp_path_factory) -> str:
    return make_peft_adapter(str(tmp_path_factory.mktemp("good")), base, r=8, lora_alpha=4.0, use_rslora=True)


def _copy_with(src: str, dst: str, **config) -> str:
    os.makedirs(dst)
    with open(os.path.join(src, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg.update(config)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    os.link(os.path.join(src, "adapter_model.safetensors"), os.path.join(dst, "adapter_model.safetensors"))
    return dst


def test_adapter_loads_with_rslora_scaling(good, shapes):
    w = load_adapter(good, shapes, max_rank=16)
    assert w.info.rank == 8 and w.info.scaling == pytest.approx(4.0 / 8 ** 0.5)
    assert len(w.info.modules) == 2 * 7  # two layers, every projection
    a, b = w.weights[(0, "k_proj")]
    assert a.shape == (8, 64) and b.shape == (32, 8)


@pytest.mark.parametrize("change, words", [
    (dict(r=32), "rank r=32 is above max_lora_rank=16"),
    (dict(target_modules=["q_proj", "fc1"]), "target module 'fc1' is not in the base model"),
    (dict(target_modules=["lm_head"]), "target module 'lm_head' is not supported"),
    (dict(use_dora=True), "DoRA"),
    (dict(peft_type="IA3"), "not a LoRA adapter"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
])
def test_adapter_config_refused(good, shapes, tmp_path, change, words):
    bad = _copy_with(good, str(tmp_path / "bad"), **change)
    with pytest.raises(ValueError, match=words):
        inspect_adapter(bad, shapes, max_rank=16)


def test_adapter_files_refused(good, shapes, tmp_path):
    with pytest.raises(ValueError, match="not an existing folder"):
        inspect_adapter(str(tmp_path / "missing"), shapes, 16)
    (tmp_path / "nojson").mkdir()
    (tmp_path / "nojson" / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        inspect_adapter(str(tmp_path / "nojson"), shapes, 16)
    garbage = _copy_with(good, str(tmp_path / "garbage"))
    os.remove(os.path.join(garbage, "adapter_model.safetensors"))
    with open(os.path.join(garbage, "adapter_model.safetensors"), "wb") as f:
        f.write(b"\x00" * 64)
    with pytest.raises(ValueError, match="cannot be read"):
        inspect_adapter(garbage, shapes, 16)


def test_adapter_shape_mismatch_names_tensor(base, tmp_path):
    other = BaseShapes.from_hf_config(build_tiny_llama(hidden_size=32, intermediate_size=64).config)
    path = make_peft_adapter(str(tmp_path / "a"), base, r=4)
    with pytest.raises(ValueError, match=r"tensor 'base_model\.model\.model\.layers\.0\..*' has shape"):
        inspect_adapter(path, other, 16)
    fewer = BaseShapes(1, BaseShapes.from_hf_config(base.config).shapes)
    with pytest.raises(ValueError, match="adapts layer 1, but the base model has 1 layers"):
        inspect_adapter(path, fewer, 16)


# -- slots, host LRU ----------------------------------------------------------------------------------
def test_slot_table_keeps_held_slots_and_evicts_lru():
    t = SlotTable(2)
    assert t.acquire(10) == (1, True)
    assert t.acquire(20) == (2, True)
    assert t.acquire(10) == (1, False)  # resident: no write
    with pytest.raises(RuntimeError, match="held by running requests"):
        t.acquire(30)  # both held
    t.release(20)
    t.release(10)
    t.release(10)
    assert t.acquire(30) == (2, True)  # 20 went idle first
    assert t.acquire(10) == (1, False)  # still resident
    with pytest.raises(KeyError):
        t.release(20)


def test_host_lru_loads_once_and_drops_oldest():
    loaded = []
    lru = HostLRU(2, lambda k: loaded.append(k) or k * 10)
    assert [lru.get(1), lru.get(2), lru.get(1), lru.get(3)] == [10, 20, 10, 30]
    assert lru.keys() == [1, 3] and loaded == [1, 2, 3]
    lru.get(2)
    assert loaded == [1, 2, 3, 2]


# -- prefix cache, scheduler -------------------------------------------------------------------------
def test_prefix_hashes_keyed_by_adapter():
    tokens = list(range(64))
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    base = prompt_block_hashes(tokens, 16)
    ha = prompt_block_hashes(tokens, 16, a.cache_key())
    hb = prompt_block_hashes(tokens, 16, b.cache_key())
    assert not set(base) & set(ha) and not set(ha) & set(hb)
    assert ha == prompt_block_hashes(tokens, 16, LoRARequest("a", 1, "/a").cache_key())


def test_scheduler_holds_at_most_max_loras_adapters():
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256, block_size=16,
                                  num_blocks=64, max_loras=2))
    loras = [LoRARequest(n, i, f"/{n}") for i, n in enumerate("abc", 1)]
    for i, lr in enumerate([loras[0], None, loras[1], loras[2], loras[0]]):
        s.add_request(Request(f"r{i}", [5] * 8, SamplingParams(max_tokens=4), lora_request=lr))
    out = s.schedule()
    assert [c.req_id for c in out.chunks] == ["r0", "r1", "r2", "r4"]  # r3 (adapter c) is one too many
    assert {n.lora_request.lora_name for n in out.new_requests if n.lora_request} == {"a", "b"}
    assert s.lora_names() == (["a", "b"], ["c"])
    s.finish_request("r2")  # b's last holder ends: c may start
    out = s.schedule()
    assert "r3" in [c.req_id for c in out.chunks]


# -- the delta ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [2, 9])  # fewer rows than slots: gathered bmm; more: masked dense matmuls
def test_lora_delta_matches_per_row_reference(rows):
    g = torch.Generator().manual_seed(0)
    slots = LoRASlots(4, 4, 16, (8, 4), torch.float32, torch.device("cpu"))
    adapters = {s: [(torch.randn(3, 16, generator=g), torch.randn(8, 3, generator=g)),
                    (torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)) if s != 2 else None]
                for s in (1, 2, 3)}
    for s, parts in adapters.items():
        slots.write(s, parts)
    x = torch.randn(rows, 16, generator=g)
    index = torch.arange(rows) % 4
    out = slots(x, index)
    for i in range(rows):
        s = int(index[i])
        want = torch.zeros(12)
        if s:
            for j, part in enumerate(adapters[s]):
                if part is not None:
                    a, b = part
                    want[(0, 8)[j]:(8, 12)[j]] = b @ (a @ x[i])
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-5)


def test_quantized_linear_adds_delta_in_compute_dtype():
    torch.manual_seed(0)
    lin = Linear(32, 16, bias=False)
    lin.quantize_("int8")
    base = lin(torch.ones(3, 32))
    lin.lora = LoRASlots(2, 2, 32, (16,), torch.float32, torch.device("cpu"))
    a, b = torch.randn(2, 32), torch.randn(16, 2)
    lin.lora.write(1, [(a, b)])
    x = torch.ones(3, 32)
    out = lin(x, torch.tensor([0, 1, 0]))
    torch.testing.assert_close(out[0], base[0])
    torch.testing.assert_close(out[1], base[1] + b @ (a @ x[1]), rtol=1e-5, atol=1e-5)


# -- the server's registry -----------------------------------------------------------------------------
def test_serving_models_registry(good, shapes, tmp_path):
    checker = AdapterChecker(shapes, 16)
    models = OpenAIServingModels(["base"], "/m", 256, [LoRAModulePath("a", good)], checker)
    assert models.resolve("a") == "a" and models.lora_request("a").lora_path == good
    assert models.lora_request("base") is None
    cards = {c.id: c for c in models.list_models().data}
    assert cards["a"].parent == "base" and cards["a"].root == good
    with pytest.raises(BadRequestError, match="already been loaded"):
        models.load_lora_adapter({"lora_name": "a", "lora_path": good})
    with pytest.raises(BadRequestError, match="rank r=32"):
        models.load_lora_adapter({"lora_name": "big", "lora_path": _copy_with(good, str(tmp_path / "big"), r=32)})
    assert models.load_lora_adapter({"lora_name": "b", "lora_path": good}).startswith("Success")
    assert models.lora_request("b").lora_int_id != models.lora_request("a").lora_int_id
    models.unload_lora_adapter({"lora_name": "b"})
    with pytest.raises(NotFoundError):
        models.resolve("b")
    with pytest.raises(NotFoundError, match="cannot be found"):
        models.unload_lora_adapter({"lora_name": "b"})
    with pytest.raises(ValueError, match="rank r=32"):  # a bad --lora-modules entry stops the start
        OpenAIServingModels(["base"], "/m", 256, [LoRAModulePath("x", str(tmp_path / "big"))],
                            AdapterChecker(shapes, 16))
