"""A small ds_cobalt training job that SIGKILLs one of its ranks at a chosen point (tests/integrations/test_crash.py).

    deepspeed --num_gpus 4 tests/integrations/crash_job.py --out DIR --kill-at forward|migration_commit|save
        [--kill-rank 1] [--kill-step 3]

Two ds_cobalt.MoE layers (8 experts, top-2), 4 ranks as 2 nodes x 2, ZeRO-1, an asynchronous owner migration
at every step from `--kill-step - 1` on, a checkpoint at `--kill-step`. The rank `--kill-rank` kills itself:
- `forward`: inside the first MoE layer's forward (after the gate, in an expert) at step `--kill-step`;
- `migration_commit`: after the asynchronous migration's transfer finished, before its commit;
- `save`: while `save_checkpoint` writes its files.
Each rank writes `DIR/rank<r>.pid` first, so the test can tell what was killed and how long it took.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import numpy as np
import torch

D, E = 16, 8


def _model(ds_cobalt):
    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inp = torch.nn.Linear(D, D)
            expert = torch.nn.Sequential(torch.nn.Linear(D, 32), torch.nn.ReLU(), torch.nn.Linear(32, D))
            self.moe1 = ds_cobalt.MoE(D, expert, E, ep_size=4, k=2)
            self.moe2 = ds_cobalt.MoE(D, expert, E, ep_size=4, k=2)
            self.out = torch.nn.Linear(D, 4)

        def forward(self, x, y):
            h = torch.tanh(self.inp(x))
            h1, aux1, _ = self.moe1(h)
            h2, aux2, _ = self.moe2(h + h1)
            return torch.nn.functional.cross_entropy(self.out(h + h1 + h2), y) + 0.01 * (aux1 + aux2)

    return Tiny()


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kill-at", required=True, choices=["forward", "migration_commit", "save"])
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-step", type=int, default=3)
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()

    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import ds_cobalt
    from ds_cobalt.integrations.migration import migrate, set_fault_hook

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    Path(args.out, f"rank{rank}.pid").write_text(str(os.getpid()))
    model = _model(ds_cobalt)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "params"})
    config = {"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
              "cobalt": {"topology": {"ranks_per_node": 2, "group_timeout_s": 30},
                         "transport": {"schedule": "hierarchical"}}}
    engine, *_ = ds_cobalt.initialize(model=model, model_parameters=groups, config=config)
    me = rank == args.kill_rank
    state = {"step": 0}
    if me and args.kill_at == "forward":
        expert = model.moe1.deepspeed_moe.experts.deepspeed_experts[0]
        expert.register_forward_pre_hook(lambda *_: _die() if state["step"] == args.kill_step else None)
    if me and args.kill_at == "migration_commit":
        set_fault_hook(lambda stage, layer: _die() if stage == "stage" else None)
    if me and args.kill_at == "save":
        save = engine.checkpoint_engine.save
        engine.checkpoint_engine.save = lambda *a, **k: (save(*a, **k), _die())
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.kill_step + 2):
        state["step"] = step
        if step >= args.kill_step - 1:
            migrate(engine, [rng.permutation(E).reshape(4, E // 4) for _ in range(2)], asynchronous=True)
        x, y = torch.randn(16, D, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if step == args.kill_step:
            engine.save_checkpoint(str(Path(args.out, "ckpt")))
    print(f"rank {rank}: finished without a kill", flush=True)


if __name__ == "__main__":
    main()
