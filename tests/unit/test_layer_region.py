"""layer_region: a nested compile region, or the layer's ops inlined into the graph under inlined_layers()."""
from __future__ import annotations

import torch

from vllm_neuron.model.layer_region import inlined_layers, layer_region


@layer_region
def _layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w) + x


def _stack(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    for w in ws:
        x = _layer(x, w)
    return x


def _traced_targets(inline: bool) -> list[str]:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(_stack, backend=backend, fullgraph=True)
    x, ws = torch.randn(2, 8), [torch.randn(8, 8) for _ in range(3)]
    if inline:
        with inlined_layers():
            out = fn(x, ws)
    else:
        out = fn(x, ws)
    torch.testing.assert_close(out, _stack(x, ws))
    return [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]


def test_layers_are_one_region_by_default_and_inlined_on_request():
    region = _traced_targets(inline=False)
    inlined = _traced_targets(inline=True)
    assert sum("invoke_subgraph" in t for t in region) == 3
    assert not any("invoke_subgraph" in t for t in inlined)
    assert sum("relu" in t for t in inlined) == 3


def test_inlined_layers_restores_the_previous_mode():
    import vllm_neuron.model.layer_region as lr

    with inlined_layers():
        with inlined_layers():
            assert lr._inline
        assert lr._inline
    assert not lr._inline
