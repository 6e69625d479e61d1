"""Tensor capture and tensor replacement, the runner's side (neuron_config.tensor_capture /
tensor_replacement; options in config/tensor_debug.py, hooks in worker/module_taps.py).

The runner calls `begin(chunks, rows_per_seq)` before each step's graph and `end(kind, bucket, captured)`
after it. `begin` fills the replacement tables for the step's rows from the file (row r of a request gets
the file's row at r's token position); `end` writes each selected request's rows of the captured tensors to
`<output_dir>/<request>/step_NNNN.safetensors` and a line of `manifest.jsonl` (request, its step number, kind,
bucket, positions, tensors). A request's step number counts the graph steps it took part in, 0 being its
first prefill chunk.
"""
from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_neuron import envs
from vllm_neuron.config.tensor_debug import TensorCaptureConfig, TensorReplacementConfig
from vllm_neuron.logger import init_logger
from vllm_neuron.worker.module_taps import ModuleTaps

logger = init_logger(__name__)

_ENCODER_PREFIXES = ("model.visual.", "visual.")  # run by the model kinds' encoder graphs (worker/model_kinds/)


@dataclass(frozen=True)
class RowSpan:
    """One request's rows in a step: rows [row, row + count) hold its tokens at positions [position, ...)."""

    req_id: str
    row: int
    position: int
    count: int


def step_rows(chunks: Sequence, rows_per_seq: int | None) -> list[RowSpan]:
    """Where each chunk's tokens sit among a step's rows: packed one after another (a prefill,
    `rows_per_seq` None) or `rows_per_seq` rows per sequence from row 0 (1: a decode; 1 + K: a
    verification, whose rows past the chunk's tokens are padding). Pure."""
    out, row = [], 0
    for i, c in enumerate(chunks):
        n = len(c.token_ids)
        start = row if rows_per_seq is None else i * rows_per_seq
        out.append(RowSpan(c.req_id, start, c.start_pos, n if rows_per_seq is None else min(n, rows_per_seq)))
        row += n
    return out


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "_"


def load_replacements(cfg: TensorReplacementConfig) -> dict[str, dict[str | None, torch.Tensor]]:
    """The file's tensors the config selects: module -> {request id or None (every request): tensor}. A tensor
    named `<module>` serves every request the config selects, `<request id>/<module>` that request only (module
    names never hold a '/'). A ValueError names what is wrong."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(cfg.file)
    except Exception as e:  # noqa: BLE001 - a file that is not safetensors
        raise ValueError(f"neuron_config.tensor_replacement.file {cfg.file!r} is not a readable safetensors file: "
                         f"{e}") from None
    out: dict[str, dict[str | None, torch.Tensor]] = {}
    for key, t in tensors.items():
        req, _, module = key.rpartition("/")
        if cfg.modules is not None and module not in cfg.modules:
            continue
        if not t.is_floating_point() or t.dim() < 2:
            raise ValueError(f"neuron_config.tensor_replacement: {key!r} in {cfg.file} is {t.dtype} "
                             f"{list(t.shape)}; a replacement is a floating-point [positions, ...] tensor")
        out.setdefault(module, {})[req or None] = t
    missing = [m for m in cfg.modules or () if m not in out]
    if missing or not out:
        raise ValueError(f"neuron_config.tensor_replacement: {cfg.file} has no tensor for "
                         f"{missing[0] if missing else 'any module'!r} (it has: {', '.join(sorted(tensors)) or 'none'})")
    return out


class TensorDebug:
    """One engine's (one rank's) capture and replacement."""

    def __init__(self, model: torch.nn.Module, capture: TensorCaptureConfig | None,
                 replace: TensorReplacementConfig | None, max_rows: int, device: torch.device,
                 rank: int = 0, world: int = 1) -> None:
        self.capture = capture
        self.replace = replace
        self.replacements = load_replacements(replace) if replace is not None else {}
        self.taps = ModuleTaps(model, capture, list(self.replacements))
        tower = [n for n in self.taps.replaced_names if n.startswith(_ENCODER_PREFIXES)]
        if tower:
            raise ValueError(f"neuron_config.tensor_replacement: {tower[0]!r} is in the vision tower, whose outputs "
                             f"cannot be replaced yet (capture works there); replace modules of the text model")
        self.max_rows = max_rows
        self.device = device
        self._spans: list[RowSpan] = []
        self._steps: dict[str, int] = {}
        self._written = 0
        self.output_dir = None
        if capture is not None:
            root = capture.output_dir or os.path.join(envs.VLLM_CACHE_ROOT, "tensor_capture",
                                                      f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
            self.output_dir = os.path.join(root, f"rank{rank}") if world > 1 else root
            try:
                os.makedirs(self.output_dir, exist_ok=True)
            except OSError as e:
                raise ValueError(f"neuron_config.tensor_capture.output_dir: cannot create {self.output_dir}: "
                                 f"{e.strerror}") from None
            logger.info("Tensor capture: %s (%d modules%s) -> %s", ", ".join(capture.modules),
                        len(self.taps.captured_names), " with inputs" if capture.capture_inputs else "",
                        self.output_dir)

    def graph_options(self) -> dict:
        """What changes the graphs (part of the compile-cache key)."""
        return {"capture": self.capture.graph_options() if self.capture is not None else None,
                "replace": sorted(self.replacements)}

    # -- before serving: the replaced modules' shapes -----------------------------------------------
    def prepare(self, run_eager_step: Callable[[], None]) -> None:
        """Checks the replacement tensors against the modules' outputs (one eager step on padding tells their
        features and dtype) and allocates the tables the graphs read: before any graph is compiled."""
        if not self.replacements:
            return
        with self.taps.probing():
            run_eager_step()
        for name, per_request in self.replacements.items():
            if name not in self.taps.shapes:
                raise ValueError(f"neuron_config.tensor_replacement: module {name!r} returns no tensor, so its "
                                 f"output cannot be replaced")
            features, dtype = self.taps.shapes[name]
            for req, t in per_request.items():
                if tuple(t.shape[1:]) != features:
                    key = name if req is None else f"{req}/{name}"
                    raise ValueError(f"neuron_config.tensor_replacement: {key!r} in {self.replace.file} is "
                                     f"{list(t.shape)}; the module's output is [positions, "
                                     f"{', '.join(map(str, features))}] ({str(dtype).removeprefix('torch.')})")
                per_request[req] = t.to(dtype)
            self.taps.tables.add(name, self.max_rows, features, dtype, self.device)
        logger.info("Tensor replacement: %s from %s (requests: %s)", ", ".join(self.replacements), self.replace.file,
                    "all" if self.replace.requests is None else ", ".join(self.replace.requests))

    # -- each step ----------------------------------------------------------------------------------
    def begin(self, chunks: Sequence, rows_per_seq: int | None) -> None:
        self._spans = step_rows(chunks, rows_per_seq)
        if not self.taps.tables.index:  # no replacement, or prepare() is probing the shapes
            return
        wanted = self.replace.requests
        for name, per_request in self.replacements.items():
            table, mask = self.taps.tables.table(name), self.taps.tables.mask(name)
            mask.zero_()
            for s in self._spans:
                src = per_request.get(s.req_id, per_request.get(None))
                if src is None or (wanted is not None and s.req_id not in wanted):
                    continue
                n = min(s.count, src.shape[0] - s.position)
                if n > 0:
                    table[s.row:s.row + n] = src[s.position:s.position + n]
                    mask[s.row:s.row + n] = True

    def end(self, kind: str, bucket: str, captured: dict[str, torch.Tensor] | None) -> None:
        spans, self._spans = self._spans, []
        for s in spans:
            step = self._steps.get(s.req_id, 0)
            self._steps[s.req_id] = step + 1
            if captured and self._wanted(s.req_id, step):
                self._write(s, step, kind, bucket, captured)

    def _wanted(self, req_id: str, step: int) -> bool:
        c = self.capture
        if c is None or (c.requests is not None and req_id not in c.requests) or \
                (c.steps is not None and step not in c.steps):
            return False
        if self._written >= c.max_captures:
            if self._written == c.max_captures:
                logger.warning("Tensor capture: max_captures (%d) request-steps written; capture stops",
                               c.max_captures)
                self._written += 1
            return False
        return True

    def write_media(self, bucket: str, size: int, items: Sequence, captured: dict[str, torch.Tensor],
                    patch_rows: torch.Tensor, token_rows: torch.Tensor) -> None:
        """An encoder graph's tapped tensors (`size` packed patch rows) per media item (`items`, in packing
        order), rows back in the item's own order: by patch for a tensor with a row per packed patch, by merged
        token for one with a row per packed token. Written to `media/<media hash>.safetensors` whatever
        `requests` / `steps` say."""
        from safetensors.torch import save_file

        merged = size * token_rows.shape[0] // max(patch_rows.shape[0], 1)  # packed token rows
        patch_start = token_start = 0
        for item in items:
            t, h, w = item.grid_thw
            p_idx = patch_rows[patch_start:patch_start + t * h * w]
            t_idx = token_rows[token_start:token_start + item.num_tokens]
            patch_start, token_start = patch_start + t * h * w, token_start + item.num_tokens
            if self._written >= self.capture.max_captures:
                continue
            tensors = {name: x.detach()[(p_idx if x.shape[0] == size else t_idx).to(x.device)].to("cpu").contiguous()
                       for name, x in captured.items() if x.shape[0] in (size, merged)}
            rel = os.path.join("media", f"{_safe(item.mm_hash)[:32]}.safetensors")
            os.makedirs(os.path.join(self.output_dir, "media"), exist_ok=True)
            save_file(tensors, os.path.join(self.output_dir, rel), metadata={"media": item.mm_hash, "bucket": bucket})
            self._manifest({"media": item.mm_hash, "kind": "encoder", "bucket": bucket, "file": rel,
                            "tensors": {n: [list(v.shape), str(v.dtype).removeprefix("torch.")]
                                        for n, v in tensors.items()}})

    def _manifest(self, entry: dict) -> None:
        with open(os.path.join(self.output_dir, "manifest.jsonl"), "a") as f:
            f.write(json.dumps(entry) + "\n")
        self._written += 1

    def _write(self, s: RowSpan, step: int, kind: str, bucket: str, captured: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        tensors = {n: t[s.row:s.row + s.count].detach().to("cpu").contiguous() for n, t in captured.items()}
        folder = os.path.join(self.output_dir, _safe(s.req_id))
        os.makedirs(folder, exist_ok=True)
        rel = os.path.join(_safe(s.req_id), f"step_{step:04d}.safetensors")
        save_file(tensors, os.path.join(self.output_dir, rel),
                  metadata={"request": s.req_id, "step": str(step), "kind": kind, "bucket": bucket,
                            "first_position": str(s.position)})
        entry = {"request": s.req_id, "step": step, "kind": kind, "bucket": bucket,
                 "positions": [s.position, s.position + s.count], "file": rel,
                 "tensors": {n: [list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in tensors.items()}}
        self._manifest(entry)
