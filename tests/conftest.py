"""Shared test helpers: run a function on N CPU ranks (gloo), markers.

Multi-rank tests::

    def _body(rank: int, world_size: int, scale: float) -> dict:   # module level, so it pickles
        import torch.distributed as dist
        ...
        return {"out": tensor}                                      # any picklable value

    def test_parity(run_ranks):
        results = run_ranks(_body, 4, 2.0, timeout=120)            # one entry per rank, in rank order

``run_ranks`` is also importable (``from conftest import run_ranks``) for helpers outside a test.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------- markers
def pytest_configure(config: pytest.Config) -> None:
    # also declared in pyproject.toml; repeated so the markers exist when pytest runs from elsewhere
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped without it)")
    config.addinivalue_line("markers", "slow: end-to-end runs through the deepspeed launcher")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# ------------------------------------------------------------------------------------------ run_ranks
# Ranks fork from a server process that has imported these once: `spawn` re-imported them in every rank (about 3 s
# of CPU each, 4 ranks sharing 2 cores), which was a third of the multi-rank tests' time. The server imports and
# runs nothing else, so each rank still starts clean (no process group, no DeepSpeed state).
_PRELOAD = ["torch", "torch.distributed", "deepspeed", "deepspeed.moe.layer", "ds_cobalt.integrations.engine"]


def _start_context() -> mp.context.BaseContext:
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class RankError(RuntimeError):
    """A rank raised, crashed or timed out; the message carries each failing rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    env: dict[str, str],
    init: str,
    out_path: str,
) -> None:
    """Child process body: take the environment (the test process's, as it is now, and the launcher's variables),
    init the process group, run ``fn``, pickle result."""
    os.environ.clear()  # the fork server's environment is the test process's at the server's start
    os.environ.update(env)
    try:
        import torch

        torch.set_num_threads(1)
        if init == "deepspeed":
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        elif init == "torch":
            import torch.distributed as dist

            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        result = ("error", traceback.format_exc())
    try:
        payload = pickle.dumps(result)
    except Exception:  # noqa: BLE001
        payload = pickle.dumps(("error", "result is not picklable:\n" + traceback.format_exc()))
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, out_path)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()  # gloo aborts at exit otherwise
    except Exception:  # noqa: BLE001
        pass
    import multiprocessing.util

    multiprocessing.util._exit_function()  # what a multiprocessing child runs at its end (its finalizers)
    os._exit(0)  # skip interpreter teardown: nothing left to flush, and it can hang with live threads


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    init: str = "deepspeed",
    ranks_per_node: int | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh CPU processes; return results by rank.

    ``fn`` must be picklable (a module-level function). Before it runs, each process has the caller's
    environment as it is at this call, MASTER_ADDR/MASTER_PORT (a free port), RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE (and DeepSpeed's LOCAL_SIZE / CROSS_RANK / CROSS_SIZE) set, OMP_NUM_THREADS=1, and the process
    group initialised: ``init="deepspeed"`` (``deepspeed.init_distributed``, gloo; needed by DeepSpeed MoE
    layers), ``"torch"`` (``torch.distributed.init_process_group("gloo")``) or ``"none"``.
    ``ranks_per_node`` sets the local-rank variables as if the ranks were spread over nodes of that
    size (default: all ranks on one node). ``env`` adds variables.

    Raises ``RankError`` with the traceback of every failing rank if any rank raises, dies, or the
    whole run exceeds ``timeout`` seconds (then every rank still running is killed).
    """
    if init not in ("deepspeed", "torch", "none"):
        raise ValueError(f"init must be 'deepspeed', 'torch' or 'none', got {init!r}")
    rpn = ranks_per_node or world_size
    if world_size % rpn:
        raise ValueError(f"ranks_per_node={rpn} does not divide world_size={world_size}")
    ctx = _start_context()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="run_ranks_") as tmp:
        procs = []
        for rank in range(world_size):
            rank_env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank % rpn),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(rpn),
                "LOCAL_SIZE": str(rpn),
                "CROSS_RANK": str(rank // rpn),
                "CROSS_SIZE": str(world_size // rpn),
                "OMP_NUM_THREADS": "1",
                **(env or {}),
            }
            out = os.path.join(tmp, f"rank{rank}.pkl")
            p = ctx.Process(
                target=_rank_main, args=(fn, rank, world_size, args, rank_env, init, out), daemon=True
            )
            p.start()
            procs.append((p, out))

        deadline = time.monotonic() + timeout
        timed_out = False
        while any(p.is_alive() for p, _ in procs):
            # a rank that failed leaves its peers blocked in a collective: stop waiting for them
            if any(os.path.exists(out) and _load(out)[0] == "error" for _, out in procs):
                break
            if any(not p.is_alive() and p.exitcode not in (0, None) for p, _ in procs):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
        time.sleep(0.2)  # let ranks that are finishing write their results
        for p, _ in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)

        results: list[Any] = []
        failures: list[str] = []
        for rank, (p, out) in enumerate(procs):
            if os.path.exists(out):
                status, value = _load(out)
                if status == "ok":
                    results.append(value)
                    continue
                failures.append(f"--- rank {rank} raised:\n{value}")
            elif timed_out:
                failures.append(f"--- rank {rank} still running after {timeout:.0f} s (killed)")
            else:
                failures.append(
                    f"--- rank {rank} gave no result (exit code {p.exitcode}; killed after a peer failed?)"
                )
        remove_deepspeed_shm(port)
        if failures:
            head = f"run_ranks({getattr(fn, '__name__', fn)!r}, world_size={world_size})"
            raise RankError(head + (" timed out" if timed_out else " failed") + "\n" + "\n".join(failures))
        return results


def remove_deepspeed_shm(*ports: int) -> None:
    """Remove DeepSpeed's CPU all-reduce buffers (shm comm op) of the runs on `ports`: they outlive the ranks, about
    67 MB per rank and run in /dev/shm, which filled a 24 GB machine over a day of test runs (and its memory: the
    compiler then crawled and launches timed out)."""
    for port in ports:
        for leftover in Path("/dev/shm").glob(f"deepspeed_*_{port}_*"):
            leftover.unlink(missing_ok=True)


def _load(path: str) -> tuple[str, Any]:
    with open(path, "rb") as f:
        return pickle.load(f)


@pytest.fixture(name="run_ranks")
def _run_ranks_fixture() -> Callable[..., list[Any]]:
    """The ``run_ranks`` helper as a fixture (same function as ``from conftest import run_ranks``)."""
    return run_ranks
