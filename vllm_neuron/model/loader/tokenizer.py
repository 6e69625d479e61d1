"""Tokenizers for HF directories and GGUF files, cached per path and GGUF conversions cached on disk
(a conversion takes seconds)."""

from __future__ import annotations

import copy
import functools
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from vllm_neuron.model.loader.checkpoint import Checkpoint


def _tokenizer_source(path_or_checkpoint: Any) -> str:
    if path_or_checkpoint is None:
        from vllm_neuron.model.loader.bundled import bundled_model_path

        return bundled_model_path()
    if isinstance(path_or_checkpoint, str):
        from vllm_neuron.model.loader.checkpoint import resolve_model_path

        return resolve_model_path(path_or_checkpoint)
    tokenizer_path = getattr(path_or_checkpoint, "tokenizer_path", None)
    if tokenizer_path is None:
        raise ValueError(
            f"load_tokenizer: expected a path, a Checkpoint or None, got {type(path_or_checkpoint).__name__}"
        )
    return tokenizer_path


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int) -> "PreTrainedTokenizerFast":
    from transformers import AutoTokenizer

    from vllm_neuron.model.loader import gguf_cache

    if path.endswith(".gguf"):
        # The conversion parses the whole GGUF vocabulary (seconds): reuse an earlier one.
        tok = gguf_cache.read_tokenizer(path)
        if tok is not None:
            return tok
    try:
        if path.endswith(".gguf"):
            tok = _gguf_tokenizer(path)
        else:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"Cannot load a tokenizer from {path}: {e}") from e
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"The tokenizer at {path} has no fast (tokenizers) implementation")
    if path.endswith(".gguf"):
        gguf_cache.write_tokenizer(path, tok)
    return tok


def _gguf_tokenizer(path: str) -> "PreTrainedTokenizerFast":
    """transformers' tokenizer of a GGUF file. AutoTokenizer first reads the file's model config and refuses
    architectures transformers does not map (e.g. granite), although the tokenizer metadata is llama.cpp's
    common one: for those, the same conversion builds a generic fast tokenizer. So it does for gpt-oss, whose config
    reader in transformers (5.x) fails on llama.cpp's rope.scaling keys with a TypeError."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                             local_files_only=True)
    except ValueError as e:
        if "is not supported yet" not in str(e):
            raise
    except TypeError:
        pass
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(path)
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def read_chat_template(chat_template: str) -> str:
    """A template given as a file path is read; otherwise the string itself is the template."""
    if os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    if any(c in chat_template for c in "{}\n"):
        return chat_template
    raise ValueError(
        f"chat_template {chat_template!r} is neither an existing file nor a Jinja template "
        f"(a template contains '{{' or a newline)"
    )


def load_tokenizer(
    path_or_checkpoint: "str | Checkpoint | None" = None, chat_template: str | None = None
) -> "PreTrainedTokenizerFast":
    """The tokenizer of a model directory, a .gguf file, a Checkpoint, or (None) the bundled model.

    The same object is returned for the same path: treat it as read-only. With `chat_template`
    (a Jinja string or a file path) a private copy carrying that template is returned instead.
    """
    path = _tokenizer_source(path_or_checkpoint)
    if not os.path.exists(path):
        raise ValueError(f"Tokenizer path {path} does not exist")
    tok = _load_cached(path, os.stat(path).st_mtime_ns)
    if chat_template is None:
        return tok
    template = read_chat_template(chat_template)
    tok = copy.deepcopy(tok)
    tok.chat_template = template
    return tok
