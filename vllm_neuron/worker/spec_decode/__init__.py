"""Speculative decoding: one `Speculator` per method (base.py), chosen once at start-up by `make_speculator`.

ngram.py (+ ngram_proposer.py, pure) proposes on the host; eagle3.py and dflash.py carry a draft model inside
every bucket graph (draft_model.py: what they share); verify_inputs.py builds a verification step's inputs.
"""
from __future__ import annotations

from vllm_neuron.config.speculative import SpeculativeConfig
from vllm_neuron.worker.spec_decode.base import Speculator, Target
from vllm_neuron.worker.spec_decode.dflash import DFlashSpeculator
from vllm_neuron.worker.spec_decode.eagle3 import Eagle3Speculator
from vllm_neuron.worker.spec_decode.ngram import NgramSpeculator

_METHODS: dict[str, type[Speculator]] = {"ngram": NgramSpeculator, "eagle3": Eagle3Speculator,
                                         "dflash": DFlashSpeculator}


def make_speculator(spec: SpeculativeConfig | None, max_model_len: int) -> Speculator | None:
    """The speculator of `spec.method` (None: no speculative decoding)."""
    if spec is None:
        return None
    return _METHODS[spec.method](spec, max_model_len)


__all__ = ["Speculator", "Target", "make_speculator"]
