"""Fixtures the unit tests of the CPU kernels share."""
import pytest
import torch


@pytest.fixture
def sampler_kernels():
    """The CPU sampler kernels (kernels/sampler.cpp) built: the tests pass use_kernels=True, as an
    engine's KernelConfig.sampler does."""
    from vllm_neuron.model.layers.kernels import cpu_caps

    assert cpu_caps.kernels_enabled(torch.device("cpu")), "the custom CPU kernels failed to build (see the log)"
