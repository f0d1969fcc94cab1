"""What the multi-rank benchmark jobs (`paired_steps.py`, `replan_overhead.py`, `soak_job.py`) share: the example's
model and launcher helpers, the arguments every job takes, and the start-up of the process group."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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

__all__ = ["MoELM", "add_model_arguments", "batch_for_rank", "initialize", "job_parser", "load_corpus",
           "model_config_from", "moe_class", "read_config", "start_job"]


def job_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser with the arguments of every job: the launcher's (`--deepspeed_config`, `--local_rank`) and
    `--seed`; the caller adds its own and the model's (`add_model_arguments`)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--seed", type=int, default=1234)
    return p


def start_job() -> tuple[int, int]:
    """Threads from the environment (OMP_NUM_THREADS), DeepSpeed's process group; returns (rank, world size)."""
    set_threads_from_env()
    import deepspeed

    deepspeed.init_distributed(dist_backend=None)
    return dist.get_rank(), dist.get_world_size()
