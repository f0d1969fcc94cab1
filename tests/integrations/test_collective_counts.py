"""Collective calls per MoE layer forward and backward, per schedule, next to DeepSpeed's layer.

Counted by wrapping `torch.distributed`'s collectives on 4 CPU ranks (2 nodes x 2). The numbers pin today's
schedules: a change that adds a collective fails here (fixed cost per call dominates small messages).
"""

from __future__ import annotations

import copy

D, E = 16, 8
COUNTED = ("all_to_all_single", "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "isend", "irecv",
           "reduce_scatter_tensor", "barrier")


def _count_body(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    import ds_cobalt
    from ds_cobalt.config import parse_cobalt_config

    calls: dict[str, int] = {}
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counting(name):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return originals[name](*args, **kwargs)
        return wrapper

    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(D, 24), torch.nn.GELU(), torch.nn.Linear(24, D))
    layers = {"deepspeed": DeepSpeedMoE(D, copy.deepcopy(expert), E, ep_size=world, k=2, drop_tokens=False,
                                        min_capacity=0)}
    for schedule in ("hierarchical", "direct"):
        for replicas in (False, True):
            cfg = parse_cobalt_config({"topology": {"ranks_per_node": 2}, "transport": {"schedule": schedule}})
            layers[f"{schedule}{'_replicas' if replicas else ''}"] = ds_cobalt.MoE(
                D, copy.deepcopy(expert), E, ep_size=world, k=2, cobalt_config=cfg)
    out = {}
    for name, layer in layers.items():
        layer.set_deepspeed_parallelism()
        if name.endswith("_replicas"):
            layer.set_layout(torch.cat([torch.as_tensor(layer.layout_slots),
                                        torch.tensor([[3], [0], [5], [6]])], 1).numpy())
        x = torch.randn(12 + rank, D, requires_grad=True)
        for _ in range(2):  # the second forward is counted (nothing is set up lazily in it)
            for fn in COUNTED:
                setattr(dist, fn, counting(fn))
            try:
                calls.clear()
                y, aux, _ = layer(x)
                forward = sum(calls.values())
                calls.clear()
                (y.square().sum() + aux).backward()
                backward = sum(calls.values())
            finally:
                for fn, original in originals.items():
                    setattr(dist, fn, original)
        out[name] = (forward, backward)
    return out


def test_collectives_per_layer(run_ranks) -> None:
    results = run_ranks(_count_body, 4, ranks_per_node=2, timeout=300)
    assert all(res == results[0] for res in results)  # every rank makes the same calls
    counts = results[0]
    # DeepSpeed's dropless layer: capacity all-reduce + dispatch and combine all-to-alls; backward mirrors.
    assert counts["deepspeed"] == (3, 2)
    # ds_cobalt.MoE calls DeepSpeed's gate, whose dropless capacity all-reduce stays (1), then
    # hierarchical: rail counts, rail rows, rail routes, node counts, node rows, node back, rail back (+7)
    assert counts["hierarchical"] == (8, 5)
    # direct: counts, rows, routes, rows back over the EP group (+4)
    assert counts["direct"] == (5, 3)
    # replicas add one weight fetch each way, for both schedules
    assert counts["hierarchical_replicas"] == (9, 6) and counts["direct_replicas"] == (6, 4)
