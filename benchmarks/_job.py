"""What the multi-rank benchmark jobs (`paired_steps.py`, `replan_overhead.py`, `soak_job.py`) share: the example's
model and launcher helpers, the arguments every job takes, and the start-up of the process group."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
from moe_lm import (  # noqa: E402
    MoELM,
    add_model_arguments,
    batch_for_rank,
    load_corpus,
    model_config_from,
    set_threads_from_env,
)
from train_moe import initialize, moe_class, read_config  # noqa: E402

__all__ = ["MoELM", "InterleavedTimes", "add_model_arguments", "batch_for_rank", "initialize", "job_parser",
           "load_corpus", "model_config_from", "moe_class", "read_config", "run_interleaved", "start_job"]


def job_parser(doc: str | None, default_config: str | None = None) -> argparse.ArgumentParser:
    """A parser with the arguments of every job: the launcher's (`--deepspeed_config`, required without
    `default_config`; `--local_rank`) and `--seed`; the caller adds its own and the model's (`add_model_arguments`)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", required=default_config is None, default=default_config)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--seed", type=int, default=1234)
    return p


def start_job() -> tuple[int, int]:
    """Threads from the environment (OMP_NUM_THREADS), DeepSpeed's process group; returns (rank, world size)."""
    set_threads_from_env()
    import deepspeed

    deepspeed.init_distributed(dist_backend=None)
    return dist.get_rank(), dist.get_world_size()


@dataclass
class InterleavedTimes:
    """Per variant, one entry per step (`run_interleaved`)."""

    times: dict[str, list[float]] = field(default_factory=dict)  # the slowest rank's own window
    aligned: dict[str, list[float]] = field(default_factory=dict)  # from the last rank's start (skew left out)
    skews: dict[str, list[float]] = field(default_factory=dict)  # last start minus first start
    cpu: dict[str, list[float]] = field(default_factory=dict)  # process CPU seconds, mean of the ranks
    losses: dict[str, list[float]] = field(default_factory=dict)

    def medians(self, name: str, skip: int) -> dict[str, float]:
        """Median of `name` (times, aligned, skews, cpu) per variant without the first `skip` steps."""
        return {v: statistics.median(t[skip:]) for v, t in getattr(self, name).items()}


def run_interleaved(variants: list[str], steps: int, world: int, train_step: Callable[[str, int], torch.Tensor],
                    barrier: bool = True, before_round: Callable[[int], None] | None = None) -> InterleavedTimes:
    """`steps` rounds of one `train_step(variant, step)` (forward, backward, optimizer step; returns the loss) per
    variant, in an order that rotates each round, each timed on every rank (a barrier before it unless `barrier` is
    False) and gathered with one all-gather. `before_round(step)` runs untimed before each round (its batch)."""
    out = InterleavedTimes(*({v: [] for v in variants} for _ in range(5)))
    for step in range(steps):
        if before_round is not None:
            before_round(step)
        for variant in variants[step % len(variants):] + variants[: step % len(variants)]:
            if barrier:
                dist.barrier()
            t0 = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every rank of this machine's namespaces
            cpu0 = time.process_time()
            loss = train_step(variant, step)
            stamps = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
            mine = [t0, time.perf_counter(), time.process_time() - cpu0]
            dist.all_gather(stamps, torch.tensor(mine, dtype=torch.float64))
            starts, ends, cpus = zip(*(s.tolist() for s in stamps))
            out.cpu[variant].append(statistics.fmean(cpus))  # the process's CPU (gloo's threads too)
            out.times[variant].append(max(e - s for s, e in zip(starts, ends)))
            out.aligned[variant].append(max(ends) - max(starts))
            out.skews[variant].append(max(starts) - min(starts))
            out.losses[variant].append(float(loss.detach()))
    return out
