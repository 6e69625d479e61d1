"""Benchmark clients. `bench serve`: vllm_neuron.benchmarks.serve (add_cli_args, main)."""

from typing import Any

__all__ = ["add_cli_args", "main"]


def __getattr__(name: str) -> Any:
    # Lazy, so `python -m vllm_neuron.benchmarks.serve` does not import serve twice.
    if name in __all__:
        from vllm_neuron.benchmarks import serve
        return getattr(serve, name)
    raise AttributeError(name)
