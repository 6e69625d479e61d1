"""Forward hooks on named modules of the model, for tensor capture and tensor replacement.

Capture: while a graph function runs inside `recording()`, each tapped module's output (and first tensor
input) lands in a dict the graph returns (`StepOutput.captured`): in a compiled graph those tensors are
graph outputs, so what is captured is what the compiled code computed. Replacement: a replaced module's
output is `where(row_mask, table, output)` over per-module tables the runner fills before each step
(worker/tensor_debug.py), so one graph serves steps with and without replacement; the capture hook runs
first and still sees the module's own output. Everything here is about tensors and module names; which
rows belong to which request is the runner's business.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from vllm_neuron.config.tensor_debug import TensorCaptureConfig, module_matcher


def match_modules(model: nn.Module, patterns: Sequence[str], option: str) -> list[str]:
    """The module names matching any of `patterns` (config/tensor_debug.module_matcher), in the model's order; a pattern that matches
    nothing is a ValueError listing names that exist."""
    names = [n for n, _ in model.named_modules() if n]
    out: list[str] = []
    for p in patterns:
        match = module_matcher([p])
        hits = [n for n in names if match(n)]
        if not hits:
            shown = [n for n in names if n.count(".") <= 3][:40]
            raise ValueError(f"{option}: {p!r} matches no module of this model; modules include: "
                             f"{', '.join(shown)}{' ...' if len(shown) < len(names) else ''}")
        out += [h for h in hits if h not in out]
    order = {n: i for i, n in enumerate(names)}
    return sorted(out, key=order.__getitem__)


def _first_tensor(values) -> torch.Tensor | None:
    for v in values:
        if isinstance(v, torch.Tensor):
            return v
    return None


class ReplacementTables(nn.Module):
    """Per replaced module a [rows, *features] table and a [rows] mask, registered as buffers so that a
    compiled graph reads their current contents at every call (they are filled in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.index: dict[str, int] = {}

    def add(self, name: str, rows: int, features: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        i = len(self.index)
        self.index[name] = i
        self.register_buffer(f"table_{i}", torch.zeros((rows, *features), dtype=dtype, device=device))
        self.register_buffer(f"mask_{i}", torch.zeros(rows, dtype=torch.bool, device=device))

    def table(self, name: str) -> torch.Tensor:
        return getattr(self, f"table_{self.index[name]}")

    def mask(self, name: str) -> torch.Tensor:
        return getattr(self, f"mask_{self.index[name]}")


class ModuleTaps:
    """The hooks of one model: capture (`capture` config) and replacement (module names -> tables)."""

    def __init__(self, model: nn.Module, capture: TensorCaptureConfig | None, replace: Sequence[str] = ()) -> None:
        self.captured_names = match_modules(model, capture.modules, "neuron_config.tensor_capture.modules") \
            if capture is not None else []
        self.capture_inputs = bool(capture and capture.capture_inputs)
        modules = dict(model.named_modules())
        missing = [n for n in replace if n not in modules]
        if missing:
            raise ValueError(f"neuron_config.tensor_replacement: the file has a tensor for {missing[0]!r}, which "
                             f"is no module of this model (tensors are named by module, e.g. 'model.layers.0')")
        self.replaced_names = list(replace)
        self.tables = ReplacementTables()
        self.shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # from probe(): output features, dtype
        self._active: dict[str, torch.Tensor] | None = None
        self._probing = False
        self._handles = []
        for name in dict.fromkeys([*self.captured_names, *self.replaced_names]):
            self._handles.append(modules[name].register_forward_hook(self._hook(name), with_kwargs=False))

    def _hook(self, name: str):
        capture = name in self.captured_names
        replace = name in self.replaced_names

        def hook(module, args, output):
            out = output if isinstance(output, torch.Tensor) else _first_tensor(output)
            if self._probing:
                if out is not None:
                    self.shapes[name] = (tuple(out.shape[1:]), out.dtype)
                return None
            if capture and self._active is not None:
                if self.capture_inputs:
                    x = _first_tensor(args)
                    if x is not None:
                        self._active[f"{name}.input"] = x
                if out is not None:
                    self._active[name] = out
            if replace and name in self.tables.index and isinstance(output, torch.Tensor):
                n = output.shape[0]
                table, mask = self.tables.table(name), self.tables.mask(name)
                return torch.where(mask[:n].view(n, *([1] * (output.dim() - 1))), table[:n].to(output.dtype), output)
            return None

        return hook

    @contextlib.contextmanager
    def recording(self) -> Iterator[dict[str, torch.Tensor]]:
        """Inside a graph function: the tapped tensors of this forward, by name (`<module>` for an output,
        `<module>.input` for an input)."""
        rec: dict[str, torch.Tensor] = {}
        before, self._active = self._active, rec
        try:
            yield rec
        finally:
            self._active = before

    @contextlib.contextmanager
    def probing(self) -> Iterator[None]:
        """Records each tapped module's output features and dtype (`shapes`) instead of capturing."""
        self._probing = True
        try:
            yield
        finally:
            self._probing = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
