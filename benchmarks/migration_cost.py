"""Migration cost per expert: bytes and seconds, and the fraction hidden behind the next forward.

    OMP_NUM_THREADS=1 python benchmarks/migration_cost.py [--d-model 64] [--d-ff 256] [--stage 1] [--repeats 3]

Runs 4 gloo CPU ranks as 2 nodes x 2 (tests/conftest.py `run_ranks`), a 2-layer MoE (E=8, top-2) under
DeepSpeed with Adam, trains 2 steps so the optimizer state exists, then times full random owner
permutations (`ds_cobalt.integrations.migration.migrate`) against one training step, synchronously and
asynchronously (transfers behind the next forward, each layer committing in its forward pre-hook).
hidden_fraction = 1 - (async migration + next step - plain step) / synchronous migration, slowest rank.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ds_cobalt.commands.arg_types import positive_int

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def _body(rank: int, world: int, d_model: int, d_ff: int, stage: int, repeats: int) -> dict:
    import numpy as np
    import torch
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import ds_cobalt
    from ds_cobalt.integrations.migration import migrate

    E = 8
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(d_model, d_ff), torch.nn.GELU(), torch.nn.Linear(d_ff, d_model))
    layers = torch.nn.ModuleList(ds_cobalt.MoE(d_model, expert, num_experts=E, ep_size=world, k=2) for _ in range(2))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moes = layers

        def forward(self, x):
            for moe in self.moes:
                x = x + moe(x)[0]
            return (x ** 2).mean()

    model = Net()
    config = {"train_micro_batch_size_per_gpu": 64, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "steps_per_print": 10 ** 9, "cobalt": {"topology": {"ranks_per_node": 2}}}
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    engine, *_ = ds_cobalt.initialize(model=model, model_parameters=groups, config=config)

    def step() -> float:
        t = time.perf_counter()
        loss = engine(torch.randn(64, d_model))
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - t

    step(), step()
    step_s = min(step() for _ in range(repeats))
    rng = np.random.default_rng(0)
    results = []
    for _ in range(repeats):
        target = [rng.permutation(E).reshape(world, E // world) for _ in range(2)]
        report = migrate(engine, target, reason="benchmark")
        results.append(report)
    moved = [len(r.moved) for r in results]
    async_extra = []
    for _ in range(repeats):
        target = [rng.permutation(E).reshape(world, E // world) for _ in range(2)]
        t = time.perf_counter()
        pending = migrate(engine, target, reason="benchmark (async)", asynchronous=True)
        step()
        assert pending.done and pending.report.ok
        async_extra.append(time.perf_counter() - t - step_s)
    return {"step_s": step_s, "seconds": [r.seconds for r in results], "moved": moved,
            "async_extra_s": async_extra,
            "bytes": [r.bytes_moved for r in results],
            "crossing": [sum(1 for _, _, a, b in r.moved if a != b) for r in results],
            "expert_params": sum(p.numel() for p in expert.parameters())}


def main() -> None:
    from conftest import run_ranks

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-ff", type=int, default=256)
    p.add_argument("--stage", type=int, default=1, choices=[0, 1, 2])
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    res = run_ranks(_body, 4, args.d_model, args.d_ff, args.stage, args.repeats, ranks_per_node=2, timeout=600)
    r0 = res[0]
    seconds = max(min(r["seconds"]) for r in res)  # the slowest rank bounds the migration
    moved = r0["moved"][0]
    out = {
        "expert_params": r0["expert_params"],
        "experts_moved_per_migration": moved,
        "bytes_per_expert": r0["bytes"][0] // max(1, r0["crossing"][0]),  # weights + fp32 master + moments
        "seconds_per_migration": seconds,
        "seconds_per_expert": seconds / max(1, moved),
        "train_step_s": max(r["step_s"] for r in res),
        "migration_over_step": seconds / max(r["step_s"] for r in res),
    }
    async_extra = max(min(r["async_extra_s"]) for r in res)
    out["async_extra_over_step"] = async_extra / out["train_step_s"]
    out["hidden_fraction"] = min(1.0, max(0.0, 1.0 - async_extra / seconds))
    if args.json:
        print(json.dumps(out))
        return
    for key, value in out.items():
        print(f"{key:30s} {value:.6g}" if isinstance(value, float) else f"{key:30s} {value}")


if __name__ == "__main__":
    main()
