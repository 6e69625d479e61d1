"""Served model names: /v1/models and the `model` field check (404 for an unknown name)."""
from __future__ import annotations

from vllm_neuron.entrypoints.openai.errors import NotFoundError
from vllm_neuron.entrypoints.openai.protocol import ModelCard, ModelList, ModelPermission


class OpenAIServingModels:
    def __init__(self, served_model_names: list[str], model_path: str, max_model_len: int) -> None:
        if not served_model_names or not all(isinstance(n, str) and n for n in served_model_names):
            raise ValueError(f"served_model_names must be a non-empty list of non-empty strings, "
                             f"got {served_model_names!r}")
        self.served_model_names = list(served_model_names)
        self.model_path = model_path
        self.max_model_len = max_model_len

    @property
    def default_name(self) -> str:
        return self.served_model_names[0]

    def resolve(self, name: str | None) -> str:
        """The name to echo in responses; a missing `model` means the first served name."""
        if name is None or name == "":
            return self.default_name
        if name not in self.served_model_names:
            raise NotFoundError(f"The model `{name}` does not exist.", param="model")
        return name

    def list_models(self) -> ModelList:
        return ModelList(data=[
            ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len,
                      permission=[ModelPermission()])
            for name in self.served_model_names
        ])
