"""What a GGUF file converts to, cached on disk: config, generation config, tokenizer, weights.

Parsing a GGUF file's vocabulary takes seconds and dequantizing its weights takes more, and both the
API-server process and the EngineCore process paid that on every start. The first load of a file
writes the conversion to $VLLM_CACHE_ROOT/gguf/<stem>-<key>/, where the key hashes the file's
absolute path, size and mtime (every part's, for a split GGUF) and a fingerprint of the converting
code (our loader's source, the transformers/gguf/tokenizers versions), so a changed file or
converter never reads a stale entry:

    config.json, generation_config.json, tensors.json   the configs, the weights' total sizes and types
    tokenizer/                                          the converted tokenizer (save_pretrained)
    weights-<dtype>.safetensors                         iter_gguf_weights(path, config, dtype)
    source.json                                         which file the entry belongs to (pruning)

Every artifact is written under a temporary name in the same folder and then renamed, because the
two processes of a server may fill one folder at the same time. A missing or unreadable artifact
falls back to the GGUF file and is rewritten; a cache that cannot be written is logged once and
ignored. Nothing here may fail a load.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from vllm_neuron import envs
from vllm_neuron.logger import init_logger
from vllm_neuron.model.loader import gguf_arches, gguf_loader, gguf_split

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedTokenizerFast

logger = init_logger(__name__)

CACHE_SUBDIR = "gguf"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
TENSORS_NAME = "tensors.json"
SOURCE_NAME = "source.json"
TOKENIZER_DIR = "tokenizer"
_ORDER_KEY = "order"  # safetensors metadata: the names in iter_gguf_weights' order
_GIB = 1 << 30

_lock = threading.Lock()
_unusable_logged: set[str] = set()


# ---------------------------------------------------------------------------------------------
# Where an entry lives
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    h = hashlib.sha256()
    for module_file in (gguf_loader.__file__, gguf_arches.__file__, gguf_split.__file__, __file__):
        with open(module_file, "rb") as f:
            h.update(f.read())
    for dist in ("transformers", "gguf", "tokenizers"):
        try:
            h.update(f"{dist}={importlib.metadata.version(dist)};".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist}=?;".encode())
    return h.hexdigest()


def _source_id(path: str) -> dict[str, Any] | None:
    """The file's identity; for the first part of a split GGUF (by its name), every part's too."""
    parts = gguf_split.sibling_parts(path)
    try:
        stats = [os.stat(p) for p in parts]
    except OSError:
        return None  # a missing part: the loader names it
    source = {"path": os.path.abspath(path), "size": stats[0].st_size, "mtime_ns": stats[0].st_mtime_ns}
    if len(parts) > 1:
        source["parts"] = [[st.st_size, st.st_mtime_ns] for st in stats[1:]]
    return source


def cache_dir(gguf_path: str) -> str | None:
    """The cache folder of this version of `gguf_path` (it may not exist yet); None when the file
    cannot be stat'ed or the loader's source cannot be read (then nothing is cached)."""
    source = _source_id(gguf_path)
    if source is None:
        return None
    try:
        fingerprint = _code_fingerprint()
    except OSError:  # e.g. an install without .py files: no safe key
        return None
    blob = json.dumps([source["path"], source["size"], source["mtime_ns"], fingerprint]
                      + ([source["parts"]] if "parts" in source else []))
    key = hashlib.sha256(blob.encode()).hexdigest()[:20]
    stem = os.path.splitext(os.path.basename(source["path"]))[0][:48]
    return os.path.join(envs.VLLM_CACHE_ROOT, CACHE_SUBDIR, f"{stem}-{key}")


def weights_file_name(dtype: torch.dtype | None) -> str:
    """`weights-bfloat16.safetensors` etc.; dtype None (the yielded float32/float16) -> `weights-native`."""
    tag = "native" if dtype is None else str(dtype).removeprefix("torch.")
    return f"weights-{tag}.safetensors"


def max_weight_bytes() -> int:
    """Largest weight set that is cached (VLLM_NEURON_GGUF_CACHE_MAX_GIB; 0 disables)."""
    return int(envs.VLLM_NEURON_GGUF_CACHE_MAX_GIB * _GIB)


# ---------------------------------------------------------------------------------------------
# Writing: atomic, and never fatal
# ---------------------------------------------------------------------------------------------


def _unusable(where: str, err: BaseException) -> None:
    root = os.path.join(envs.VLLM_CACHE_ROOT, CACHE_SUBDIR)
    with _lock:
        if root in _unusable_logged:
            return
        _unusable_logged.add(root)
    logger.info("GGUF conversion cache %s cannot be written (%s: %s); loading from the GGUF file "
                "without it", where, type(err).__name__, err)


def _ensure_dir(d: str) -> bool:
    try:
        os.makedirs(d, exist_ok=True)
        return True
    except OSError as e:
        _unusable(d, e)
        return False


def _atomic_write(dest: str, write: Callable[[str], None]) -> bool:
    """write(temp path) then rename it to `dest`; False (logged) when anything fails."""
    d = os.path.dirname(dest)
    if not _ensure_dir(d):
        return False
    tmp = os.path.join(d, f".{os.path.basename(dest)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        os.replace(tmp, dest)
        return True
    except Exception as e:  # a full disk or a read-only folder must not fail the load
        _unusable(dest, e)
        return False
    finally:
        if os.path.lexists(tmp):
            _discard(tmp)


def _write_json(dest: str, data: Any) -> bool:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)

    return _atomic_write(dest, write)


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _discard(path: str) -> None:
    """Remove a file or folder; a folder is first renamed aside so that no reader sees half of it."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            aside = f"{path}.gone-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(path, aside)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.remove(path)
    except OSError:
        pass


def _describe(d: str, artifact: str, nbytes: int | None = None) -> None:
    size = "" if nbytes is None else f", {nbytes / 2**20:.1f} MiB"
    logger.info("GGUF conversion cached in %s (%s%s)", d, artifact, size)


def _open_entry(d: str, gguf_path: str) -> bool:
    """Creates the entry folder (with its source.json) for writing; False when it cannot be."""
    if not _ensure_dir(d):
        return False
    if os.path.isfile(os.path.join(d, SOURCE_NAME)):
        return True
    source = _source_id(gguf_path)
    if source is None or not _write_json(os.path.join(d, SOURCE_NAME), source):
        return False
    _prune_stale(d, source)
    return True


def _dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _prune_stale(entry: str, source: dict[str, Any]) -> None:
    """Drop other entries of the same file and entries whose file changed or is gone: each key
    change (a new file version, a new converter) would otherwise leave a full copy behind."""
    root = os.path.dirname(entry)
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        other = os.path.join(root, name)
        if other == entry or not os.path.isdir(other):
            continue
        try:
            theirs = _read_json(os.path.join(other, SOURCE_NAME))
        except (OSError, ValueError):
            continue  # not ours to judge (being written, or not an entry)
        if not isinstance(theirs, dict) or not isinstance(theirs.get("path"), str):
            continue
        if theirs.get("path") == source["path"] or _source_id(theirs["path"]) != theirs:
            logger.debug("Removing stale GGUF cache entry %s", other)
            _discard(other)


# ---------------------------------------------------------------------------------------------
# Config, generation config, weight sizes
# ---------------------------------------------------------------------------------------------


def _config_from_dict(data: dict[str, Any]) -> LlamaConfig:
    from transformers import AutoConfig

    data = dict(data)
    return AutoConfig.for_model(data.pop("model_type", "llama"), **data)


def _read_configs(d: str) -> tuple[LlamaConfig, dict[str, Any]] | None:
    try:
        config = _config_from_dict(_read_json(os.path.join(d, CONFIG_NAME)))
        generation = _read_json(os.path.join(d, GENERATION_CONFIG_NAME))
        if not isinstance(generation, dict):
            raise ValueError("generation config is not a JSON object")
        return config, generation
    except FileNotFoundError:
        return None
    except Exception as e:  # unreadable: parse the GGUF instead and rewrite
        logger.warning("Ignoring the unreadable GGUF cache config in %s (%s)", d, e)
        _discard(os.path.join(d, CONFIG_NAME))
        return None


def load_configs(gguf_path: str) -> tuple[LlamaConfig, dict[str, Any]]:
    """(gguf_config, gguf_generation_config) of the file, from the cache when there."""
    d = cache_dir(gguf_path)
    if d is not None:
        cached = _read_configs(d)
        if cached is not None:
            return cached
    config = gguf_loader.gguf_config(gguf_path)
    generation = gguf_loader.gguf_generation_config(gguf_path)
    if d is not None:
        try:
            _write_configs(d, gguf_path, config, generation)
        except Exception as e:  # the load itself succeeded: never fail it for the cache
            _unusable(d, e)
    return config, generation


def _write_configs(d: str, gguf_path: str, config: LlamaConfig, generation: dict[str, Any]) -> None:
    data = config.to_dict()
    # Cache only what reads back as the same config (a transformers change could break the round trip).
    if _config_from_dict(json.loads(json.dumps(data))).to_dict() != data:
        return
    if json.loads(json.dumps(generation)) != generation:
        return
    sizes = {
        "float32_bytes": gguf_loader.gguf_weight_bytes(gguf_path, torch.float32),
        "native_bytes": gguf_loader.gguf_weight_bytes(gguf_path, None),
        "hf_types": gguf_loader.gguf_hf_types(gguf_path),
    }
    # config.json last: _read_configs treats its presence as the entry being usable.
    if (_open_entry(d, gguf_path)
            and _write_json(os.path.join(d, TENSORS_NAME), sizes)
            and _write_json(os.path.join(d, GENERATION_CONFIG_NAME), generation)
            and _write_json(os.path.join(d, CONFIG_NAME), data)):
        _describe(d, "config, generation config")


def weight_bytes(gguf_path: str, dtype: torch.dtype | None = None) -> int:
    """Bytes of the tensors iter_weights(gguf_path, ..., dtype) yields, from the cached sizes
    when there (no GGUF parse), else from the GGUF header."""
    d = cache_dir(gguf_path)
    if d is not None:
        try:
            sizes = _read_json(os.path.join(d, TENSORS_NAME))
            if dtype is None:
                return int(sizes["native_bytes"])
            return int(sizes["float32_bytes"]) // 4 * dtype.itemsize
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return gguf_loader.gguf_weight_bytes(gguf_path, dtype)


def hf_types(gguf_path: str) -> dict[str, str]:
    """gguf_loader.gguf_hf_types(gguf_path), from the cached sizes when there (no GGUF parse)."""
    d = cache_dir(gguf_path)
    if d is not None:
        try:
            types = _read_json(os.path.join(d, TENSORS_NAME))["hf_types"]
            if isinstance(types, dict):
                return {str(k): str(v) for k, v in types.items()}
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return gguf_loader.gguf_hf_types(gguf_path)


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def _iter_cached_weights(
    file: str, dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(file, framework="pt", device="cpu") as f:
        names = list(f.keys())
        order = json.loads((f.metadata() or {}).get(_ORDER_KEY, "null")) or sorted(names)
        if sorted(order) != sorted(names):
            raise ValueError("the stored tensor order does not list the stored tensors")
        for name in order:
            t = f.get_tensor(name)
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:  # packed blocks: any dtype
                raise ValueError(f"tensor {name} is {t.dtype}, expected {dtype}")
            yield name, t


def _write_weights(d: str, dtype: torch.dtype | None, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    name = weights_file_name(dtype)
    metadata = {_ORDER_KEY: json.dumps(list(tensors))}
    nbytes = sum(t.nbytes for t in tensors.values())
    if _atomic_write(os.path.join(d, name), lambda tmp: save_file(tensors, tmp, metadata=metadata)):
        _describe(d, name, nbytes)


def iter_weights(
    gguf_path: str, config: LlamaConfig, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """What gguf_loader.iter_gguf_weights(gguf_path, config, dtype) yields, streamed from the cached
    safetensors file when there. Otherwise the GGUF is dequantized and, when the weights fit the
    size cap, the yielded tensors are kept and written to the cache once all were consumed."""
    d = cache_dir(gguf_path)
    yielded: set[str] = set()
    if d is not None:
        file = os.path.join(d, weights_file_name(dtype))
        if os.path.isfile(file):
            try:
                for name, t in _iter_cached_weights(file, dtype):
                    yielded.add(name)
                    yield name, t
                return
            except Exception as e:  # corrupt or partial: the GGUF has the rest
                logger.warning("Ignoring the unreadable cached weights %s (%s); reading the GGUF file",
                               file, e)
                _discard(file)
    cap = max_weight_bytes()
    keep = (d is not None and cap > 0 and gguf_loader.gguf_weight_bytes(gguf_path, dtype) <= cap
            and _open_entry(d, gguf_path))  # no point holding tensors for an unwritable cache
    kept: dict[str, torch.Tensor] = {}
    for name, t in gguf_loader.iter_gguf_weights(gguf_path, config, dtype):
        if keep:
            kept[name] = t.contiguous()
        if name not in yielded:
            yield name, t
    if keep and kept:
        _write_weights(d, dtype, kept)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def read_tokenizer(gguf_path: str) -> PreTrainedTokenizerFast | None:
    """The cached tokenizer converted from `gguf_path`, or None (not cached, or unreadable)."""
    d = cache_dir(gguf_path)
    if d is None:
        return None
    folder = os.path.join(d, TOKENIZER_DIR)
    if not os.path.isdir(folder):
        return None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        if not getattr(tok, "is_fast", False):
            raise ValueError("not a fast tokenizer")
    except Exception as e:
        logger.warning("Ignoring the unreadable cached tokenizer %s (%s); converting the GGUF file",
                       folder, e)
        _discard(folder)
        return None
    # As the converted one reports it (the model's folder), not the cache folder.
    tok.name_or_path = os.path.dirname(os.path.abspath(gguf_path))
    return tok


def write_tokenizer(gguf_path: str, tok: PreTrainedTokenizerFast) -> None:
    """Saves the tokenizer converted from `gguf_path` into its cache entry."""
    d = cache_dir(gguf_path)
    if d is None or not _open_entry(d, gguf_path):
        return
    final = os.path.join(d, TOKENIZER_DIR)
    tmp = os.path.join(d, f".{TOKENIZER_DIR}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tok.save_pretrained(tmp)
        os.rename(tmp, final)
    except FileExistsError:
        return  # a concurrent process published the same tokenizer first
    except OSError as e:
        if os.path.isdir(final):
            return  # ENOTEMPTY: as above
        _unusable(final, e)
        return
    except Exception as e:
        _unusable(final, e)
        return
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    _describe(d, TOKENIZER_DIR, _dir_bytes(final))
