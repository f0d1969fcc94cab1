"""The planner's numba kernels come from a cache that one process compiled whole (`planner/kernel_cache.py`).

Each test starts from an empty cache directory (`NUMBA_CACHE_DIR`) and runs `ds-cobalt plan` in fresh
processes with bounds checks on, so that a kernel loaded from a cache it should not trust raises IndexError
instead of reading memory it does not own. Before the shared build, a 1-node plan followed by a 2-node plan with
a spare slot failed there on every run (the second process loaded the kernels the first had cached and compiled
the rest itself).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds_cobalt.planner import kernel_cache
from ds_cobalt.planner.layout import load_layout
from ds_cobalt.planner.policies import plan_layout
from ds_cobalt.planner.trace import load_trace

REPO = Path(__file__).resolve().parents[2]
BUILD_MESSAGE = "compiling the planner's kernels"


def _traces(directory: Path) -> dict[str, Path]:
    """A 1-node trace (k = 1, 4 experts, gate weights) and a 2-node one (k = 2, 8 experts, source ranks), some
    routes dropped, drawn in this order from one generator: the pair that failed before the shared build."""
    rng = np.random.default_rng(0)
    out = {}
    for name, layers, tokens, top_k, experts in (("one_node", 1, 100, 1, 4), ("two_nodes", 2, 200, 2, 8)):
        experts_LTK = np.stack([np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
                                for _ in range(layers)]).astype(np.int64)
        experts_LTK[:, ::7, -1] = -1
        extra = ({"weights": rng.random((layers, tokens, top_k)).astype(np.float32)} if name == "one_node"
                 else {"source_rank": rng.integers(0, 4, tokens)})
        out[name] = directory / f"{name}.npz"
        np.savez(out[name], experts=experts_LTK, num_experts=np.int64(experts), **extra)
    return out


def _env(cache: Path) -> dict[str, str]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "NUMBA_BOUNDSCHECK": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _plan_cmd(trace: Path, nodes: int, gpus: int, spare: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "ds_cobalt.cli", "plan", "--trace", str(trace), "--nodes", str(nodes),
            "--gpus-per-node", str(gpus), "--redundant-slots", str(spare), "--out", str(out)]


def _cache_files(cache: Path) -> dict[str, int]:
    return {str(p.relative_to(cache)): p.stat().st_mtime_ns for p in cache.rglob("*.nb[ic]")}


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _traces(tmp_path_factory.mktemp("traces"))


def test_plans_after_a_partial_cache_are_those_of_one_process(traces: dict[str, Path], tmp_path: Path) -> None:
    cache = tmp_path / "numba"
    first = subprocess.run(_plan_cmd(traces["one_node"], 1, 4, 0, tmp_path / "a.json"), env=_env(cache),
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stderr.count(BUILD_MESSAGE) == 1  # the first kernel import compiled them all
    stamps = list(cache.rglob(kernel_cache.STAMP_NAME))
    assert len(stamps) == 1 and stamps[0].read_text() == _stamp_in(cache)
    built = _cache_files(cache)
    second = subprocess.run(_plan_cmd(traces["two_nodes"], 2, 2, 1, tmp_path / "b.json"), env=_env(cache),
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert BUILD_MESSAGE not in second.stderr
    assert _cache_files(cache) == built, "a kernel compiled outside the build (kernel_build.compile_all misses it)"
    # the same plan as this process computes with its own cache
    expected = plan_layout(load_trace(traces["two_nodes"]), 2, 2, 1, "cobalt")
    np.testing.assert_array_equal(load_layout(tmp_path / "b.json").slots_LWS, expected.slots_LWS)


def _stamp_in(cache: Path) -> str:
    """The stamp a process with this cache directory and bounds checks on writes."""
    code = "from ds_cobalt.planner import kernel_cache; print(kernel_cache.stamp())"
    return subprocess.run([sys.executable, "-c", code], env=_env(cache), capture_output=True, text=True,
                          check=True).stdout.rstrip("\n")


class _Dispatcher:
    """Stands for a `cache=True` kernel whose cache lives in `path`."""

    def __init__(self, path: Path) -> None:
        self._cache = type("Cache", (), {"_cache_path": str(path)})()


def test_stale_stamp_rebuilds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stamp from other sources (an upgrade), or none (a cache written before the shared build): the old cache
    files of the kernels go, one build runs, its stamp is written, and later imports only check it."""
    builds = []

    def fake_build(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        builds.append(cmd)
        assert kwargs["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)  # the child imports this copy
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(kernel_cache.subprocess, "run", fake_build)
    monkeypatch.setattr(kernel_cache, "_checked", set())
    old = tmp_path / "_stage2_kernels.pack_items-37.py311.1.nbc"
    other = tmp_path / "someone_else.f-1.py311.1.nbc"
    for path in (old, other):
        path.write_bytes(b"compiled by another process")
    (tmp_path / kernel_cache.STAMP_NAME).write_text("{}")
    kernel_cache.ensure_built(_Dispatcher(tmp_path))
    assert builds == [[sys.executable, "-m", "ds_cobalt.planner.kernel_build"]]
    assert not old.exists() and other.exists()
    assert (tmp_path / kernel_cache.STAMP_NAME).read_text() == kernel_cache.stamp()
    kernel_cache.ensure_built(_Dispatcher(tmp_path))  # checked in this process
    monkeypatch.setattr(kernel_cache, "_checked", set())
    kernel_cache.ensure_built(_Dispatcher(tmp_path))  # a new process: the stamp holds
    assert len(builds) == 1


def test_concurrent_cold_starts_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two cold starts at once (threads here; ranks' planner workers and CLI runs in practice): the file lock
    makes the second wait for the first one's build and then find its stamp."""
    import threading
    import time

    builds = []

    def slow_build(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        builds.append(cmd)
        time.sleep(0.5)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(kernel_cache.subprocess, "run", slow_build)
    monkeypatch.setattr(kernel_cache, "_checked", set())
    starts = [threading.Thread(target=kernel_cache.ensure_built, args=(_Dispatcher(tmp_path),)) for _ in range(2)]
    for start in starts:
        start.start()
    for start in starts:
        start.join(timeout=60)
    assert len(builds) == 1
    assert (tmp_path / kernel_cache.STAMP_NAME).read_text() == kernel_cache.stamp()


def test_failed_build_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_cache.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, -11, "", "Segmentation fault"))
    monkeypatch.setattr(kernel_cache, "_checked", set())
    with pytest.raises(RuntimeError, match=r"exit code -11.*\n.*Segmentation fault"):
        kernel_cache.ensure_built(_Dispatcher(tmp_path))
    assert not (tmp_path / kernel_cache.STAMP_NAME).exists()
