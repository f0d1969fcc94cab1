"""Re-planning a model whose MoE layers differ in shape (PR-MoE style, as DeepSpeed allows): the layers of the
most common shape are planned and migrate, the others keep their layout, and training matches DeepSpeed's
(2 gloo CPU ranks as 2 nodes of 1)."""

from __future__ import annotations

from typing import Any

import numpy as np

D, STEPS = 16, 8
SPECS = [(4, 2), (8, 2), (4, 2)]  # (num_experts, ep_size) per MoE layer


def _model(moe_cls: Any, seed: int):
    import torch

    torch.manual_seed(seed)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(D, D)
            self.moes = torch.nn.ModuleList(
                moe_cls(D, torch.nn.Sequential(torch.nn.Linear(D, 8), torch.nn.ReLU(), torch.nn.Linear(8, D)), E,
                        ep_size=ep, k=2, drop_tokens=False, min_capacity=0,
                        top2_2nd_expert_sampling=False) for E, ep in SPECS)

        def forward(self, x, y):
            h, aux = self.inp(x), 0.0
            for moe in self.moes:
                out, l_aux, _ = moe(h)
                h, aux = h + out, aux + l_aux
            return ((h - y) ** 2).mean() + 0.01 * aux

    return Net()


def _mixed(rank: int, world: int) -> dict:
    import deepspeed
    import torch
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import ds_cobalt
    from ds_cobalt.integrations.replan import Replanner

    config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10 ** 9, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}
    cobalt = {"topology": {"ranks_per_node": 1}, "transport": {"schedule": "hierarchical"},
              "planner": {"replan_interval": 2, "apply_lag": 1, "worker": "thread"},
              "migration": {"ignore_cost_model": True}}
    reference = _model(deepspeed.moe.layer.MoE, rank)
    ours = _model(ds_cobalt.MoE, rank)
    ours.load_state_dict(reference.state_dict())

    def groups(model):
        return split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})

    ref, *_ = deepspeed.initialize(model=reference, model_parameters=groups(reference), config=config)
    eng, *_ = ds_cobalt.initialize(model=ours, model_parameters=groups(ours), config={**config, "cobalt": cobalt})
    losses: dict[str, list[float]] = {"deepspeed": [], "cobalt": []}
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
        for name, engine in (("deepspeed", ref), ("cobalt", eng)):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses[name].append(float(loss))
    (hook,) = [h for h in eng.cobalt_step_hooks if isinstance(h, Replanner)]
    moved = sorted({layer for m in eng.cobalt_migrations for layer, *_ in m.moved})
    return {**losses, "planned": hook._positions, "moved_layers": moved, "history": hook.history}


def test_replan_plans_the_layers_of_one_shape(run_ranks: Any) -> None:
    for r in run_ranks(_mixed, 2, ranks_per_node=1, timeout=240):
        np.testing.assert_allclose(r["cobalt"], r["deepspeed"], rtol=1e-5, atol=1e-6)
        assert r["planned"] == [0, 2]
        assert r["moved_layers"] and set(r["moved_layers"]) <= {0, 2}
        assert all(h["planned"] == 2 for h in r["history"])
