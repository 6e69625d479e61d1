"""The scripts under benchmarks/: their paths (to run them as a user does) and the script imported as a
module (to test its pure parts)."""
from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def script_path(name: str) -> str:
    """benchmarks/NAME.py."""
    return os.path.join(REPO, "benchmarks", f"{name}.py")


def load_script(name: str) -> ModuleType:
    """benchmarks/NAME.py imported as the module NAME."""
    spec = importlib.util.spec_from_file_location(name, script_path(name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module
