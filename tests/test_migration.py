"""Migration of expert owners: training identical with and without migrations (and to DeepSpeed's MoE),
all-or-nothing under injected faults, the ZeRO re-link workaround, gradient norms with replicas.

Multi-rank bodies run on 4 gloo CPU ranks as 2 nodes x 2 (`cobalt.topology.ranks_per_node = 2`).
Helpers here are shared with tests/test_checkpoint.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

E, D, HIDDEN, K, LAYERS, MICRO = 8, 16, 32, 2, 2, 8


# ------------------------------------------------------------------------------------------- helpers
def build_engine(impl: str, stage: int, *, ep_size: int = 4, dtype: str = "fp32", cobalt: dict | None = None,
                 clip: float = 1.0, extra: dict | None = None):
    """A tiny model (input Linear + 2 MoE layers, E=8, D=16) and its engine; logical expert e gets the
    same weights whatever the implementation or the world size."""
    import torch
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import deepspeed
    import ds_cobalt

    cls = ds_cobalt.MoE if impl == "cobalt" else deepspeed.moe.layer.MoE

    class Expert(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(D, HIDDEN)
            self.fc2 = torch.nn.Linear(HIDDEN, D)

        def forward(self, x):
            return self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(D, D)
            self.moes = torch.nn.ModuleList(
                cls(D, Expert(), num_experts=E, ep_size=ep_size, k=K, drop_tokens=False,
                    top2_2nd_expert_sampling=False) for _ in range(LAYERS))

        def forward(self, x, y):
            h = self.inp(x)
            aux = 0.0
            for moe in self.moes:
                out, l_aux, _ = moe(h)
                h = h + out
                aux = aux + l_aux
            return ((h.float() - y) ** 2).mean() + 0.01 * aux

    torch.manual_seed(0)
    model = Net()
    ep_rank = dist.get_rank() % ep_size
    per_rank = E // ep_size
    with torch.no_grad():
        for li, moe in enumerate(model.moes):
            for i, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                g = torch.Generator().manual_seed(1000 * li + ep_rank * per_rank + i)
                for p in expert.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": clip,
        "steps_per_print": 10 ** 9,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    config.update(extra or {})
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"})
    if impl == "cobalt":
        config["cobalt"] = {"topology": {"ranks_per_node": 2}, **(cobalt or {})}
        engine, *_ = ds_cobalt.initialize(args=None, model=model, model_parameters=groups, config=config)
    else:
        engine, *_ = deepspeed.initialize(args=None, model=model, model_parameters=groups, config=config)
    return engine


def batch(step: int, rank: int, dtype: str = "fp32"):
    import torch

    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(MICRO, D, generator=g)
    y = torch.sin(2 * x) + 0.1 * torch.randn(MICRO, D, generator=g)
    if dtype == "bf16":
        x = x.bfloat16()
    return x, y


def train(engine, steps: range, dtype: str = "fp32", before_step=None) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in steps:
        if before_step is not None:
            before_step(engine, step)
        x, y = batch(step, dist.get_rank(), dtype)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()))
    return losses


def random_owner_layout(rng: np.random.Generator, world: int = 4) -> np.ndarray:
    return rng.permutation(E).reshape(world, E // world)


def migrate_randomly(seed: int):
    """A `before_step` callback: every 10 steps, move all layers to random owner permutations."""
    def hook(engine, step: int) -> None:
        if step and step % 10 == 0:
            from ds_cobalt.integrations.migration import migrate

            rng = np.random.default_rng(seed + step)
            report = migrate(engine, [random_owner_layout(rng) for _ in range(LAYERS)])
            assert report.ok, report
    return hook


def logical_expert_state(engine) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """(layer, logical expert) -> full weights and optimizer state of the experts this rank owns."""
    from ds_cobalt.integrations.engine import cobalt_layers
    from ds_cobalt.integrations.migration import ExpertStateIO

    out = {}
    for li, layer in enumerate(cobalt_layers(engine)):
        rank = layer.topology.rank
        for slot, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            params = list(expert.parameters())
            io = ExpertStateIO(engine, params[0])
            e = int(layer.layout_slots[rank, slot])
            out[(li, e)] = {"fields": io.fields, "row": io.read(params).numpy().copy()}
    return out


def raw_state(engine) -> dict[str, np.ndarray]:
    """Every tensor of the module and of the optimizer, as stored (for bit-identity checks)."""
    import torch

    out = {f"module.{k}": v.detach().float().numpy().copy() for k, v in engine.module.state_dict().items()}
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    for i, group in enumerate(inner.param_groups):
        for j, p in enumerate(group["params"]):
            out[f"master.{i}.{j}"] = p.detach().float().numpy().copy()
            for key, value in inner.state.get(p, {}).items():
                if torch.is_tensor(value):
                    out[f"state.{i}.{j}.{key}"] = value.detach().float().numpy().copy()
    for i, flat in enumerate(getattr(opt, "bit16_groups_flat", [])):
        out[f"bit16_flat.{i}"] = flat.detach().float().numpy().copy()
    return out


# -------------------------------------------------------------------------------------- rank bodies
def _identical_training(rank: int, world: int, stage: int, steps: int) -> dict:
    import torch.distributed as dist

    from ds_cobalt.integrations.engine import cobalt_layers

    runs = {}
    engine = build_engine("deepspeed", stage)
    runs["deepspeed"] = train(engine, range(steps))
    engine.destroy()
    engine = build_engine("cobalt", stage)
    runs["cobalt"] = train(engine, range(steps))
    engine.destroy()
    engine = build_engine("cobalt", stage)
    runs["migrating"] = train(engine, range(steps), before_step=migrate_randomly(seed=stage))
    layouts = [layer.layout_slots.copy() for layer in cobalt_layers(engine)]
    migrations = [r for r in getattr(engine, "cobalt_migrations", []) if r.ok]
    dist.barrier()
    return {**runs, "layouts": layouts, "migrations": len(migrations),
            "bytes": sum(r.bytes_moved for r in migrations)}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_training_identical_with_random_migrations(run_ranks: Any, stage: int) -> None:
    steps = 60
    res = run_ranks(_identical_training, 4, stage, steps, ranks_per_node=2, timeout=240)
    for r in res:
        np.testing.assert_allclose(r["cobalt"], r["deepspeed"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["migrating"], r["cobalt"], rtol=1e-5, atol=1e-6)
        assert r["migrations"] == (steps - 1) // 10
        assert r["bytes"] > 0
    # every rank installed the same (non-contiguous) layouts
    for layer in range(LAYERS):
        assert all(np.array_equal(r["layouts"][layer], res[0]["layouts"][layer]) for r in res)
        assert not np.array_equal(res[0]["layouts"][layer], np.arange(E).reshape(4, 2))
