"""The module map's rules that code can check: import direction, no import cycles, module size, the runners'
shape, named graph inputs, and speculation and model kinds as components rather than branches."""
import ast
import inspect
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


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports, function-local imports included, `if TYPE_CHECKING:` blocks
    and the implicit imports of parent packages excluded."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for m, p in modules.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        tree = ast.parse(p.read_text())
        skip = {id(x) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                for b in n.body for x in ast.walk(b)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t != m:
                    edges[m].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle_through_a_function_local_import():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycles():
    found = cycles(import_graph(_modules()))
    assert not found, f"import cycles: {found}"


def test_config_imports_nothing_from_model_worker_or_engine():
    for path in sorted((PKG / "config").glob("*.py")):
        bad = [m for m in _imports(path) if m.startswith(("vllm_neuron.model", "vllm_neuron.worker",
                                                          "vllm_neuron.engine", "vllm_neuron.entrypoints"))]
        assert not bad, f"{path.name} imports {bad}"


def test_core_and_worker_are_siblings_and_model_knows_no_runner():
    for sub, banned in (("core", ("vllm_neuron.worker", "vllm_neuron.engine", "torch")),
                        ("worker", ("vllm_neuron.core", "vllm_neuron.engine", "vllm_neuron.entrypoints")),
                        ("model", ("vllm_neuron.worker", "vllm_neuron.engine", "vllm_neuron.core"))):
        for path in sorted((PKG / sub).rglob("*.py")):
            bad = [m for m in _imports(path) if m.startswith(banned)]
            assert not bad, f"{path.relative_to(PKG)} imports {bad}"


def test_modules_stay_well_under_600_lines():
    big = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) >= 600}
    assert not big, big


def test_model_runners_are_siblings_over_one_base():
    from vllm_neuron.worker.model_runner_v1 import ModelRunnerV1
    from vllm_neuron.worker.model_runner_v2 import ModelRunnerV2
    from vllm_neuron.worker.runner_base import ModelRunnerBase

    assert ModelRunnerV1.__bases__ == (ModelRunnerBase,) and ModelRunnerV2.__bases__ == (ModelRunnerBase,)
    for name in ("execute", "_make_graphs", "_run_prefill", "_run_decode"):
        assert name in vars(ModelRunnerV1) and name in vars(ModelRunnerV2), name
    assert not ModelRunnerV1.__subclasses__() and not ModelRunnerV2.__subclasses__()


def test_every_graph_takes_one_named_input():
    """A bucket graph takes one step-input dataclass, never positional tensors."""
    import dataclasses

    from vllm_neuron.worker import graphs, step_inputs

    for cls in (graphs.StepGraphs, graphs.SlotStepGraphs):
        for kind in ("prefill", "decode", "verify", "encode"):
            fn = getattr(cls, kind, None)
            if fn is None:
                continue
            params = list(inspect.signature(fn).parameters.values())
            assert [p.name for p in params] == ["self", "x"], (cls.__name__, kind)
            annotation = getattr(step_inputs, params[1].annotation)
            assert dataclasses.is_dataclass(annotation), (cls.__name__, kind)


def test_runners_do_not_branch_on_the_speculative_method_or_the_model_kind():
    """Speculation is a Speculator object and a model kind a ModelKindState: the runners and graphs never ask
    which method or kind they hold."""
    words = ("ngram", "eagle3", "dflash", "Eagle3", "DFlash", "multimodal", "mm_items", "rope_delta", ".method")
    for name in ("runner_base.py", "model_runner_v1.py", "model_runner_v2.py", "graphs.py"):
        code = "\n".join(line for line in (PKG / "worker" / name).read_text().splitlines()
                         if not line.lstrip().startswith("#"))
        for node in ast.walk(ast.parse(code)):  # docstrings may name them
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node):
                code = code.replace(ast.get_docstring(node, clean=False), "")
        found = [w for w in words if w in code]
        assert not found, (name, found)
