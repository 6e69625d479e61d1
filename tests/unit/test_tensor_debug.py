"""Tensor capture / replacement's pure parts: the options, where a step's rows sit, the module taps on a toy
model, the replacement file's checks, and validate-logits --per-module's first-divergence rule."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from vllm_neuron.config.neuron_config import NeuronConfig
from vllm_neuron.config.tensor_debug import TensorCaptureConfig, TensorReplacementConfig
from vllm_neuron.entrypoints.cli.validate_modules import ModuleDiff, first_divergence
from vllm_neuron.worker.module_taps import ModuleTaps, match_modules
from vllm_neuron.worker.tensor_debug import RowSpan, TensorDebug, load_replacements, step_rows


def _chunk(req, start, n):
    return SimpleNamespace(req_id=req, start_pos=start, token_ids=list(range(n)))


def test_step_rows_prefill_decode_and_verify():
    chunks = [_chunk("a", 0, 5), _chunk("b", 7, 3)]
    assert step_rows(chunks, None) == [RowSpan("a", 0, 0, 5), RowSpan("b", 5, 7, 3)]
    dec = [_chunk("a", 9, 1), _chunk("b", 4, 1)]
    assert step_rows(dec, 1) == [RowSpan("a", 0, 9, 1), RowSpan("b", 1, 4, 1)]
    ver = [_chunk("a", 9, 3), _chunk("b", 4, 1)]  # a has 2 drafts, b none; 1 + K = 3 rows each
    assert step_rows(ver, 3) == [RowSpan("a", 0, 9, 3), RowSpan("b", 3, 4, 1)]


def test_options_are_checked_where_they_enter(tmp_path):
    cfg = NeuronConfig.from_dict({"tensor_capture": {"modules": ["model.layers.0"], "steps": [0, 2],
                                                     "capture_inputs": True}}).tensor_capture
    assert cfg == TensorCaptureConfig(("model.layers.0",), True, None, (0, 2))
    with pytest.raises(ValueError, match="unknown neuron_config.tensor_capture option 'module'.*modules"):
        NeuronConfig.from_dict({"tensor_capture": {"module": ["x"]}})
    with pytest.raises(ValueError, match="modules must be a non-empty list of strings"):
        NeuronConfig.from_dict({"tensor_capture": {"modules": "model.layers.0"}})
    with pytest.raises(ValueError, match="steps"):
        NeuronConfig.from_dict({"tensor_capture": {"modules": ["a"], "steps": [-1]}})
    with pytest.raises(ValueError, match="tensor_replacement.file .* does not exist"):
        NeuronConfig.from_dict({"tensor_replacement": {"file": str(tmp_path / "nope.safetensors")}})
    with pytest.raises(ValueError, match="must be an object"):
        NeuronConfig.from_dict({"tensor_replacement": "x.safetensors"})


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_patterns_match_in_model_order_and_a_miss_names_what_exists():
    m = Toy()
    assert match_modules(m, ["layers.2", "layers.*"], "opt") == ["layers.0", "layers.1", "layers.2"]
    assert match_modules(m, ["*"], "opt") == ["layers"]  # a * never crosses a dot
    with pytest.raises(ValueError, match=r"opt: 'layer.0' matches no module of this model; modules include: "
                                         r"layers, layers.0"):
        match_modules(m, ["layer.0"], "opt")


def test_taps_record_outputs_and_replace_masked_rows():
    torch.manual_seed(0)
    m = Toy()
    x = torch.randn(3, 4)
    taps = ModuleTaps(m, TensorCaptureConfig(("layers.0", "layers.1"), capture_inputs=True), ["layers.0"])
    with taps.probing():
        m(x)
    assert taps.shapes["layers.0"] == ((4,), torch.float32)
    taps.tables.add("layers.0", 8, (4,), torch.float32, torch.device("cpu"))
    with taps.recording() as rec:
        plain = m(x)
    assert set(rec) == {"layers.0", "layers.0.input", "layers.1", "layers.1.input"}
    assert torch.equal(rec["layers.0.input"], x)
    assert torch.allclose(rec["layers.1"], m.layers[1](torch.tanh(rec["layers.0"])))
    # Row 1 replaced: layer 1 sees the table's row there, the other rows as computed.
    table, mask = taps.tables.table("layers.0"), taps.tables.mask("layers.0")
    table[1] = 5.0
    mask[1] = True
    with taps.recording() as rec2:
        out = m(x)
    assert torch.allclose(rec2["layers.0"], rec["layers.0"])  # the capture sees the module's own output
    assert torch.allclose(rec2["layers.1.input"][1], torch.tanh(torch.full((4,), 5.0)))
    assert torch.allclose(out[[0, 2]], plain[[0, 2]]) and not torch.allclose(out[1], plain[1])
    taps.remove()
    assert torch.allclose(m(x), plain)


def test_replacement_file_checks_and_per_request_tensors(tmp_path):
    f = str(tmp_path / "r.safetensors")
    save_file({"layers.0": torch.ones(6, 4), "r1/layers.0": torch.zeros(6, 4), "ints": torch.ones(2, 2, dtype=torch.int32)},
              f)
    with pytest.raises(ValueError, match="'ints' .* floating-point"):
        load_replacements(TensorReplacementConfig(f))
    got = load_replacements(TensorReplacementConfig(f, modules=("layers.0",)))
    assert set(got["layers.0"]) == {None, "r1"}
    with pytest.raises(ValueError, match="has no tensor for 'layers.1'"):
        load_replacements(TensorReplacementConfig(f, modules=("layers.1",)))
    m = Toy()
    dbg = TensorDebug(m, None, TensorReplacementConfig(f, modules=("layers.0",)), 16, torch.device("cpu"))
    dbg.prepare(lambda: m(torch.randn(2, 4)))
    # Request r1 takes its own tensor, others the shared one, from their positions on.
    dbg.begin([_chunk("r0", 2, 3), _chunk("r1", 0, 2)], None)
    table, mask = dbg.taps.tables.table("layers.0"), dbg.taps.tables.mask("layers.0")
    assert mask[:5].tolist() == [True] * 5 and not mask[5:].any()
    assert torch.equal(table[:3], torch.ones(3, 4)) and torch.equal(table[3:5], torch.zeros(2, 4))
    bad = str(tmp_path / "bad.safetensors")
    save_file({"layers.0": torch.ones(6, 5)}, bad)
    dbg = TensorDebug(m, None, TensorReplacementConfig(bad), 16, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"'layers.0' in .* is \[6, 5\]; the module's output is \[positions, 4\]"):
        dbg.prepare(lambda: m(torch.randn(2, 4)))


def test_capture_writes_each_selected_request_step(tmp_path):
    m = Toy()
    dbg = TensorDebug(m, TensorCaptureConfig(("layers.1",), requests=("a",), steps=(1,), output_dir=str(tmp_path)),
                      None, 8, torch.device("cpu"))
    for step in range(3):
        dbg.begin([_chunk("a", step, 1), _chunk("b", step, 1)], 1)
        with dbg.taps.recording() as rec:
            m(torch.randn(2, 4))
        dbg.end("decode", "decode_b2", rec)
    lines = (tmp_path / "manifest.jsonl").read_text().splitlines()
    assert len(lines) == 1 and '"request": "a"' in lines[0] and '"step": 1' in lines[0]
    assert (tmp_path / "a" / "step_0001.safetensors").exists()


def test_first_divergence_prefers_the_local_difference():
    diffs = [ModuleDiff("model.layers.0", 1e-6, 1e-3, 1e-6), ModuleDiff("model.layers.1", 5e-3, 1e-3, 1e-6),
             ModuleDiff("model.layers.2", 6e-3, 1e-3, 4e-3), ModuleDiff("model.norm", 1e-2, 1e-3, None)]
    # Layer 1's accumulated difference is inherited (its own, local one is small); layer 2's is its own.
    assert first_divergence(diffs, 1e-4, False).name == "model.layers.2"
    assert first_divergence(diffs[:2], 1e-4, False) is None
    assert first_divergence([ModuleDiff("x", 1e-3, 0.0, None)], 1e-4, False).name == "x"
    # A bf16 engine is allowed twice what bf16 itself costs transformers there.
    near = [ModuleDiff("x", 1.5e-3, 1e-3, 1.5e-3)]
    assert first_divergence(near, 1e-4, True) is None and first_divergence(near, 1e-4, False).name == "x"
    assert first_divergence(diffs, 1e-4, True).name == "model.layers.2"


def test_vision_tower_outputs_are_captured_but_not_replaced(tmp_path):
    m = nn.Module()
    m.model = nn.Module()
    m.model.visual = Toy()
    m.model.language_model = Toy()
    dbg = TensorDebug(m, TensorCaptureConfig(("model.*.layers.0",), output_dir=str(tmp_path)), None, 8,
                      torch.device("cpu"))
    assert dbg.taps.captured_names == ["model.visual.layers.0", "model.language_model.layers.0"]
    f = str(tmp_path / "r.safetensors")
    save_file({"model.visual.layers.0": torch.ones(4, 4)}, f)
    with pytest.raises(ValueError, match="'model.visual.layers.0' is in the vision tower, whose outputs cannot be "
                                         "replaced yet"):
        TensorDebug(m, None, TensorReplacementConfig(f), 8, torch.device("cpu"))


def test_media_captures_are_put_back_in_each_items_order(tmp_path):
    dbg = TensorDebug(Toy(), TensorCaptureConfig(("layers.0",), output_dir=str(tmp_path)), None, 8,
                      torch.device("cpu"))
    # Two items of 4 and 8 patches (merge unit 4) packed in a bucket of 16 rows: the second item first.
    items = [SimpleNamespace(grid_thw=(1, 2, 2), num_tokens=1, mm_hash="aa"),
             SimpleNamespace(grid_thw=(1, 2, 4), num_tokens=2, mm_hash="bb")]
    patch_rows = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7])
    token_rows = torch.tensor([2, 0, 1])
    by_patch = torch.arange(16.0)[:, None]
    by_token = torch.arange(4.0)[:, None] + 100
    dbg.write_media("encoder_p16", 16, items, {"blocks": by_patch, "merger": by_token}, patch_rows, token_rows)
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "media" / "aa.safetensors")), load_file(str(tmp_path / "media" / "bb.safetensors"))
    assert a["blocks"][:, 0].tolist() == [8, 9, 10, 11] and a["merger"][:, 0].tolist() == [102]
    assert b["blocks"][:, 0].tolist() == list(range(8)) and b["merger"][:, 0].tolist() == [100, 101]
