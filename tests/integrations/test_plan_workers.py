"""The re-planning worker process (integrations/plan_workers.py, planner/worker.py), one process, no ranks:
same decisions as planning in-process, a killed or overrunning worker reported and replaced, a policy the
worker cannot import planned in a thread instead, no worker outliving its parent, no pickle read from a request."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from ds_cobalt.integrations.plan_workers import ProcessPlanner, ThreadPlanner, WorkerUnavailable, make_planner
from ds_cobalt.planner import LinkModel, register_policy
from ds_cobalt.planner.decisions import LayerStats
from ds_cobalt.planner.worker import plan_layers

HERE = Path(__file__).resolve().parent
E, K, W = 16, 2, 4


def _request(seed: int) -> tuple[LayerStats, np.ndarray]:
    rng = np.random.default_rng(seed)
    hot = rng.permutation(E)[:6]  # skewed routing, so the planner moves owners
    samples = np.stack([rng.choice(hot if rng.random() < 0.7 else E, K, replace=False) for _ in range(512)])
    load = np.bincount(samples.ravel(), minlength=E).astype(np.float64)
    return LayerStats(load, np.zeros((E, E)), 512, samples, np.arange(512) % W), np.arange(E).reshape(W, -1)


def _params(policy: str = "cobalt") -> dict:
    return {"nodes": 2, "gpus_per_node": 2, "policy": policy, "redundant_slots": 1, "seed": 3, "interval": 10,
            "ignore_cost_model": True, "link": asdict(LinkModel())}


def _submit(planner, tag: str, layer_ids: list[int], policy: str = "cobalt") -> None:
    reqs = [_request(i) for i in layer_ids]
    planner.submit(tag, layer_ids, [r[0] for r in reqs], [r[1] for r in reqs], [512.0] * len(reqs), _params(policy))


@pytest.fixture
def slow(monkeypatch, tmp_path) -> Path:
    """tests/integrations/slow_policy.py sleeps in its first plan (here: this process is 'rank 0')."""
    monkeypatch.syspath_prepend(str(HERE))
    import slow_policy  # noqa: F401 - registers test_slow_shuffle

    mark = tmp_path / "sleeping"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("DS_COBALT_TEST_SLOW_RANK", "0")
    monkeypatch.setenv("DS_COBALT_TEST_SLOW_MARK", str(mark))
    return mark


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (not yet reaped) is gone too
        return f.read().split(") ")[1][0] != "Z"


def test_worker_plans_what_the_training_process_would() -> None:
    planner = ProcessPlanner("cobalt")
    try:
        _submit(planner, "a", [0, 5])
        folder = planner._request.parent
        assert folder.is_dir()
        decisions, seconds, error = planner.collect(120)
        assert error is None and seconds > 0
        reqs = [_request(0), _request(5)]
        expected = plan_layers([0, 5], [r[0] for r in reqs], [r[1] for r in reqs], [512.0] * 2, _params())
        assert sorted(decisions) == [0, 5]
        for lid, d in expected.items():
            assert decisions[lid].action == d.action and decisions[lid].saving_s == d.saving_s
            np.testing.assert_array_equal(decisions[lid].slots_WS, d.slots_WS)
        assert any(d.action != 0 for d in expected.values())  # a real plan, not "keep"
        assert not folder.exists()  # the request's folder, with request and result, is removed
        proc, t0 = planner._proc, time.monotonic()
        planner.close()  # returns at once; the worker is killed and reaped in a thread
        assert time.monotonic() - t0 < 0.1 and planner._proc is None
        deadline = time.monotonic() + 30
        while (_alive(proc.pid) or proc.returncode is None) and time.monotonic() < deadline:
            time.sleep(0.05)
        # SIGKILL, not an orderly exit (the interpreter's teardown after numba costs ~0.5 s of CPU)
        assert not _alive(proc.pid) and proc.returncode == -signal.SIGKILL
    finally:
        planner.close()


@pytest.mark.parametrize("fault", ["killed", "overran"])
def test_failed_worker_is_reported_stopped_and_replaced(slow: Path, fault: str) -> None:
    planner = ProcessPlanner("test_slow_shuffle", "slow_policy")
    try:
        _submit(planner, "1", [2], policy="test_slow_shuffle")
        pid, folder = planner._proc.pid, planner._request.parent
        deadline = time.monotonic() + 60
        while not slow.exists() and time.monotonic() < deadline:  # the worker is inside the policy
            time.sleep(0.05)
        assert slow.exists()
        if fault == "killed":
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        decisions, _, error = planner.collect(1.0 if fault == "overran" else 60)
        assert decisions == {}
        assert error == ("the planner worker was killed by SIGKILL" if fault == "killed"
                         else "the planner worker ran past 1 s and was stopped")
        assert time.monotonic() - t0 < 10 and not _alive(pid) and not folder.exists()
        _submit(planner, "2", [2], policy="test_slow_shuffle")  # the next interval: a new worker, no sleep
        decisions, _, error = planner.collect(120)
        assert error is None and sorted(decisions) == [2] and planner._proc.pid != pid
    finally:
        planner.close()


def test_policy_the_worker_cannot_import_is_planned_in_a_thread() -> None:
    @register_policy("test_local_only")
    def local_only(inp):  # registered when this test runs, not when its module is imported
        return inp.current_slots_WS

    planner = ProcessPlanner("test_local_only", __name__)
    try:
        _submit(planner, "x", [0], policy="test_local_only")  # submit does not wait for the worker's start
        with pytest.raises(WorkerUnavailable, match="'test_local_only' is not registered after importing"):
            planner.collect(60)
    finally:
        planner.close()
    planner = ProcessPlanner("test_local_only", __name__)
    try:  # the refusal already in: the next submit raises it
        deadline = time.monotonic() + 60
        while planner._lines.empty() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(WorkerUnavailable, match="'test_local_only' is not registered after importing"):
            _submit(planner, "y", [0], policy="test_local_only")
    finally:
        planner.close()
    # the training side (`Replanner`): a refusal found at collect plans that same request in a thread
    from ds_cobalt.config import PlannerConfig
    from ds_cobalt.integrations.replan import Replanner

    replanner = Replanner.__new__(Replanner)
    replanner.cfg, replanner._planner = PlannerConfig(policy="test_local_only"), ProcessPlanner("test_local_only",
                                                                                                 __name__)
    reqs = [_request(0)]
    request = ("z", [0], [reqs[0][0]], [reqs[0][1]], [512.0], _params("test_local_only"))
    replanner._submit(request)
    decisions, _, error = replanner._collect(request)
    assert error is None and isinstance(replanner._planner, ThreadPlanner)
    np.testing.assert_array_equal(decisions[0].slots_WS[:, :E // W], reqs[0][1])  # local_only keeps the owners
    local_only.__module__ = "__main__"
    said: list[str] = []
    assert isinstance(make_planner("process", "test_local_only", said.append), ThreadPlanner)
    assert "defined in __main__" in said[0]
    assert isinstance(make_planner("thread", "cobalt", said.append), ThreadPlanner) and len(said) == 1


def test_request_with_a_pickle_is_refused(tmp_path: Path) -> None:
    planner = ProcessPlanner("cobalt")
    try:
        _submit(planner, "ok", [0])
        assert planner.collect(120)[2] is None
        crafted = tmp_path / "request-evil.npz"
        np.savez(crafted, params=np.array([object()], dtype=object), layer_ids=np.array([object()], dtype=object))
        planner._request = crafted
        planner._proc.stdin.write(f"{crafted}\n")
        planner._proc.stdin.flush()
        decisions, _, error = planner.collect(60)
        assert decisions == {} and "allow_pickle=False" in error
    finally:
        planner.close()


def test_worker_dies_with_its_parent(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import sys, time
        from ds_cobalt.integrations.plan_workers import ProcessPlanner
        planner = ProcessPlanner("cobalt")
        print(planner._proc.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        assert _alive(worker)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker)
    finally:
        parent.kill()


_KEPT: list = []  # a planner alive at the child's exit, as an engine's is


def _submit_and_exit(pipe) -> None:
    planner = ProcessPlanner("cobalt")
    _KEPT.append(planner)
    _submit(planner, "12", [0])
    pipe.send(str(planner._request.parent))


def test_request_in_flight_at_a_multiprocessing_childs_exit_leaves_no_folder() -> None:
    """mp.spawn-style ranks end with os._exit, which skips atexit: the folder of a request still in flight is
    removed by multiprocessing's own exit finalizers."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_submit_and_exit, args=(send,))
    child.start()
    folder = Path(receive.recv())
    child.join(60)
    assert child.exitcode == 0
    assert folder.name.startswith("ds_cobalt_planner_") and not folder.exists()
