"""The module map's rules that code can check: import direction and the runners' shape."""
import ast
from pathlib import Path

import vllm_neuron

PKG = Path(vllm_neuron.__file__).parent


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_config_imports_nothing_from_model_worker_or_engine():
    for path in sorted((PKG / "config").glob("*.py")):
        bad = [m for m in _imports(path) if m.startswith(("vllm_neuron.model", "vllm_neuron.worker",
                                                          "vllm_neuron.engine", "vllm_neuron.entrypoints"))]
        assert not bad, f"{path.name} imports {bad}"


def test_model_runners_are_siblings_over_one_base():
    from vllm_neuron.worker.model_runner_v1 import ModelRunnerV1
    from vllm_neuron.worker.model_runner_v2 import ModelRunnerV2
    from vllm_neuron.worker.runner_base import ModelRunnerBase

    assert ModelRunnerV1.__bases__ == (ModelRunnerBase,) and ModelRunnerV2.__bases__ == (ModelRunnerBase,)
    for name in ("execute", "_make_graphs", "_run_prefill", "_run_decode"):
        assert name in vars(ModelRunnerV1) and name in vars(ModelRunnerV2), name
