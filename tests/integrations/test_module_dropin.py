"""`ds_cobalt.MoE` as a module, like DeepSpeed's: deep copies of a template layer, `torch.save` of a model, meta-device
(deferred) initialisation and the gate's `k`, in one process without torch.distributed (a one-rank layer)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from conftest import run_ranks

D, E = 8, 4


def _expert() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(D, 16), torch.nn.ReLU(), torch.nn.Linear(16, D))


def _layer(**kw) -> torch.nn.Module:
    import ds_cobalt

    torch.manual_seed(0)
    return ds_cobalt.MoE(D, _expert(), E, k=2, drop_tokens=False, **kw)


def _output(layer: torch.nn.Module) -> torch.Tensor:
    torch.manual_seed(1)  # the gate samples its second expert
    return layer(torch.randn(12, D, generator=torch.Generator().manual_seed(2)))[0].detach()


def test_a_deep_copy_is_a_layer_of_its_own():
    template = _layer()
    clone = copy.deepcopy(template)
    assert clone.cobalt_core._owner() is clone and clone.cobalt_core is not template.cobalt_core
    expected = _output(template)
    template.to("meta")  # the template elsewhere: the copy's lookup tables follow its own weights
    assert clone.cobalt_core._device() == torch.device("cpu")
    torch.testing.assert_close(_output(clone), expected, rtol=0, atol=0)


def test_torch_save_and_load_of_the_module():
    layer = _layer()
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.cobalt_core._owner() is loaded
    torch.testing.assert_close(_output(loaded), _output(layer), rtol=0, atol=0)


def test_meta_device_construction_then_to_empty():
    reference = _layer()
    with torch.device("meta"):
        deferred = _layer()
    deferred.to_empty(device="cpu")
    deferred.load_state_dict(reference.state_dict())
    torch.testing.assert_close(_output(deferred), _output(reference), rtol=0, atol=0)


def test_k_is_checked_and_an_integral_float_is_taken():
    import ds_cobalt

    assert ds_cobalt.MoE(D, _expert(), E, k=2.0).deepspeed_moe.gate.k == 2  # as a JSON config may give it
    for k in (0, -1, E + 1, 2.5, True):
        with pytest.raises(ValueError, match=rf"k must be an int in \[1, num_experts={E}\], got {k!r}"):
            ds_cobalt.MoE(D, _expert(), E, k=k)


def _breakdown(rank: int, world: int, schedule: str) -> dict:
    import ds_cobalt

    layer = _layer(ep_size=world)
    engine, *_ = ds_cobalt.initialize(
        model=layer, model_parameters=layer.parameters(),
        config={"train_micro_batch_size_per_gpu": 12, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "wall_clock_breakdown": True,
                "cobalt": {"topology": {"ranks_per_node": 1}, "transport": {"schedule": schedule}}})
    moe = layer.deepspeed_moe
    out, aux, _ = engine(torch.randn(12, D, generator=torch.Generator().manual_seed(rank)))
    engine.backward(out.square().sum() + aux)
    engine.step()
    return {"set": moe.wall_clock_breakdown, "moe": moe.time_moe, "first": moe.time_falltoall,
            "second": moe.time_salltoall}


@pytest.mark.parametrize("schedule", ["direct", "hierarchical"])
def test_wall_clock_breakdown_times_the_layer_and_its_exchanges(schedule):
    # what DeepSpeed's engine sets on every MoE layer with `"wall_clock_breakdown": true`, and reads after a step
    for r in run_ranks(_breakdown, 2, schedule):
        assert r["set"] and r["moe"] > 0 and r["first"] > 0 and r["second"] > 0, r
        assert r["first"] + r["second"] < r["moe"], r


def test_initialize_names_param_groups_left_empty_by_a_used_up_generator():
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import ds_cobalt

    model = torch.nn.Sequential(_layer())
    groups = split_params_into_different_moe_groups_for_optimizer({"params": model.parameters(), "name": "p"})
    assert all(len(g["params"]) == 0 for g in groups)  # the generator was used up: nothing would train
    with pytest.raises(ValueError, match=r"model_parameters holds no parameter in any group"):
        ds_cobalt.initialize(model=model, model_parameters=groups, config={"train_batch_size": 1})
