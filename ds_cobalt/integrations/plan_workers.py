"""Where a rank plans its share of the layers: a worker process (default) or a thread.

`ProcessPlanner` keeps one `python -m ds_cobalt.planner.worker` per rank (the replanner starts it with the
engine and waits for its imports and numba kernels there), hands it a request file per re-plan and reads the
decisions back. `submit` never waits: a request sent before the
worker is ready waits in its stdin, and `collect` waits for the start (at most `start_timeout_s`), then for
the plan. A worker that dies or runs past the deadline is stopped and started again at the next re-plan;
`collect` then reports the error and returns no decisions, so the caller keeps those layers as they are. A
worker that cannot import the policy raises `WorkerUnavailable` from `submit` or `collect`: the caller plans
in a thread instead. `ThreadPlanner` runs the same pure function in a thread of the training process (for a
policy the worker cannot import, such as one defined in `__main__`).
"""

from __future__ import annotations

import json
import multiprocessing.util
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..planner.decisions import LayerDecision, LayerStats
from ..planner.policies import POLICIES
from ..planner.worker import PlanParams, plan_layers, read_result, result_path, write_request

__all__ = ["LayerPlanner", "PlanOutcome", "ProcessPlanner", "ThreadPlanner", "WorkerUnavailable", "make_planner",
           "policy_module"]

PlanOutcome = tuple[dict[int, LayerDecision], float, str | None]  # decisions, seconds, error (None = ok)


class WorkerUnavailable(RuntimeError):
    """The worker process cannot plan this policy (it could not import it); plan in a thread instead."""


class LayerPlanner(Protocol):
    def submit(self, tag: str, layer_ids: list[int], stats: list[LayerStats], currents: list[np.ndarray],
               tokens_per_step: list[float], params: PlanParams) -> None: ...

    def collect(self, timeout_s: float) -> PlanOutcome: ...

    def wait_ready(self) -> str | None: ...

    def close(self) -> None: ...


def policy_module(policy: str) -> str | None:
    """The module whose import registers `policy` (None: a built-in one; '__main__': none a worker can import)."""
    module = getattr(POLICIES[policy], "__module__", None)
    return None if module is None or module.startswith("ds_cobalt.planner") else module


class ThreadPlanner:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._outcome: PlanOutcome = ({}, 0.0, None)

    def submit(self, tag: str, layer_ids: list[int], stats: list[LayerStats], currents: list[np.ndarray],
               tokens_per_step: list[float], params: PlanParams) -> None:
        def work() -> None:
            t0 = time.perf_counter()
            try:
                self._outcome = (plan_layers(layer_ids, stats, currents, tokens_per_step, params),
                                 time.perf_counter() - t0, None)
            except Exception:  # noqa: BLE001 - a planner failure must not kill training
                self._outcome = ({}, time.perf_counter() - t0, traceback.format_exc())

        self._outcome = ({}, 0.0, "no plan was submitted")
        self._thread = threading.Thread(target=work, name=f"ds_cobalt-replan-{tag}", daemon=True)
        self._thread.start()

    def collect(self, timeout_s: float) -> PlanOutcome:
        thread, self._thread = self._thread, None
        if thread is None:
            return {}, 0.0, "no plan was submitted"
        thread.join(timeout_s)
        if thread.is_alive():  # a thread cannot be stopped: its result is dropped
            return {}, timeout_s, f"the planner thread ran past {timeout_s:g} s"
        return self._outcome

    def wait_ready(self) -> str | None:
        return None  # nothing to start

    def close(self) -> None:
        self._thread = None


class ProcessPlanner:
    """One worker process; see the module docstring. Not thread-safe (the step hook is its only caller)."""

    def __init__(self, policy: str, module: str | None = None, start_timeout_s: float = 120.0) -> None:
        self._policy, self._module, self._start_timeout_s = policy, module, start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._lines: queue.Queue[dict | None] = queue.Queue()
        self._ready = False
        self._request: Path | None = None
        self._remove_request: multiprocessing.util.Finalize | None = None  # removes the request's folder (once)
        self._spawn()

    # ----- the process -----
    def _spawn(self) -> None:
        cmd = [sys.executable, "-m", "ds_cobalt.planner.worker", "--policy", self._policy]
        if self._module:
            cmd += ["--policy-module", self._module]
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([package_root, *(p for p in sys.path if p)]))
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                      env=env, cwd=os.getcwd())
        self._lines = queue.Queue()
        self._ready = False
        threading.Thread(target=self._read, args=(self._proc, self._lines), daemon=True,
                         name="ds_cobalt-planner-reader").start()

    @staticmethod
    def _read(proc: subprocess.Popen, lines: queue.Queue) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                lines.put(json.loads(line))
            except json.JSONDecodeError:  # a stray print in a user's policy module
                continue
        lines.put(None)

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def _exit_reason(self) -> str:
        proc = self._proc
        code = proc.wait(timeout=5) if proc is not None else None
        if code is not None and code < 0:
            return f"the planner worker was killed by {signal.Signals(-code).name}"
        return f"the planner worker exited with code {code}"

    def _next(self, deadline: float) -> dict | None | str:
        """The worker's next message; None when it is gone; 'timeout' past the deadline."""
        try:
            return self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return "timeout"

    def _note_ready(self, msg: dict) -> None:
        if not msg["ready"]:
            self._stop()
            raise WorkerUnavailable(str(msg.get("error")))
        self._ready = True

    def _poll_ready(self) -> None:
        """Take the worker's start-up message if it has come (never waits)."""
        while not self._ready:
            try:
                msg = self._lines.get_nowait()
            except queue.Empty:
                return
            if msg is None:  # gone before it was ready: left for `collect` to report, or `submit` starts another
                self._lines.put(None)
                return
            if "ready" in msg:
                self._note_ready(msg)

    def _wait_ready(self, deadline: float) -> str | None:
        """Wait until the worker said it is ready (started steps before the re-plan, it usually has); the reason
        when it did not start (the next re-plan starts another)."""
        while not self._ready:
            msg = self._next(deadline)
            if msg == "timeout" or msg is None:
                reason = "did not start in time" if msg else self._exit_reason()
                self._stop()
                return f"the planner worker {reason}"
            if "ready" in msg:
                self._note_ready(msg)
        return None

    def wait_ready(self) -> str | None:
        """Wait at most `start_timeout_s` for the worker's start: None once it is ready, else why not (the next
        `submit` starts another). A worker that cannot import the policy raises `WorkerUnavailable`."""
        return self._wait_ready(time.monotonic() + self._start_timeout_s)

    # ----- requests -----
    def submit(self, tag: str, layer_ids: list[int], stats: list[LayerStats], currents: list[np.ndarray],
               tokens_per_step: list[float], params: PlanParams) -> None:
        self._poll_ready()
        if self._proc is None or self._proc.poll() is not None:
            self._stop()
            self._spawn()  # the retry after a worker that died or overran
        self._forget_request()  # a request never collected
        # one folder per request, removed by `collect`, or at exit for a request never collected: multiprocessing's
        # finalizers run at a normal exit and also in its children (mp.spawn-style ranks), which end with
        # os._exit and skip atexit
        folder = tempfile.mkdtemp(prefix="ds_cobalt_planner_")
        self._request = Path(folder) / f"request-{tag}.npz"
        self._remove_request = multiprocessing.util.Finalize(self, shutil.rmtree, args=(folder, True), exitpriority=0)
        write_request(self._request, layer_ids, stats, currents, tokens_per_step, params)
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(f"{self._request}\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # collect() reports the exit

    def collect(self, timeout_s: float) -> PlanOutcome:
        request, self._request = self._request, None
        if request is None:
            return {}, 0.0, "no plan was submitted"
        t0 = time.monotonic()
        try:
            not_started = self._wait_ready(t0 + self._start_timeout_s)
            if not_started is not None:
                return {}, time.monotonic() - t0, not_started
            deadline = time.monotonic() + timeout_s  # the plan's own time, from the worker's start
            while True:
                msg = self._next(deadline)
                if msg == "timeout":
                    self._stop()
                    return {}, timeout_s, f"the planner worker ran past {timeout_s:g} s and was stopped"
                if msg is None:
                    reason = self._exit_reason()
                    self._stop()
                    return {}, time.monotonic() - t0, reason
                if msg.get("done") != str(request):
                    continue  # an answer to a request that was given up on
                if "error" in msg:
                    return {}, float(msg.get("seconds", 0.0)), msg["error"]
                return read_result(result_path(request)), float(msg["seconds"]), None
        finally:
            self._forget_request()

    def close(self) -> None:
        """Stop the worker without waiting for it: SIGKILL, reaped in a thread. It holds nothing that needs an
        orderly exit (results are renamed into place whole; the request folders are this process's), and an
        orderly one costs: the interpreter's teardown after numba took ~0.5 s of CPU per worker here, which
        slowed the training steps around it (the replanner closes the workers as soon as every layer settles on
        the dense schedule, i.e. in the first steps of a fast-link job)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            threading.Thread(target=_kill_worker, args=(proc,), daemon=True, name="ds_cobalt-planner-reaper").start()
        self._request = None
        self._forget_request()

    def _forget_request(self) -> None:
        remove, self._remove_request = self._remove_request, None
        if remove is not None:
            remove()


def _kill_worker(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def make_planner(mode: str, policy: str, log: Any) -> LayerPlanner:
    """The planner of `planner.worker` mode for `policy`; a policy only `__main__` defines plans in a thread."""
    module = policy_module(policy)
    if mode == "thread":
        return ThreadPlanner()
    if module == "__main__":
        log(f"ds_cobalt: policy {policy!r} is defined in __main__, which a planner worker process cannot "
            "import; planning runs in a thread of each rank. Define it in an importable module to plan off "
            "the training process.")
        return ThreadPlanner()
    return ProcessPlanner(policy, module)
