"""The package's architecture: imports flow one way, with no cycles, and the lower layers load without the
upper layers' dependencies (torch for the planner, deepspeed for the runtime).

Levels (a module may import its own subpackage and lower levels only):
  0 planner (numpy) | 1 sim, config, kernels | 2 runtime (torch) | 3 integrations (deepspeed, HF) | 4 cli, commands, hf
Imports are read from the source (every `import` statement, function-level ones included), so an import
that only runs on some paths counts too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ds_cobalt"
LEVELS = {"planner": 0, "sim": 1, "config": 1, "kernels": 1, "cuda": 1, "runtime": 2, "integrations": 3,
          "cli": 4, "commands": 4, "hf": 4}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """ds_cobalt modules that `name` imports (resolved to the longest known module name)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("ds_cobalt"):
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package's lazy __init__


def test_every_subpackage_has_a_level() -> None:
    parts = {_part(m) for m in _graph()} - {None}
    assert parts <= set(LEVELS), f"give these a level in tests/test_architecture.py: {sorted(parts - set(LEVELS))}"


def test_imports_flow_one_way() -> None:
    upward = []
    for module, deps in _graph().items():
        mine = _part(module)
        for dep in deps:
            theirs = _part(dep)
            if mine is None or theirs is None or mine == theirs:
                continue
            if LEVELS[theirs] >= LEVELS[mine]:
                upward.append(f"{module} -> {dep}")
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep.startswith(node + "."):  # a package importing its own modules (re-exports) is no cycle
                continue
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_upward_and_cyclic_imports(tmp_path, monkeypatch) -> None:
    """The rules above fail on a planted upward import and a planted cycle (so they can fail at all)."""
    fake = tmp_path / "ds_cobalt"
    for sub, text in {"planner/__init__.py": "", "planner/a.py": "from ..runtime import b\n",
                      "runtime/__init__.py": "", "runtime/b.py": "from ..planner import a\n",
                      "__init__.py": ""}.items():
        (fake / sub).parent.mkdir(parents=True, exist_ok=True)
        (fake / sub).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    with pytest.raises(AssertionError, match="ds_cobalt.planner.a -> ds_cobalt.runtime.b"):
        test_imports_flow_one_way()
    with pytest.raises(AssertionError, match="cycles"):
        test_no_import_cycles()


def _imports_without(blocked: str, code: str) -> subprocess.CompletedProcess:
    prog = (f"import sys; sys.modules[{blocked!r}] = None\n{code}\n"
            f"assert {blocked!r} not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    return subprocess.run([sys.executable, "-c", prog], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_planner_and_cli_import_without_torch() -> None:
    res = _imports_without("torch", "import ds_cobalt.planner, ds_cobalt.sim, ds_cobalt.cli\n"
                                    "import ds_cobalt.commands.plan, ds_cobalt.commands.simulate, "
                                    "ds_cobalt.commands.trace")
    assert res.returncode == 0, res.stderr


def test_runtime_imports_without_deepspeed() -> None:
    res = _imports_without("deepspeed", "import ds_cobalt.runtime.layer, ds_cobalt.runtime.dispatch, "
                                        "ds_cobalt.runtime.overlap, ds_cobalt.runtime.replicas")
    assert res.returncode == 0, res.stderr
