"""AutoEP + "cobalt" at 4 ranks (EP 4) -> DeepSpeed's `ds_to_universal` -> 2 ranks (EP 2), optimizer state included.

4 CPU ranks as 2 nodes x 2 train a tiny Mixtral (test_auto_ep.py's) through ds_cobalt, move every layer's expert
owners to a non-contiguous layout (`migrate`), train on and `save_checkpoint` (ds_cobalt migrates to DeepSpeed's
contiguous order around the save, so DeepSpeed writes logical expert order). The test converts the tag with
`python -m deepspeed.checkpoint.ds_to_universal`; 2 ranks (one node) with `checkpoint.load_universal: true` then load
it by its tag and must hold, per logical expert and per dense parameter, the 4-rank run's weight, fp32 master and
Adam moments bit for bit, with the optimizer's step counts; their next losses must equal those of a 2-rank engine
that loaded the original tag through ds_cobalt's portable state (`load_module_only=True`). ZeRO 1 and 2, both in
each multi-rank run (start-up dominates here).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")

from test_auto_ep import BATCH, SEQ, VOCAB, tiny_model  # noqa: E402

STAGES = (1, 2)
SAVE_STEP = 5  # 3 steps, the migration, 2 more steps, then the save (DeepSpeed's default tag global_step5)
MIGRATE_AT = 3
AFTER = 3  # steps trained at 2 ranks after the load
TAG = f"global_step{SAVE_STEP}"
UNIVERSAL_TAG = f"{TAG}_universal"
# Owners moved across nodes (ranks 0-1 are node 0), different per layer: no rank keeps its contiguous experts.
MIGRATED = [np.array([[5, 2], [7, 0], [1, 6], [3, 4]]), np.array([[6, 1], [4, 3], [0, 7], [2, 5]])]
COBALT = {
    "topology": {"ranks_per_node": 2},
    "transport": {"schedule": "hierarchical"},  # fixed: `auto` picks by timing, and schedules agree to rounding only
    # the replanner is on (its state is saved at 4 ranks and absent from the universal tag) but never fires here
    "planner": {"replan_interval": 50, "worker": "thread"},
    "migration": {"inter_node_gbps": 10.0},  # no start-up link probe
}


def ds_config(ep_size: int, zero_stage: int, universal: bool = False) -> dict:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": zero_stage},
        "gradient_clipping": 1.0,
        "expert_parallel": {"enabled": True, "autoep_size": ep_size, "preset_model": "mixtral",
                            "use_grouped_mm": False},
        "cobalt": COBALT,
    }
    if universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def _engine(ep_size: int, zero_stage: int, universal: bool = False):
    import ds_cobalt

    model = tiny_model("mixtral")  # same seed: logical expert e has the same initial weights at any EP size
    engine, *_ = ds_cobalt.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(ep_size, zero_stage, universal))
    return engine


def _data(rank: int) -> list:
    import torch

    gen = torch.Generator().manual_seed(2000 + rank)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(3)]


def _steps(engine, data: list, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids = data[step % len(data)]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _layouts(engine) -> list[list[list[int]]]:
    import ds_cobalt

    return [layer.layout_slots.tolist() for layer in ds_cobalt.cobalt_layers(engine)]


def _full_state(engine) -> dict:
    """Key (experts by logical id: `<layer>.experts.<e>.w1`) -> `(fields, row)`: the full fp32 weight, master and
    moments of every parameter this rank holds (collective: fragment reads), and the step count of each flat ZeRO
    partition (with its type: torch's Adam increments a tensor step in place, a float one not at all)."""
    from ds_cobalt.integrations.expert_state import ExpertStateIO
    from ds_cobalt.integrations.portable import _keyed_parameters

    rows = {}
    for key, piece, _ in _keyed_parameters(engine):
        io = ExpertStateIO(engine, piece[0])
        rows[key] = (io.fields_of(piece), io.read([piece]).numpy().copy())
    opt = engine.optimizer
    steps = [opt.optimizer.state[flat].get("step") for flat in opt.single_partition_of_fp32_groups]
    return {"rows": rows, "steps": [(type(s).__name__, float(s)) for s in steps]}


def _save_at_4(rank: int, world: int, root: str) -> dict:
    from ds_cobalt.integrations.migration import migrate

    out = {}
    for stage in STAGES:
        engine = _engine(4, stage)
        data = _data(rank)
        _steps(engine, data, range(MIGRATE_AT))
        assert migrate(engine, MIGRATED, reason="test").ok
        _steps(engine, data, range(MIGRATE_AT, SAVE_STEP))
        res = {"layouts": _layouts(engine), "state": _full_state(engine)}
        engine.save_checkpoint(os.path.join(root, f"zero{stage}"))  # tag: DeepSpeed's default, global_step5
        res["layouts_after_save"] = _layouts(engine)
        engine.destroy()
        out[stage] = res
    return out


def _load_at_2(rank: int, world: int, root: str) -> dict:
    out = {}
    for stage in STAGES:
        ckpt = os.path.join(root, f"zero{stage}")
        data = _data(rank)
        res: dict[str, Any] = {}
        # DeepSpeed's universal checkpoint: weights and optimizer state from <tag>/zero/<param>/*.pt
        engine = _engine(2, stage, universal=True)
        path, _ = engine.load_checkpoint(ckpt, tag=UNIVERSAL_TAG)
        res["path"], res["global_steps"], res["layouts"] = path, engine.global_steps, _layouts(engine)
        res["state"] = _full_state(engine)
        res["losses"] = _steps(engine, data, range(SAVE_STEP, SAVE_STEP + AFTER))
        res["steps_after"] = _full_state(engine)["steps"]
        engine.destroy()
        # ds_cobalt's portable state of the original tag (the reference the project already trusts)
        engine = _engine(2, stage)
        engine.load_checkpoint(ckpt, tag=TAG, load_module_only=True, cobalt_portable_state=True)
        res["portable_global_steps"], res["portable_state"] = engine.global_steps, _full_state(engine)
        res["portable_losses"] = _steps(engine, data, range(SAVE_STEP, SAVE_STEP + AFTER))
        res["portable_steps_after"] = _full_state(engine)["steps"]
        engine.destroy()
        out[stage] = res
    return out


def _convert(tag_dir: str) -> None:
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag_dir,
           "--output_folder", f"{tag_dir}_universal", "--num_extract_workers", "1", "--num_merge_workers", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"ds_to_universal failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-6000:]}")


def _field(fields: list[str], row: np.ndarray, name: str) -> np.ndarray:
    n = row.size // len(fields)
    i = fields.index(name)
    return row[i * n: (i + 1) * n]


def test_autoep_checkpoint_4_ranks_to_2_ranks_through_universal_checkpoint(run_ranks: Any, tmp_path) -> None:
    import torch

    saved = run_ranks(_save_at_4, 4, str(tmp_path), ranks_per_node=2, timeout=300)
    for stage in STAGES:
        _convert(str(tmp_path / f"zero{stage}" / TAG))
        assert (tmp_path / f"zero{stage}" / "latest_universal").read_text().strip() == UNIVERSAL_TAG
        # ds_cobalt's side files stay in the original tag: the converter copies neither (the load below must
        # not need them)
        names = {f"cobalt_{kind}_rank{r}.{ext}" for r in range(4)
                 for kind, ext in (("replan", "safetensors"), ("state", "json"), ("state", "safetensors"))}
        assert names <= set(os.listdir(tmp_path / f"zero{stage}" / TAG))
        assert not names & set(os.listdir(tmp_path / f"zero{stage}" / UNIVERSAL_TAG))
    res = run_ranks(_load_at_2, 2, str(tmp_path), ranks_per_node=2, timeout=300)

    contiguous4, contiguous2 = np.arange(8).reshape(4, 2), np.arange(8).reshape(2, 4)
    for stage in STAGES:
        ref = {key: value for r in saved for key, value in r[stage]["state"]["rows"].items()}
        experts = sorted(k for k in ref if ".experts." in k and k.split(".experts.")[1].split(".")[0].isdigit())
        assert len(experts) == 2 * 8 * 3 and len(ref) > len(experts)  # 2 layers x 8 experts x w1/w2/w3, + dense
        # The save happened in the migrated layout, and every expert's state is distinct: files written in the
        # training layout's physical order (expert MIGRATED[l].flat[p] in file row p) would fail every check below.
        for r in saved:
            owners = [np.asarray(s)[:, :2] for s in r[stage]["layouts"]]
            assert all(np.array_equal(o, m) for o, m in zip(owners, MIGRATED))
            assert all(not np.array_equal(o, contiguous4) for o in owners)
            assert r[stage]["layouts_after_save"] == r[stage]["layouts"]  # back in the training layout
        for key in experts:
            layer, rest = key.split(".experts.")
            e, weight = rest.split(".")
            others = [ref[f"{layer}.experts.{o}.{weight}"][1] for o in range(8) if o != int(e)]
            assert all(not np.array_equal(ref[key][1], other) for other in others), key

        # The converter's consolidated tensors hold logical expert e in row e (fp32 master and both moments).
        universal = tmp_path / f"zero{stage}" / UNIVERSAL_TAG / "zero"
        for key in experts:
            layer, rest = key.split(".experts.")
            e, weight = rest.split(".")
            fields, row = ref[key]
            for name in ("fp32", "exp_avg", "exp_avg_sq"):
                full = torch.load(universal / f"{layer}.experts.{weight}" / f"{name}.pt", weights_only=False)["param"]
                assert tuple(full.shape)[0] == 8, (key, tuple(full.shape))
                np.testing.assert_array_equal(full[int(e)].detach().reshape(-1).numpy(), _field(fields, row, name),
                                              err_msg=f"zero{stage} {universal} {key} {name}")

        saved_steps = saved[0][stage]["state"]["steps"]
        assert [s for _, s in saved_steps] == [float(SAVE_STEP)] * len(saved_steps)
        for rank, r in enumerate(res):
            out = r[stage]
            assert out["path"] is not None
            assert out["global_steps"] == SAVE_STEP and out["portable_global_steps"] == SAVE_STEP
            # EP 2 starts in DeepSpeed's contiguous layout (the saved layout is for EP 4)
            assert all(np.array_equal(np.asarray(s)[:, :4], contiguous2) for s in out["layouts"])
            # every parameter this rank holds: weight, fp32 master, exp_avg, exp_avg_sq as the 4-rank run had them
            for key, (fields, row) in out["state"]["rows"].items():
                assert fields == ref[key][0], key
                np.testing.assert_array_equal(row, ref[key][1], err_msg=f"zero{stage} rank {rank} {key}")
            assert out["state"]["steps"] == saved_steps, (out["state"]["steps"], saved_steps)
            # the same state through ds_cobalt's portable state, and then the same training
            for key, (_, row) in out["portable_state"]["rows"].items():
                np.testing.assert_array_equal(row, out["state"]["rows"][key][1], err_msg=key)
            # (bit for bit here: same config, layout, data and state; 1e-6 is the contract)
            np.testing.assert_allclose(out["losses"], out["portable_losses"], rtol=0, atol=1e-6,
                                       err_msg=f"zero{stage} rank {rank}")
            assert out["steps_after"] == out["portable_steps_after"]
            assert [s for _, s in out["steps_after"]] == [float(SAVE_STEP + AFTER)] * len(out["steps_after"])
            assert np.isfinite(out["losses"]).all()
        assert {k for r in res for k in r[stage]["state"]["rows"]} == set(ref)  # every parameter came back
