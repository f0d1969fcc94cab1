"""30 training steps through deepspeed.initialize: ds_cobalt.MoE gives DeepSpeed's MoE losses (1e-5)."""

from __future__ import annotations

import numpy as np
import pytest

STEPS = 30
D, E = 16, 8


def _model(moe_cls, seed: int, ep_size: int = 4):
    import torch

    class TinyMoEModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.inp = torch.nn.Linear(D, D)
            expert = torch.nn.Sequential(torch.nn.Linear(D, 32), torch.nn.ReLU(), torch.nn.Linear(32, D))
            self.moe1 = moe_cls(D, expert, E, ep_size=ep_size, k=2, drop_tokens=False, min_capacity=0)
            self.moe2 = moe_cls(D, expert, E, ep_size=ep_size, k=1, drop_tokens=True, min_capacity=0,
                                capacity_factor=1.5)
            self.out = torch.nn.Linear(D, 4)

        def forward(self, x, y):
            h = torch.tanh(self.inp(x))
            h1, aux1, _ = self.moe1(h)
            h2, aux2, _ = self.moe2(h + h1)
            logits = self.out(h + h1 + h2)
            return torch.nn.functional.cross_entropy(logits, y) + 0.01 * (aux1 + aux2)

    return TinyMoEModel()


def _train_body(rank: int, world: int, zero_stage: int, trace_path: str, ep_size: int = 4,
                ranks_per_node: int = 2, schedule: str = "auto") -> dict:
    import deepspeed
    import torch
    from deepspeed.moe.layer import MoE as DeepSpeedMoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import ds_cobalt
    import ds_cobalt.integrations.layers

    base = {
        "train_micro_batch_size_per_gpu": 16,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": zero_stage},
        "gradient_clipping": 1.0,
    }
    cobalt = {"topology": {"ranks_per_node": ranks_per_node}, "trace": {"path": trace_path, "steps": 5},
              "traffic": {"log_interval": 10}, "transport": {"schedule": schedule},
              "planner": {"replan_interval": 0}}  # schedules only: re-planning parity is in test_engine/test_migration
    losses: dict[str, list[float]] = {}
    reference_state = None
    for impl in ("deepspeed", "cobalt"):
        model = _model(DeepSpeedMoE if impl == "deepspeed" else ds_cobalt.MoE, seed=0, ep_size=ep_size)
        if reference_state is None:
            reference_state = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            model.load_state_dict(reference_state)
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "params"})
        if impl == "deepspeed":
            engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=base)
        else:
            engine, *_ = ds_cobalt.initialize(model=model, model_parameters=groups,
                                              config={**base, "cobalt": cobalt})
        gen = torch.Generator().manual_seed(1000 + rank)
        data = [(torch.randn(16, D, generator=gen), torch.randint(0, 4, (16,), generator=gen)) for _ in range(3)]
        run = []
        for step in range(STEPS):
            x, y = data[step % 3]
            torch.manual_seed(step * 10 + rank)  # gate noise
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            run.append(loss.item())
        losses[impl] = run
        if impl == "cobalt":
            losses["traffic"] = ds_cobalt.traffic_summary(engine)
            losses["schedules"] = [core.schedule for core in ds_cobalt.integrations.layers.layer_cores(engine)]
    return losses


@pytest.mark.parametrize("zero_stage,schedule", [(0, "auto"), (2, "auto"), (1, "direct"), (1, "dense")])
def test_training_losses_match_deepspeed(run_ranks, tmp_path, zero_stage: int, schedule: str) -> None:
    """With `auto` the first steps alternate the hierarchical, direct and dense schedules (switches
    mid-training)."""
    trace_path = str(tmp_path / "trace.npz")
    results = run_ranks(_train_body, 4, zero_stage, trace_path, 4, 2, schedule, ranks_per_node=2, timeout=400)
    chosen = {tuple(res["schedules"]) for res in results}
    assert len(chosen) == 1  # every rank agreed
    expected = {"hierarchical", "direct", "dense"} if schedule == "auto" else {schedule}
    assert set(next(iter(chosen))) <= expected
    for rank, res in enumerate(results):
        np.testing.assert_allclose(res["cobalt"], res["deepspeed"], rtol=0, atol=1e-5, err_msg=f"rank {rank}")
        assert np.mean(res["deepspeed"][-3:]) < np.mean(res["deepspeed"][:3])  # it trained
        assert res["traffic"]["steps"] == STEPS
        padded = res["traffic"]["deepspeed_inter_node_bytes_padded"]
        assert 0 < res["traffic"]["inter_node_bytes"] <= padded  # dense sends DeepSpeed's padded buffers
        assert schedule == "dense" or res["traffic"]["inter_node_bytes"] < padded

    # cobalt.trace recorded the first 5 steps of both layers from all ranks
    from ds_cobalt.planner.trace import load_trace

    trace = load_trace(trace_path)
    assert trace.experts_LTK.shape == (2, 4 * 5 * 16, 2)
    assert np.array_equal(np.bincount(trace.source_rank_T), [80, 80, 80, 80])
    assert (trace.experts_LTK[1, :, 1] == -1).all()  # the k=1 layer pads its second column


def test_expert_data_parallel_groups_match_deepspeed(run_ranks, tmp_path) -> None:
    """ep_size=2 on 4 ranks (two expert-data-parallel replicas of every expert), each EP group spanning
    2 nodes of 1 rank: DeepSpeed's expert-data-parallel gradient reduction runs unchanged."""
    results = run_ranks(_train_body, 4, 1, str(tmp_path / "trace.npz"), 2, 1, ranks_per_node=1, timeout=400)
    for rank, res in enumerate(results):
        np.testing.assert_allclose(res["cobalt"], res["deepspeed"], rtol=0, atol=1e-5, err_msg=f"rank {rank}")
        assert res["traffic"]["inter_node_rows"] > 0


def _plain_deepspeed_initialize(rank: int, world: int) -> dict:
    """ds_cobalt.MoE under plain deepspeed.initialize: node size from the launcher (LOCAL_WORLD_SIZE)."""
    import deepspeed
    import torch
    from deepspeed.moe.layer import MoE as DeepSpeedMoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import ds_cobalt

    config = {"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}}
    out = {}
    state = None
    for impl, cls in (("deepspeed", DeepSpeedMoE), ("cobalt", ds_cobalt.MoE)):
        model = _model(cls, seed=0)
        state = state or {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "params"})
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
        gen = torch.Generator().manual_seed(rank)
        losses = []
        for step in range(5):
            x, y = torch.randn(16, D, generator=gen), torch.randint(0, 4, (16,), generator=gen)
            torch.manual_seed(step * 10 + rank)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[impl] = losses
        if impl == "cobalt":
            out["nodes"] = ds_cobalt.cobalt_layers(engine)[0].topology.nodes
    return out


def test_plain_deepspeed_initialize_works(run_ranks) -> None:
    results = run_ranks(_plain_deepspeed_initialize, 4, ranks_per_node=2, timeout=300)
    for res in results:
        np.testing.assert_allclose(res["cobalt"], res["deepspeed"], rtol=0, atol=1e-5)
        assert res["nodes"] == 2  # from LOCAL_WORLD_SIZE=2, no cobalt section at all
