"""The multi-rank helper of conftest.py: results by rank, env vars, failures carry the rank's traceback."""

from __future__ import annotations

import os
from typing import Any

import pytest
from conftest import RankError


def _all_reduce(rank: int, world_size: int, scale: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    env = {
        k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")
    }
    return {"sum": t.item(), "env": env, "threads": torch.get_num_threads()}


def _uneven_all_to_all(rank: int, world_size: int) -> list[float]:
    import torch
    import torch.distributed as dist

    send = [rank + 1] * world_size  # rank r sends r + 1 rows to everyone
    recv = [r + 1 for r in range(world_size)]
    out = torch.empty(sum(recv))
    dist.all_to_all_single(out, torch.full((sum(send),), float(rank)), recv, send)
    return out.tolist()


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("bad value on rank 1")
    dist.barrier()  # the other ranks block here until the helper kills them


def _sleep(rank: int, world_size: int) -> None:
    import time

    time.sleep(120)


def test_results_in_rank_order_with_node_env(run_ranks: Any) -> None:
    res = run_ranks(_all_reduce, 4, 2.0, ranks_per_node=2, timeout=120)
    assert [r["sum"] for r in res] == [12.0] * 4
    assert [r["env"]["RANK"] for r in res] == ["0", "1", "2", "3"]
    assert [r["env"]["LOCAL_RANK"] for r in res] == ["0", "1", "0", "1"]
    assert {r["env"]["LOCAL_WORLD_SIZE"] for r in res} == {"2"}
    assert all(r["threads"] == 1 and r["env"]["OMP_NUM_THREADS"] == "1" for r in res)


def test_gloo_uneven_all_to_all_single(run_ranks: Any) -> None:
    res = run_ranks(_uneven_all_to_all, 3, init="torch", timeout=120)
    assert res[2] == [0.0] * 1 + [1.0] * 2 + [2.0] * 3


def test_exception_carries_rank_traceback(run_ranks: Any) -> None:
    with pytest.raises(RankError, match=r"(?s)rank 1 raised:.*ValueError: bad value on rank 1"):
        run_ranks(_raise_on_rank_1, 2, init="torch", timeout=120)


def test_timeout_kills_ranks(run_ranks: Any) -> None:
    with pytest.raises(RankError, match="timed out"):
        run_ranks(_sleep, 2, init="none", timeout=3)


def _read_env(rank: int, world_size: int, name: str) -> str | None:
    return os.environ.get(name)


def test_ranks_see_the_test_process_environment_as_it_is_now(run_ranks, monkeypatch) -> None:
    """Ranks fork from a server started at the first call; they still get the caller's current environment."""
    run_ranks(_read_env, 2, "DS_COBALT_TEST_ENV", init="none")  # the server runs from here on
    monkeypatch.setenv("DS_COBALT_TEST_ENV", "set later")
    assert run_ranks(_read_env, 2, "DS_COBALT_TEST_ENV", init="none") == ["set later"] * 2
    monkeypatch.delenv("DS_COBALT_TEST_ENV")
    assert run_ranks(_read_env, 2, "DS_COBALT_TEST_ENV", init="none") == [None, None]
