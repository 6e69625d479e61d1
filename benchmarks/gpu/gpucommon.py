"""Shared helpers for the device checks (tokenizer, tiny model, prompts, results)."""
from __future__ import annotations

import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PROJ = os.environ.get("PROJ") or os.path.dirname(os.path.dirname(HERE))
TOK = os.environ.get("GPU_CHECK_TOKENIZER") or os.path.join(PROJ, ".gpu", "tok")
if PROJ not in sys.path:
    sys.path.insert(0, PROJ)


def patch_tokenizer() -> None:
    """tests.model_factory converts the tokenizer from the bundled GGUF, which a bare CUDA image may lack:
    use the carried save_pretrained copy (.gpu/tok, from prepare.sh) when there is one."""
    if not os.path.isdir(TOK):
        return
    from tests import model_factory

    model_factory.smollm2_tokenizer_dir = lambda: TOK


def copy_tokenizer(dst: str) -> None:
    import shutil

    if os.path.isdir(TOK):
        for name in os.listdir(TOK):
            shutil.copy(os.path.join(TOK, name), os.path.join(dst, name))
        return
    from tests import model_factory

    src = model_factory.smollm2_tokenizer_dir()
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def random_prompts(lengths, seed=0, vocab=49152):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def banner(msg: str) -> None:
    print(f"\n===== {msg} =====", flush=True)


def result(step: str, ok: bool, detail: str = "") -> None:
    line = f"RESULT {step}: {'PASS' if ok else 'FAIL'} {detail}".rstrip()
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "summary.txt"), "a") as f:
            f.write(line + "\n")


def save_json(name: str, data: dict) -> None:
    """Figures for the final table (s09_table.py), as $OUT/<name>.json."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(data, f, indent=1)
