"""A one-rank `ds_cobalt.MoE` (ep_size=1) runs a forward after `init_distributed` and before `deepspeed.initialize`,
as DeepSpeed's layer does, with DeepSpeed's results; the config and the groups still come afterwards (2 gloo
CPU ranks)."""

from __future__ import annotations

import torch
from conftest import run_ranks

D, E = 8, 4


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    import ds_cobalt

    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(D, 16), torch.nn.ReLU(), torch.nn.Linear(16, D))
    theirs = DeepSpeedMoE(D, expert, E, ep_size=1, k=2, drop_tokens=False)
    ours = ds_cobalt.MoE(D, expert, E, ep_size=1, k=2, drop_tokens=False)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _forward_backward(layer: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    layer.zero_grad()
    torch.manual_seed(1)  # the gate samples its second expert
    out, aux, _ = layer(x)
    (out.square().sum() + aux).backward()
    return out.detach(), [p.grad.clone() for p in layer.parameters()]


def _early(rank: int, world: int) -> dict:
    import ds_cobalt

    theirs, ours = _pair()
    x = torch.randn(12, D, generator=torch.Generator().manual_seed(rank))
    ref_out, ref_grads = _forward_backward(theirs, x)
    out, grads = _forward_backward(ours, x)  # before deepspeed.initialize: a throwaway one-rank core
    early = {"out": (out - ref_out).abs().max().item(),
             "grads": max((a - b).abs().max().item() for a, b in zip(grads, ref_grads)),
             "attached": ours.cobalt_core.attached}
    engine, *_ = ds_cobalt.initialize(
        model=ours, model_parameters=ours.parameters(),
        config={"train_micro_batch_size_per_gpu": 12, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "cobalt": {"topology": {"ranks_per_node": 1}, "transport": {"schedule": "hierarchical"}}})
    torch.manual_seed(1)
    out_after, _, _ = engine(x)
    return {**early, "after": (out_after.detach() - ref_out).abs().max().item(),
            "attached_after": ours.cobalt_core.attached, "early_core_dropped": ours._early_core is None,
            "schedule": ours.cobalt_core.settings.transport.schedule, "world": world}


def test_one_rank_layer_runs_before_deepspeed_initialize() -> None:
    for r in run_ranks(_early, 2):
        assert r["out"] < 1e-6 and r["grads"] < 1e-6, r  # DeepSpeed's layer on the same weights and input
        assert not r["attached"], r  # the layer's own core waited for its groups
        assert r["attached_after"] and r["early_core_dropped"], r
        assert r["schedule"] == "hierarchical", r  # the config applied after the early forward
        assert r["after"] < 1e-6, r  # the engine's first forward: same weights, same output
