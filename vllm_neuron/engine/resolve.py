"""Raw engine arguments -> the resolved EngineConfig, in the process that received them.

The model's facts come from its config (HF config.json or GGUF metadata: `load_checkpoint` reads no tensor
data) and its architecture's declared spec; config/engine_config.py's `resolve` does the rest. The engine
core processes, tensor-parallel ranks, compile workers and replicas get the result and never call this.
"""
from __future__ import annotations

import dataclasses
import os

from vllm_neuron.config import engine_config
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.config.engine_config import EngineConfig, ModelFacts
from vllm_neuron.config.pooler_config import (PoolingSetup, parse_pooler_config, read_sentence_transformers,
                                              resolve_pooling, resolve_runner)
from vllm_neuron.model.loader import Checkpoint, load_checkpoint, load_tokenizer
from vllm_neuron.model.loader.checkpoint import remote_code_note
from vllm_neuron.model.loader.hub import fetch_model, parse_hub_id
from vllm_neuron.model.registry import check_quantization, is_multimodal, resolve_model_class


def fetch_hub_models(args: EngineArgs) -> EngineArgs:
    """A model / tokenizer given by Hugging Face id is downloaded (or found in the cache) here, once: the result
    names the local paths (the engine processes load them as any folder) and serves the model under its id."""
    model_ref = parse_hub_id(args.model) if isinstance(args.model, str) else None
    tok_ref = parse_hub_id(args.tokenizer) if isinstance(args.tokenizer, str) else None
    if model_ref is None:
        given = [f"--{n.replace('_', '-')}" for n in ("revision", "download_dir", "hf_file") if getattr(args, n)]
        if given:
            raise ValueError(f"{', '.join(given)} apply to a model given by Hugging Face id (org/name); the model here "
                             f"is {'the bundled one' if args.model is None else repr(args.model)}: drop them")
    if args.tokenizer_revision and tok_ref is None and (args.tokenizer is not None or model_ref is None):
        raise ValueError("--tokenizer-revision applies to a tokenizer from a Hugging Face id (--tokenizer org/name, "
                         "or MODEL given by id): drop it")
    changes: dict = {}
    if model_ref is not None:
        changes["model"] = fetch_model(args.model, revision=args.revision, download_dir=args.download_dir,
                                       hf_file=args.hf_file)
        if args.served_model_name is None:
            changes["served_model_name"] = args.model  # as vLLM: the id, not the cache path
    tok_revision = args.tokenizer_revision or args.revision
    if tok_ref is not None:
        changes["tokenizer"] = fetch_model(args.tokenizer, revision=args.tokenizer_revision,
                                           download_dir=args.download_dir, only_tokenizer=True)
    elif args.tokenizer is None and model_ref is not None and tok_revision != args.revision:
        changes["tokenizer"] = fetch_model(args.model, revision=tok_revision, download_dir=args.download_dir,
                                           only_tokenizer=True)
    if changes:  # consumed: the result names local paths, and fetching it again is a no-op
        changes.update(revision=None, tokenizer_revision=None, download_dir=None, hf_file=None)
    return dataclasses.replace(args, **changes) if changes else args


def _pooling_setup(args: EngineArgs, ckpt: Checkpoint) -> PoolingSetup | None:
    """The pooler when the checkpoint runs as a pooling model (--runner / --convert / --task, else its
    architecture), from --pooler-config and its sentence-transformers files; None for a generative engine."""
    archs = tuple(getattr(ckpt.hf_config, "architectures", None) or ())
    runner, convert = resolve_runner(args.runner, args.convert, args.task, archs)
    given = parse_pooler_config(args.pooler_config)
    if runner != "pooling":
        if given is not None:
            raise ValueError("pooler_config applies to pooling models (--runner pooling); this one generates")
        return None
    cls = resolve_model_class(ckpt.hf_config, convert)  # a family that cannot pool is refused here
    folder = ckpt.path if os.path.isdir(ckpt.path) else ""
    setup = resolve_pooling(convert, given, read_sentence_transformers(folder), ckpt.hf_config)
    if getattr(cls, "bidirectional", False):
        setup = dataclasses.replace(setup, bidirectional=True)
    tokens = getattr(ckpt.hf_config, "classifier_from_token", None) if convert == "classify" else None
    if tokens:
        setup = dataclasses.replace(setup, classifier_token_ids=_token_ids(args, ckpt, tokens))
    return setup


def _token_ids(args: EngineArgs, ckpt: Checkpoint, tokens: list[str]) -> tuple[int, ...]:
    """classifier_from_token's tokens -> their ids; each must be one token of the vocabulary."""
    tok = load_tokenizer(args.tokenizer or ckpt)
    ids = []
    for t in tokens:
        enc = tok.encode(t, add_special_tokens=False)
        if len(enc) != 1:
            raise ValueError(f"classifier_from_token: {t!r} is {len(enc)} tokens, not one, in this tokenizer")
        ids.append(enc[0])
    return tuple(ids)


def resolve_engine_config(args: EngineArgs, checkpoint: Checkpoint | None = None) -> tuple[EngineConfig, Checkpoint]:
    """(the resolved config, the checkpoint it was resolved for): every refusal happens here, before any
    engine process starts (an architecture we do not serve included)."""
    if checkpoint is None:
        args = fetch_hub_models(args)
    ckpt = checkpoint or load_checkpoint(args.model)
    try:
        cls = resolve_model_class(ckpt.hf_config)
    except ValueError as e:
        note = remote_code_note(ckpt.path) if os.path.isdir(ckpt.path) else None
        raise ValueError(f"{e}; {note}" if note else str(e)) from None
    spec = cls.spec(ckpt.hf_config)
    max_positions = getattr(cls, "max_positions", None)  # an encoder whose positions start past 0
    pooling = _pooling_setup(args, ckpt)
    max_len = max_positions(ckpt.hf_config) if max_positions else ckpt.hf_config.get_text_config().max_position_embeddings
    if pooling is not None and pooling.max_seq_length:  # as vLLM: sentence-transformers' limit is the model's
        max_len = min(max_len, pooling.max_seq_length)
    facts = ModelFacts(max_model_len=max_len, moe=spec.is_moe, sliding_window=spec.has_sliding_window,
                       multimodal=is_multimodal(ckpt.hf_config), audio=bool(getattr(cls, "audio", False)),
                       pooling=pooling)
    config = engine_config.resolve(args, facts)
    # The architecture must honour the weight quantization asked for ('bf16' resolved to none).
    check_quantization(cls, spec, config.neuron_config.quantization)
    return config, ckpt
