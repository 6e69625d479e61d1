"""Prompt sources for `bench serve`: their options, ShareGPT, and the dataset a run asks for (random token
prompts and shared-prefix prompts are built in benchmarks/prompts.py, random media in random_mm.py)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
from typing import Any

from vllm_neuron.benchmarks import random_audio, random_mm
from vllm_neuron.benchmarks.prompts import (SampleRequest, encode_text, num_special_tokens,
                                            sample_prefix_repetition_requests, sample_random_requests)

logger = logging.getLogger(__name__)

DATASET_NAMES = ("random", "sharegpt", "prefix_repetition", "random-mm", "random-audio")


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """Dataset options, with vLLM's names and defaults."""
    group = parser.add_argument_group("dataset options")
    group.add_argument(
        "--dataset-name", type=str, default="random", choices=list(DATASET_NAMES),
        help="Prompt source. 'random': random token prompts (optionally after a shared random "
        "prefix, --random-prefix-len). 'prefix_repetition': a few random prefixes each shared "
        "by many prompts. 'sharegpt': a local ShareGPT json (--dataset-path). 'random-mm': random prompts "
        "with random images / videos (--random-mm-*; needs --backend openai-chat). 'random-audio': synthetic clips "
        "(--random-audio-*; needs --backend openai-audio), real-time factor reported.")
    group.add_argument("--dataset-path", type=str, default=None,
                       help="Path to a local ShareGPT json file, sharegpt only (default: none).")
    group.add_argument("--num-prompts", type=int, default=1000, help="Number of prompts.")
    group.add_argument("--seed", type=int, default=0,
                       help="Seed for prompts, lengths and arrival times.")
    group.add_argument("--input-len", type=int, default=None,
                       help="Shorthand for --random-input-len (default: unset).")
    group.add_argument("--output-len", type=int, default=None,
                       help="Shorthand for the dataset's output length option (default: unset).")
    random_group = parser.add_argument_group("random dataset options")
    random_group.add_argument("--random-input-len", type=int, default=1024,
                              help="Tokens per prompt, after the prefix.")
    random_group.add_argument("--random-output-len", type=int, default=128,
                              help="Output tokens per request (max_tokens).")
    random_group.add_argument(
        "--random-range-ratio", type=float, default=0.0,
        help="Input/output lengths are drawn uniformly from [len*(1-r), len*(1+r)]; 0 <= r < 1.")
    random_group.add_argument(
        "--random-prefix-len", type=int, default=0,
        help="Random tokens shared by every prompt before its own --random-input-len tokens "
        "(shared-prefix workload).")
    prefix_group = parser.add_argument_group("prefix_repetition dataset options")
    prefix_group.add_argument("--prefix-repetition-prefix-len", type=int, default=256,
                              help="Tokens in each shared prefix.")
    prefix_group.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                              help="Tokens after the prefix, own to each prompt.")
    prefix_group.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                              help="Number of distinct prefixes.")
    prefix_group.add_argument("--prefix-repetition-output-len", type=int, default=128,
                              help="Output tokens per request.")
    random_mm.add_random_mm_args(parser)
    random_audio.add_random_audio_args(parser)
    sharegpt_group = parser.add_argument_group("sharegpt dataset options")
    sharegpt_group.add_argument(
        "--sharegpt-output-len", type=int, default=None,
        help="Output tokens per request (default: the length of the dataset's own answer).")

def _turn_text(turn: dict) -> str:
    return str(turn.get("value", turn.get("content", "")))


def sample_sharegpt_requests(tokenizer: Any, num_requests: int, dataset_path: str | None,
                             output_len: int | None = None,
                             seed: int = 0) -> list[SampleRequest]:
    """Prompts from a local ShareGPT json: the first human turn, answered by the second turn.

    As in vLLM, pairs with a prompt or answer under 4 tokens, a prompt over 1,024 tokens or
    more than 2,048 tokens in all are skipped (the answer check only without a fixed output_len).
    """
    if not dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a local ShareGPT json)")
    if not os.path.isfile(dataset_path):
        raise ValueError(f"--dataset-path {dataset_path!r} is not a file")
    if num_requests < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_requests}")
    if output_len is not None and output_len < 1:
        raise ValueError(f"--sharegpt-output-len must be >= 1, got {output_len}")
    with open(dataset_path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {dataset_path!r}: expected a json list of "
                         "{'conversations': [...]} entries")
    convs = [d["conversations"] for d in data
             if isinstance(d, dict) and len(d.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(convs)
    n_special = num_special_tokens(tokenizer)
    requests: list[SampleRequest] = []
    for conv in convs:
        if len(requests) == num_requests:
            break
        prompt, answer = _turn_text(conv[0]), _turn_text(conv[1])
        prompt_len = len(encode_text(tokenizer, prompt)) + n_special
        out_len = output_len if output_len is not None else len(encode_text(tokenizer, answer))
        if prompt_len < 4 or prompt_len > 1024 or prompt_len + out_len > 2048:
            continue
        if output_len is None and out_len < 4:
            continue
        requests.append(SampleRequest(prompt, prompt_len, out_len, str(len(requests))))
    if not requests:
        raise ValueError(f"--dataset-path {dataset_path!r} has no usable conversations")
    if len(requests) < num_requests:
        # Too few usable pairs: repeat some, as vLLM does, so --num-prompts still holds.
        logger.warning("ShareGPT file has %d usable prompts; repeating some to reach %d.",
                       len(requests), num_requests)
        extra = random.Random(seed + 1).choices(requests, k=num_requests - len(requests))
        requests += [SampleRequest(r.prompt, r.prompt_len, r.expected_output_len,
                                   str(len(requests) + i)) for i, r in enumerate(extra)]
    return requests


def get_samples(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    """The prompts the parsed options ask for."""
    name = args.dataset_name
    input_len = getattr(args, "input_len", None)
    output_len = getattr(args, "output_len", None)
    if name in ("random", "prefix_repetition", "random-mm", "random-audio") and args.dataset_path is not None:
        raise ValueError(f"--dataset-path cannot be used with --dataset-name {name}; "
                         "use --dataset-name sharegpt for a dataset file")
    if name == "random":
        return sample_random_requests(
            tokenizer, args.num_prompts,
            input_len=input_len if input_len is not None else args.random_input_len,
            output_len=output_len if output_len is not None else args.random_output_len,
            range_ratio=args.random_range_ratio, prefix_len=args.random_prefix_len,
            seed=args.seed)
    if name == "random-mm":
        return random_mm.sample_random_mm_requests(
            tokenizer, args.num_prompts,
            input_len=input_len if input_len is not None else args.random_input_len,
            output_len=output_len if output_len is not None else args.random_output_len,
            range_ratio=args.random_range_ratio, base_items=args.random_mm_base_items_per_request,
            items_range_ratio=args.random_mm_num_mm_items_range_ratio,
            limits=random_mm.parse_limits(args.random_mm_limit_mm_per_prompt),
            buckets=random_mm.parse_buckets(args.random_mm_bucket_config), seed=args.seed)
    if name == "random-audio":
        return random_audio.sample_random_audio_requests(
            args.num_prompts, random_audio.parse_seconds(args.random_audio_seconds),
            output_len=output_len if output_len is not None else args.random_output_len, seed=args.seed)
    if name == "prefix_repetition":
        return sample_prefix_repetition_requests(
            tokenizer, args.num_prompts, prefix_len=args.prefix_repetition_prefix_len,
            suffix_len=args.prefix_repetition_suffix_len,
            num_prefixes=args.prefix_repetition_num_prefixes,
            output_len=output_len if output_len is not None else args.prefix_repetition_output_len,
            seed=args.seed)
    if name == "sharegpt":
        return sample_sharegpt_requests(
            tokenizer, args.num_prompts, args.dataset_path,
            output_len=output_len if output_len is not None else args.sharegpt_output_len,
            seed=args.seed)
    raise ValueError(f"--dataset-name must be one of {', '.join(DATASET_NAMES)}; got {name!r}")
