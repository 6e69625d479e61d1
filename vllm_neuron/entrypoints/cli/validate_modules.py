"""`vllm-neuron validate-logits --per-module`: where our forward first drifts from transformers, module by module.

Two runs of the engine on each prompt's prefill, both capturing the chosen modules' outputs
(neuron_config.tensor_capture):
1. as is: each module's accumulated difference from transformers fp32, beside transformers bf16's own
   difference from fp32 (the seeds' three-way comparison: what bf16 alone costs);
2. with every decoder layer's output replaced by transformers fp32's (neuron_config.tensor_replacement), so
   each layer (and its attention and MLP) starts from the reference input: its own, local difference.
Prompts with images or videos compare the vision tower's modules too (captured in the encoder graphs, rows put
back in the item's order); their difference is the accumulated one (vision outputs are not replaced).
The first module whose local difference exceeds the tolerance is where the drift starts.
Differences are max |ours - reference| over the prompt's positions, relative to max |reference|.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import tempfile
from dataclasses import dataclass

import torch

from vllm_neuron.config.tensor_debug import module_matcher

# Text models' names, a multimodal model's text tower's (model.language_model.*), and its vision tower's.
DEFAULT_MODULES = tuple(f"{p}{m}" for p in ("model.", "model.language_model.")
                        for m in ("embed_tokens", "layers.*", "layers.*.self_attn", "layers.*.mlp", "norm")) + \
    ("model.visual.patch_embed", "model.visual.blocks.*", "model.visual.merger", "model.visual.deepstack_merger_list.*")
_VISION = "model.visual."
_LAYER = re.compile(r"^(.*\.layers\.\d+)$")


@dataclass
class ModuleDiff:
    name: str
    ours: float  # accumulated: relative max |ours - transformers fp32|
    bf16_ref: float  # transformers bf16 against fp32
    local: float | None  # with the decoder layers' inputs taken from transformers fp32 (None: not measured)


def relative_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((a.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def reference_outputs(model: torch.nn.Module, ids: list[int], names: list[str],
                      extra: dict | None = None) -> dict[str, torch.Tensor]:
    """transformers' outputs of `names` (their first tensor) for one prompt (`extra`: its media inputs), by
    completion order: [positions, ...] for the text modules, [patches or merged tokens, ...] for the vision
    tower's."""
    got: dict[str, torch.Tensor] = {}
    mods = dict(model.named_modules())
    missing = [n for n in names if n not in mods]
    if missing:
        raise ValueError(f"--modules: {missing[0]!r} is not a module of transformers' model for this checkpoint")

    def hook(name):
        def run(module, args, output):
            out = output if isinstance(output, torch.Tensor) else next(o for o in output if isinstance(o, torch.Tensor))
            got[name] = (out[0] if out.dim() == 3 and out.shape[0] == 1 else out).detach()
        return run

    handles = [mods[n].register_forward_hook(hook(n)) for n in names]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]), **(extra or {}))
    finally:
        for h in handles:
            h.remove()
    return got


def read_captures(folder: str, req_id: str, media: list[str]) -> dict[str, torch.Tensor]:
    """A request's prefill captures, its chunks joined along the positions, and its media items' (hashes
    `media`, in prompt order) joined in that order."""
    from safetensors.torch import load_file

    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    with open(os.path.join(folder, "manifest.jsonl")) as f:
        entries = [json.loads(line) for line in f]
    files = {e["media"]: e["file"] for e in entries if "media" in e}
    for e in entries:
        if e.get("request") == req_id and e["kind"] == "prefill":
            for name, t in load_file(os.path.join(folder, e["file"])).items():
                parts.setdefault(name, []).append((e["positions"][0], t))
    for i, h in enumerate(media):
        for name, t in load_file(os.path.join(folder, files[h])).items():
            parts.setdefault(name, []).append((i, t))
    return {n: torch.cat([t for _, t in sorted(p, key=lambda x: x[0])]) for n, p in parts.items()}


def _with_neuron_options(engine_args, **options):
    from vllm_neuron.config.neuron_config import parse_additional_config

    add = parse_additional_config(engine_args.additional_config)
    nc = dataclasses.replace(add.neuron_config, **options)  # checked by NeuronConfig like the user's own
    return dataclasses.replace(engine_args, additional_config=dataclasses.replace(add, neuron_config=nc))


def _run(engine_args, prompts: list, capture_dir: str, names: list[str],
          replacement: str | None = None) -> tuple[list[tuple[list[int], list]], str]:
    """Each prompt's prefill through a fresh engine with `names` captured (and `replacement` applied): (each
    prompt's token ids and media items, the engine's dtype)."""
    from vllm_neuron.entrypoints.llm import LLM
    from vllm_neuron.sampling_params import SamplingParams

    options = {"tensor_capture": {"modules": names, "output_dir": capture_dir, "steps": [0], "max_captures": 10**6}}
    if replacement is not None:
        options["tensor_replacement"] = {"file": replacement}
    args = dataclasses.replace(_with_neuron_options(engine_args, **options), enable_prefix_caching=False)
    llm = LLM.from_engine_args(args)
    try:
        tokens = [llm.llm_engine.input_processor.tokenize_multimodal(p)[1:] for p in prompts]
        params = SamplingParams(temperature=0.0, max_tokens=1)
        llm._submit_and_run([(f"p{i}", p, params, 0) for i, p in enumerate(prompts)], False)
        return [(ids, items or []) for ids, items in tokens], llm.llm_engine.core.config.dtype
    finally:
        llm.llm_engine.shutdown()


def validate_modules(engine_args, reference_loader, prompts: list,
                     patterns: list[str]) -> tuple[list[list[ModuleDiff]], str]:
    """(per prompt each module's ModuleDiff in forward order, the engine's dtype). `reference_loader(dtype)`
    gives transformers' model of the checkpoint."""
    refs = {dt: reference_loader(dt) for dt in (torch.float32, torch.bfloat16)}
    named = [n for n, _ in refs[torch.float32].named_modules() if n]
    match = module_matcher(patterns)
    names = [n for n in named if match(n)]
    if not names:
        raise ValueError(f"--modules {patterns} match no module of transformers' model for this checkpoint")
    layers = [n for n in names if _LAYER.match(n)]
    with tempfile.TemporaryDirectory(prefix="vllm-neuron-modules-") as tmp:
        acc_dir, iso_dir = os.path.join(tmp, "accumulated"), os.path.join(tmp, "local")
        from vllm_neuron.entrypoints.cli.validate_logits import _hf_inputs

        tokens, dtype = _run(engine_args, prompts, acc_dir, names)
        extras = [_hf_inputs(ids, items) for ids, items in tokens]

        def media_inputs(extra: dict, dt: torch.dtype) -> dict:
            return {n: (v.to(dt) if v.is_floating_point() else v) for n, v in extra.items()}

        want = {dt: [reference_outputs(m, ids, names, media_inputs(x, dt)) for (ids, _), x in zip(tokens, extras)]
                for dt, m in refs.items()}
        names = list(want[torch.float32][0])  # the order the modules finish in: a layer after its attention and MLP
        replacement = None
        if layers:
            from safetensors.torch import save_file

            replacement = os.path.join(tmp, "reference.safetensors")
            save_file({f"p{i}/{n}": want[torch.float32][i][n].contiguous() for i in range(len(tokens))
                       for n in layers}, replacement)
            _run(engine_args, prompts, iso_dir, names, replacement)
        results = []
        for i, (_, items) in enumerate(tokens):
            media = [item.mm_hash for item in items]
            ours = read_captures(acc_dir, f"p{i}", media)
            local = {n: t for n, t in read_captures(iso_dir, f"p{i}", media).items()
                     if not n.startswith(_VISION)} if layers else {}
            fp32, bf16 = want[torch.float32][i], want[torch.bfloat16][i]
            results.append([ModuleDiff(n, relative_diff(ours[n], fp32[n]), relative_diff(bf16[n], fp32[n]),
                                       relative_diff(local[n], fp32[n]) if n in local else None) for n in names])
        return results, dtype


def first_divergence(diffs: list[ModuleDiff], tolerance: float, reduced_precision: bool) -> ModuleDiff | None:
    """The first module (forward order) whose own difference (its local one where measured, else its
    accumulated one) exceeds `tolerance`, and for an engine in bf16 / fp16 (`reduced_precision`) also twice
    what transformers bf16 itself differs by there. Pure."""
    for d in diffs:
        own = d.local if d.local is not None else d.ours
        if own > max(tolerance, 2 * d.bf16_ref if reduced_precision else 0.0):
            return d
    return None


def run_per_module(args: argparse.Namespace, engine_args, reference_loader, texts: list[str], prompts: list) -> int:
    patterns = args.modules or list(DEFAULT_MODULES)
    worst = 0
    results, dtype = validate_modules(engine_args, reference_loader, prompts, patterns)
    for text, diffs in zip(texts, results):
        print(f"\n>>> {text!r}: relative max |difference| from transformers fp32, per module (engine {dtype})")
        print(f"{'module':<40} {'ours':>10} {'hf bf16':>10} {'ours local':>11}")
        for d in diffs:
            local = "-" if d.local is None else f"{d.local:.3e}"
            print(f"{d.name:<40} {d.ours:>10.3e} {d.bf16_ref:>10.3e} {local:>11}")
        first = first_divergence(diffs, args.module_tolerance, dtype != "float32")
        if first is None:
            print(f"no module differs beyond {args.module_tolerance:g}")
        else:
            worst = 1
            print(f"first divergence: {first.name} (local {first.local if first.local is not None else first.ours:.3e}"
                  f" > {args.module_tolerance:g})")
    return worst if args.fail_above is not None else 0
