"""`vllm-neuron validate-logits`: the onboarding guide's logit validation as a user tool.

Our engine's log-probabilities against transformers' fp32 and bf16 on the same prompts (text, or text
with images / videos for a multimodal model): transformers' fp32 greedy continuation fixes the tokens,
every position is teacher-forced (the prompt plus the reference tokens so far, one engine request per
position, sharing the prefix cache), and each position prints the largest absolute difference of our
top-k log-probabilities from the reference's and the overlap of the two top-k sets. Works for every
architecture transformers loads from the checkpoint (HF folders and GGUF files).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PositionStats:
    max_abs_diff: float  # over our top-k tokens, |ours - reference| log-probability
    topk_agreement: float  # |our top-k & reference top-k| / k
    top1_match: bool


def compare_position(ours: dict[int, float], ref_logprobs: torch.Tensor, k: int) -> PositionStats:
    """`ours`: token -> log-probability of our top-k; `ref_logprobs`: the reference's log-softmax [vocab]."""
    ref_top = ref_logprobs.topk(k).indices.tolist()
    top = sorted(ours, key=lambda t: -ours[t])[:k]
    diff = max(abs(ours[t] - float(ref_logprobs[t])) for t in top)
    return PositionStats(diff, len(set(top) & set(ref_top)) / k, top[0] == ref_top[0])


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Validation")
    g.add_argument("--prompt", action="append", default=None,
                   help="prompt text, repeatable (default: one short English sentence)")
    g.add_argument("--image", action="append", default=[],
                   help="image path or URL, repeatable; each prompt becomes a chat message with the images first")
    g.add_argument("--video", action="append", default=[], help="video path or URL, repeatable (like --image)")
    g.add_argument("--max-tokens", type=int, default=8, help="positions compared after each prompt")
    g.add_argument("--logprobs-k", type=int, default=5, help="top-k compared per position")
    g.add_argument("--fail-above", type=float, default=None,
                   help="exit 1 when any difference from fp32 exceeds this (default: report only); with "
                        "--per-module: exit 1 when a module diverges")
    g.add_argument("--per-module", action="store_true",
                   help="instead of the logits: each module's output against transformers' (captured inside the "
                        "engine's graphs), accumulated and with every decoder layer fed transformers' input, and "
                        "the first module that diverges (text prompts)")
    g.add_argument("--modules", action="append", default=None, metavar="PATTERN",
                   help="--per-module: module name patterns, repeatable (default: embed_tokens, every decoder "
                        "layer and its self_attn and mlp, the final norm)")
    g.add_argument("--module-tolerance", type=float, default=1e-4,
                   help="--per-module: relative difference above which a module diverges (and above twice "
                        "transformers bf16's own)")


def _reference(path: str, gguf_file: str | None, multimodal: bool, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    return cls.from_pretrained(path, dtype=dtype, local_files_only=True, **kw).eval()


def _hf_inputs(ids: list[int], items: list | None) -> dict:
    """transformers' multimodal inputs for our processed items (the same pixels and expanded ids)."""
    out: dict = {}
    if not items:
        return out
    types = [0] * len(ids)
    for kind, code in (("image", 1), ("video", 2)):
        mine = [i for i in items if i.modality == kind]
        for item in mine:
            for p in item.token_positions():
                types[p] = code
        if mine:
            px = "pixel_values" if kind == "image" else "pixel_values_videos"
            out[px] = torch.from_numpy(np.concatenate([i.pixel_values for i in mine]))
            out[f"{kind}_grid_thw"] = torch.tensor([i.grid_thw for i in mine])
    out["mm_token_type_ids"] = torch.tensor([types])
    return out


def validate(llm, prompts: list, max_tokens: int, k: int) -> list[dict]:
    """Per prompt: {"tokens": reference tokens, "fp32": [PositionStats], "bf16": [PositionStats]}."""
    from vllm_neuron.sampling_params import SamplingParams

    engine = llm.llm_engine
    ckpt = engine.checkpoint
    multimodal = engine.input_processor.mm_processor is not None
    gguf = ckpt.gguf_file
    path = ckpt.path if gguf is None else os.path.dirname(gguf)
    refs = {dt: _reference(path, gguf and os.path.basename(gguf), multimodal, dt) for dt in (torch.float32, torch.bfloat16)}
    results = []
    for prompt in prompts:
        _, ids, items = engine.input_processor.tokenize_multimodal(prompt)
        extra = _hf_inputs(ids, items)
        with torch.no_grad():
            gen = refs[torch.float32].generate(torch.tensor([ids]), max_new_tokens=max_tokens,
                                               min_new_tokens=max_tokens, do_sample=False, **extra)
        ref_tokens = gen[0, len(ids):].tolist()
        full = torch.tensor([ids + ref_tokens[:-1]])
        if "mm_token_type_ids" in extra:  # generated tokens are text
            extra["mm_token_type_ids"] = torch.nn.functional.pad(extra["mm_token_type_ids"], (0, max_tokens - 1))
        logprobs = {}
        for dt, model in refs.items():
            with torch.no_grad():
                px = {n: (v.to(dt) if v.is_floating_point() else v) for n, v in extra.items()}
                logits = model(full, **px).logits[0, len(ids) - 1:].float()
            logprobs[dt] = torch.log_softmax(logits, -1)
        forced = [{"prompt_token_ids": ids + ref_tokens[:i], **({"multi_modal_items": items} if items else {})}
                  for i in range(max_tokens)]
        outs = llm.generate(forced, SamplingParams(temperature=0.0, max_tokens=1, logprobs=k), use_tqdm=False)
        ours = [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]
        results.append({"tokens": ref_tokens, **{name: [compare_position(o, logprobs[dt][i], k)
                                                          for i, o in enumerate(ours)]
                                                   for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))}})
    return results


def run_validate_logits(args: argparse.Namespace) -> int:
    from vllm_neuron.config.arg_utils import engine_args_from_cli
    from vllm_neuron.entrypoints.llm import LLM
    from vllm_neuron.model.loader.checkpoint import load_checkpoint
    from vllm_neuron.model.loader.tokenizer import load_tokenizer

    engine_args = engine_args_from_cli(args)
    if engine_args.data_parallel_size > 1:
        raise ValueError(f"validate-logits runs one in-process engine; --data-parallel-size must be 1, got "
                         f"{engine_args.data_parallel_size}")
    ckpt = load_checkpoint(engine_args.model)
    texts = args.prompt or ["The capital of France is"]
    prompts = _prompts(load_tokenizer(engine_args.tokenizer or ckpt, engine_args.chat_template), texts, args)
    if args.per_module:
        from vllm_neuron.entrypoints.cli.validate_modules import run_per_module

        gguf = ckpt.gguf_file
        path = ckpt.path if gguf is None else os.path.dirname(gguf)
        multimodal = hasattr(ckpt.hf_config, "vision_config")
        return run_per_module(args, engine_args, lambda dt: _reference(path, gguf and os.path.basename(gguf),
                                                                       multimodal, dt), texts, prompts)
    llm = LLM.from_engine_args(engine_args)
    worst = 0.0
    for text, r in zip(texts, validate(llm, prompts, args.max_tokens, args.logprobs_k)):
        print(f"\n>>> {text!r}  reference tokens {r['tokens']}")
        print(f"{'pos':>4} {'max|d| fp32':>12} {'top-k fp32':>11} {'top1':>5} {'max|d| bf16':>12} {'top-k bf16':>11} {'top1':>5}")
        for i, (a, b) in enumerate(zip(r["fp32"], r["bf16"])):
            print(f"{i:>4} {a.max_abs_diff:>12.3e} {a.topk_agreement:>11.2f} {'yes' if a.top1_match else 'NO':>5} "
                  f"{b.max_abs_diff:>12.3e} {b.topk_agreement:>11.2f} {'yes' if b.top1_match else 'NO':>5}")
            worst = max(worst, a.max_abs_diff)
    print(f"\nlargest difference from transformers fp32: {worst:.3e}")
    return 1 if args.fail_above is not None and worst > args.fail_above else 0


def _prompts(tok, texts: list[str], args: argparse.Namespace) -> list:
    """The texts as they are, or with --image / --video: a chat message each, the media first."""
    if not (args.image or args.video):
        return list(texts)
    from vllm_neuron.entrypoints.openai.chat_template import normalize_messages

    parts = [{"type": "image", "image": _source(p)} for p in args.image] + \
            [{"type": "video", "video": _source(p)} for p in args.video]
    prompts = []
    for t in texts:
        media: dict = {}
        conv = normalize_messages([{"role": "user", "content": parts + [{"type": "text", "text": t}]}], media)
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        prompts.append({"prompt": text, "multi_modal_data": media})
    return prompts


def _source(path: str) -> bytes | str:
    """A local file's bytes (the tool reads what its user names), else the URL as given."""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return f.read()
    return path
