"""neuron_config.tensor_capture and neuron_config.tensor_replacement: the accuracy-debugging tools' options
(pure: parsed and checked where they enter; the modules they name are checked against the model when it is
built, worker/module_taps.py).

tensor_capture:
    {"modules": ["model.layers.1", "model.layers.*.mlp"],   # module names; * stands for one dot-free segment
     "capture_inputs": false,        # also each module's first tensor input
     "requests": ["0"],              # engine request ids (null: every request)
     "steps": [0, 1],                # a request's own step numbers, 0 = its first prefill chunk (null: all)
     "output_dir": "/tmp/capture",   # default <VLLM_CACHE_ROOT>/tensor_capture/<time>-<pid>
     "max_captures": 256}            # request-steps written at most, then capture stops (logged)

tensor_replacement:
    {"file": "ref.safetensors",      # tensors [positions, ...], row p = the token at position p, named
                                     # `<module>` (every request) or `<request id>/<module>` (that request)
     "modules": ["model.layers.3"],  # the modules replaced (default: every one the file has)
     "requests": ["0"]}              # whose rows are replaced (null: every request the file serves)
Replacement changes what the KV cache holds, so it runs with prefix caching off.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_neuron.config import validate as V

CAPTURE_OPTIONS = ("modules", "capture_inputs", "requests", "steps", "output_dir", "max_captures")
REPLACEMENT_OPTIONS = ("file", "modules", "requests")


def module_matcher(patterns: Sequence[str]):
    """A predicate over module names for `patterns`: names, where * stands for one segment (no dots), so
    'model.layers.*' is every decoder layer and not their submodules. Pure."""
    regex = re.compile("|".join(f"(?:{re.escape(p).replace(chr(92) + '*', '[^.]+')})" for p in patterns))
    return lambda name: regex.fullmatch(name) is not None


def _object(option: str, value: Any, valid: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"neuron_config.{option} must be an object with the keys {', '.join(valid)}; got {value!r}")
    unknown = sorted(set(value) - set(valid))
    if unknown:
        raise ValueError(f"unknown neuron_config.{option} option {unknown[0]!r}; valid options: {', '.join(valid)}")
    return value


def _names(option: str, value: Any, required: bool) -> tuple[str, ...] | None:
    if value is None and not required:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence) or not value \
            or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{option} must be a non-empty list of strings, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class TensorCaptureConfig:
    modules: tuple[str, ...]
    capture_inputs: bool = False
    requests: tuple[str, ...] | None = None
    steps: tuple[int, ...] | None = None
    output_dir: str | None = None
    max_captures: int = 256

    @classmethod
    def from_value(cls, value: Any) -> TensorCaptureConfig | None:
        if value is None or isinstance(value, TensorCaptureConfig):
            return value
        v = _object("tensor_capture", value, CAPTURE_OPTIONS)
        steps = v.get("steps")
        if steps is not None:
            if isinstance(steps, (str, bytes)) or not isinstance(steps, Sequence) or not steps:
                raise ValueError(f"neuron_config.tensor_capture.steps must be a non-empty list of step numbers "
                                 f"(0 = a request's first prefill chunk), got {steps!r}")
            steps = tuple(V.integer("neuron_config.tensor_capture.steps", s, minimum=0) for s in steps)
        out = v.get("output_dir")
        if out is not None and (not isinstance(out, str) or not out):
            raise ValueError(f"neuron_config.tensor_capture.output_dir must be a folder path, got {out!r}")
        return cls(modules=_names("neuron_config.tensor_capture.modules", v.get("modules"), True),
                   capture_inputs=V.boolean("neuron_config.tensor_capture.capture_inputs",
                                            v.get("capture_inputs", False)),
                   requests=_names("neuron_config.tensor_capture.requests", v.get("requests"), False),
                   steps=steps, output_dir=out,
                   max_captures=V.integer("neuron_config.tensor_capture.max_captures", v.get("max_captures", 256),
                                          minimum=1))

    def graph_options(self) -> dict[str, Any]:
        """What changes the compiled graphs (their outputs): part of the compile-cache key."""
        return {"modules": list(self.modules), "capture_inputs": self.capture_inputs}


@dataclass(frozen=True)
class TensorReplacementConfig:
    file: str
    modules: tuple[str, ...] | None = None
    requests: tuple[str, ...] | None = None

    @classmethod
    def from_value(cls, value: Any) -> TensorReplacementConfig | None:
        if value is None or isinstance(value, TensorReplacementConfig):
            return value
        v = _object("tensor_replacement", value, REPLACEMENT_OPTIONS)
        path = v.get("file")
        if not isinstance(path, str) or not path:
            raise ValueError(f"neuron_config.tensor_replacement.file must be the path of a safetensors file, "
                             f"got {path!r}")
        if not os.path.isfile(path):
            raise ValueError(f"neuron_config.tensor_replacement.file {path!r} does not exist")
        return cls(file=path, modules=_names("neuron_config.tensor_replacement.modules", v.get("modules"), False),
                   requests=_names("neuron_config.tensor_replacement.requests", v.get("requests"), False))
