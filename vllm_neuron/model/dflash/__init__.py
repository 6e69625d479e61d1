"""DFlash block-parallel draft (z-lab's `DFlashDraftModel` / speculators' dflash checkpoints) for speculative
decoding."""
from vllm_neuron.model.dflash.config import DFlashConfig, read_dflash_config
from vllm_neuron.model.dflash.model import DFlashDraftModel, load_dflash_draft

__all__ = ["DFlashConfig", "DFlashDraftModel", "load_dflash_draft", "read_dflash_config"]
