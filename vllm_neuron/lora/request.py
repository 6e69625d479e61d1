"""`LoRARequest`: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, integer id and PEFT folder. The id is the adapter's identity in the engine (its
    slot, its host cache entry, its prefix-cache key): two requests with the same id share the adapter's
    weights, so one id must always name one folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest lora_int_id must be an integer >= 1 (0 is the base model), got "
                             f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest lora_path must name the adapter's folder, got {self.lora_path!r}")

    # vLLM's aliases
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

    def cache_key(self) -> tuple:
        """What joins a request's prefix-cache keys: the same prompt under two adapters shares no block."""
        return ("lora", self.lora_int_id, self.lora_name)
