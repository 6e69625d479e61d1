"""What the speculators with a draft model inside the graphs share (EAGLE3, DFlash): loading the draft beside a
target whose layers can be tapped, the draft's place in the compile-cache key, and proposals taken from the
graph's draft rows (no host round trip to propose)."""
from __future__ import annotations

import torch

from vllm_neuron.logger import init_logger
from vllm_neuron.model.layers.kernel_config import apply_kernel_config
from vllm_neuron.model.llama.model import LlamaModel
from vllm_neuron.worker.sampling_state import RequestState
from vllm_neuron.worker.spec_decode.base import Speculator, Target

logger = init_logger(__name__)


class DraftModelSpeculator(Speculator):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.draft = None
        self.aux_layers: tuple[int, ...] = ()

    def _load_draft(self, target: Target) -> tuple[torch.nn.Module, int, str]:
        """(draft model, bytes, a description for the log)."""
        raise NotImplementedError

    def load(self, target: Target) -> int:
        if type(getattr(target.model, "model", None)).forward is not LlamaModel.forward:
            raise ValueError(f"speculative_config.method={self.method!r} needs a target whose layers' hidden states "
                             f"can be tapped (Llama, Qwen3, Qwen3-MoE, gpt-oss); {type(target.model).__name__} is "
                             "not one")
        self.draft, nbytes, what = self._load_draft(target)
        apply_kernel_config(self.draft, target.kernels)
        self.aux_layers = self.draft.cfg.aux_layers(target.num_layers)
        logger.info("%s draft %s: target layers %s tapped, %s, %.1f MiB; drafts come out of every bucket graph",
                    self.method.upper(), self.spec.model, list(self.aux_layers), what, nbytes / 2**20)
        return nbytes

    def graph_options(self) -> dict:
        return {self.method: {"config": self.draft.cfg.raw, "aux_layers": self.aux_layers, "k": self.k}}

    def kv_groups_unsupported(self) -> str | None:
        # The graphs run the target with one metadata and one K/V pair per layer when a draft rides along.
        return f"{self.method.upper()} speculative decoding"

    def propose(self, states: dict[str, RequestState], wanted: list[str], rows: dict[str, int],
                graph_drafts: torch.Tensor | None) -> dict[str, list[int]]:
        drafts = graph_drafts.tolist()
        return {rid: drafts[rows[rid]] for rid in wanted if self.eligible(states.get(rid))}
