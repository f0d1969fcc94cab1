"""Checkpoints that fail half-way (4 gloo CPU ranks, 2 nodes x 2): the job fails with the error instead of hanging,
DeepSpeed's `latest` keeps pointing at the last complete checkpoint, and a checkpoint whose replanner files are
missing on some ranks resumes with fresh statistics on every rank."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
from conftest import RankError
from test_migration import build_engine, train

# owners move at step 6 (plan after step 4, applied 2 steps later): saves after it run in logical order
COBALT = {"planner": {"replan_interval": 4, "apply_lag": 2, "redundant_slots": 1, "policy": "test_slow_shuffle"},
          "migration": {"ignore_cost_model": True}, "transport": {"schedule": "hierarchical"}}


def _failed_save_on_one_rank(rank: int, world: int, root: str) -> None:
    import slow_policy  # noqa: F401 - registers test_slow_shuffle
    import torch.distributed as dist

    engine = build_engine("cobalt", 1, cobalt=COBALT)
    train(engine, range(7))
    assert any(m.reason.startswith("replan") and m.moved for m in engine.cobalt_migrations)
    engine.save_checkpoint(root, tag="good")
    dist.barrier()
    if rank == 1:  # this rank's disk is full: DeepSpeed's write of its files fails there only
        def full(*args: Any, **kwargs: Any) -> None:
            raise OSError(28, "No space left on device")

        engine.checkpoint_engine.save = full
    engine.save_checkpoint(root, tag="bad")


def test_a_save_failing_on_one_rank_after_migrations_raises_and_keeps_latest(run_ranks: Any, tmp_path) -> None:
    with pytest.raises(RankError) as err:
        run_ranks(_failed_save_on_one_rank, 4, str(tmp_path), ranks_per_node=2, timeout=240)
    message = str(err.value)
    # rank 1 raised DeepSpeed's error at once (before: it waited in the migration back to the training layout,
    # a collective, while its peers waited in DeepSpeed's barrier)
    assert "timed out" not in message.splitlines()[0], message[-3000:]
    assert "--- rank 1 raised" in message and "No space left on device" in message
    # `latest` moves only once every rank has written everything (DeepSpeed's rank 0 wrote it without waiting)
    assert (tmp_path / "latest").read_text().strip() == "good"


def _resume_with_a_missing_replan_file(rank: int, world: int, root: str) -> dict:
    import slow_policy  # noqa: F401
    import torch.distributed as dist

    from ds_cobalt.integrations.replan_state import replan_state_path

    engine = build_engine("cobalt", 1, cobalt=COBALT)
    train(engine, range(3))
    engine.save_checkpoint(root)
    train(engine, range(3, 5))  # the plan gathered after step 4 is in flight at the save (applied after step 6)
    engine.save_checkpoint(root)
    engine.destroy()
    out: dict = {}
    mine = replan_state_path(os.path.join(root, "global_step5"), 1)
    for case in ("other save", "missing"):
        dist.barrier()
        if rank == 1 and case == "other save":  # rank 1's file from the save after step 3
            shutil.copy(replan_state_path(os.path.join(root, "global_step3"), 1), mine)
        if rank == 1 and case == "missing":
            os.remove(mine)
        dist.barrier()
        engine = build_engine("cobalt", 1, cobalt=COBALT)
        engine.load_checkpoint(root)
        replanner = next(h for h in engine.cobalt_step_hooks if type(h).__name__ == "Replanner")
        out[case] = {"pending": replanner._pending is not None, "step": engine.global_steps}
        if case == "other save":
            engine.destroy()
    losses = train(engine, range(5, 11))  # past the step the lost plan would have been applied at, and a new plan
    out["finite"] = all(loss == loss for loss in losses)
    from ds_cobalt import cobalt_layers

    out["layouts"] = [layer.layout_slots.tolist() for layer in cobalt_layers(engine)]
    out["replans"] = [m.step for m in engine.cobalt_migrations if m.reason.startswith("replan")]
    return out


def test_replan_files_missing_on_one_rank_start_every_rank_fresh(run_ranks: Any, tmp_path) -> None:
    res = run_ranks(_resume_with_a_missing_replan_file, 4, str(tmp_path), ranks_per_node=2, timeout=300)
    for r in res:
        # no rank resubmits the plan in flight at the save
        assert r["other save"] == r["missing"] == {"pending": False, "step": 5}
        assert r["finite"] and r["layouts"] == res[0]["layouts"]
        assert r["replans"] == [10]  # the next plan (after step 8, from fresh statistics) is applied on every rank


def test_latest_names_the_whole_tag(tmp_path) -> None:
    """`latest` holds the tag as given (DeepSpeed's form), also one with a '/' in it."""
    import torch

    from ds_cobalt.integrations.replan_state import write_latest

    engine = torch.nn.Module()
    engine.global_steps = 7
    write_latest(engine, tmp_path, "run1/step2")
    assert (tmp_path / "latest").read_text() == "run1/step2"
    write_latest(engine, tmp_path, None)
    assert (tmp_path / "latest").read_text() == "global_step7"
