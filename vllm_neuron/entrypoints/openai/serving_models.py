"""Served model names and LoRA adapters: /v1/models, the `model` field check (404 for an unknown name) and the
adapter a name selects; /v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING).

Adapters live here, in the API server, as name -> LoRARequest: registering one checks its folder against the
base model (lora/peft_adapter.py) and gives it a fresh id; each engine reads the folder when a request first
needs it. Unloading removes the name only: requests already running keep their LoRARequest, so they finish
with the adapter they started with, while new requests naming it get a 404.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from vllm_neuron.config.lora import LoRAModulePath
from vllm_neuron.entrypoints.openai.errors import BadRequestError, NotFoundError
from vllm_neuron.entrypoints.openai.protocol import ModelCard, ModelList, ModelPermission
from vllm_neuron.lora.peft_adapter import AdapterChecker
from vllm_neuron.lora.request import LoRARequest


class OpenAIServingModels:
    def __init__(self, served_model_names: list[str], model_path: str, max_model_len: int,
                 lora_modules: Sequence[LoRAModulePath] = (), lora_checker: AdapterChecker | None = None) -> None:
        if not served_model_names or not all(isinstance(n, str) and n for n in served_model_names):
            raise ValueError(f"served_model_names must be a non-empty list of non-empty strings, "
                             f"got {served_model_names!r}")
        self.served_model_names = list(served_model_names)
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.lora_checker = lora_checker
        self.lora: dict[str, LoRARequest] = {}
        self._parents: dict[str, str] = {}
        self._ids = itertools.count(1)
        if lora_modules and lora_checker is None:
            raise ValueError("lora_modules needs an engine with LoRA enabled (--enable-lora)")
        for m in lora_modules:  # a bad adapter stops the server at start, naming it
            self.add_lora(m.name, m.path, m.base_model_name)

    @property
    def default_name(self) -> str:
        return self.served_model_names[0]

    def resolve(self, name: str | None) -> str:
        """The name to echo in responses; a missing `model` means the first served name."""
        if name is None or name == "":
            return self.default_name
        if name not in self.served_model_names and name not in self.lora:
            raise NotFoundError(f"The model `{name}` does not exist.", param="model")
        return name

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The adapter `name` (a resolved model name) selects; None for the base model's names."""
        return self.lora.get(name) if name else None

    def list_models(self) -> ModelList:
        base = [ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len,
                          permission=[ModelPermission()]) for name in self.served_model_names]
        adapters = [ModelCard(id=name, root=lr.lora_path, parent=self._parents[name], max_model_len=self.max_model_len,
                              permission=[ModelPermission()]) for name, lr in self.lora.items()]
        return ModelList(data=base + adapters)

    # -- adapters ----------------------------------------------------------------------------------
    def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Registers an adapter after checking its folder (ValueError naming what does not fit)."""
        if self.lora_checker is None:
            raise ValueError("LoRA is not enabled on this server (start it with --enable-lora)")
        if name in self.lora or name in self.served_model_names:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        if base_model_name is not None and base_model_name not in self.served_model_names:
            raise ValueError(f"base_model_name {base_model_name!r} of adapter {name!r} is not a served model name "
                             f"({', '.join(self.served_model_names)})")
        lr = LoRARequest(name, next(self._ids), path)
        self.lora_checker.check(lr)
        self.lora[name] = lr
        self._parents[name] = base_model_name or self.default_name
        return lr

    def load_lora_adapter(self, body: dict) -> str:
        """/v1/load_lora_adapter: {"lora_name", "lora_path"} -> vLLM's success line (BadRequestError)."""
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise BadRequestError("Both 'lora_name' and 'lora_path' must be provided.")
        if body.get("load_inplace"):
            raise BadRequestError("load_inplace is not supported: unload the adapter, then load the new folder",
                                  param="load_inplace")
        try:
            self.add_lora(name, path)
        except ValueError as e:
            raise BadRequestError(str(e), param="lora_path" if "already" not in str(e) else "lora_name") from None
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora_adapter(self, body: dict) -> str:
        """/v1/unload_lora_adapter: {"lora_name"}; running requests of the adapter finish with it."""
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise BadRequestError("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
        lr = self.lora.pop(name, None)
        if lr is None:
            raise NotFoundError(f"The lora adapter '{name}' cannot be found.", param="lora_name")
        self._parents.pop(name, None)
        self.lora_checker.forget(lr)
        return f"Success: LoRA adapter '{name}' removed successfully."
