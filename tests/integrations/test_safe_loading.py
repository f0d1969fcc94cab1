"""Loading user files never unpickles: the portable checkpoint state (safetensors + JSON manifest, the old `.pt`
only through torch's restricted unpickler) and routing traces (`.npz`, no object arrays).

A crafted pickle whose payload would create a marker file is put where each format is expected; the load is
refused with an error naming the file, and the marker never appears. Most tests call the read functions
directly on files written here; one goes through a real 2-rank engine's save_checkpoint / load_checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")


class _Payload:
    """Unpickling this calls `open(marker, "w")`: the marker file exists iff the pickle was executed."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _portable():
    from ds_cobalt.integrations import portable

    return portable


ROWS = [
    {"inp.weight": torch.arange(6, dtype=torch.float32), "moes.0.experts.3.fc1.bias": torch.ones(4)},
    {"moes.0.experts.1.fc1.bias": torch.full((4,), -2.5)},
]
FIELDS = [{"inp.weight": ["weight", "fp32", "exp_avg"], "moes.0.experts.3.fc1.bias": ["weight", "fp32"]},
          {"moes.0.experts.1.fc1.bias": ["weight", "fp32"]}]


def _write(directory: Path, save_id: str = "s1", world: int = 2) -> None:
    for rank in range(world):
        _portable().write_state_files(str(directory), rank=rank, world_size=world, save_id=save_id,
                                      rows=ROWS[rank], fields=FIELDS[rank], group_steps=[3.0, 3.0],
                                      global_steps=3)


def _manifest(directory: Path, rank: int) -> Path:
    return directory / f"cobalt_state_rank{rank}.json"


def _tensors(directory: Path, rank: int) -> Path:
    return directory / f"cobalt_state_rank{rank}.safetensors"


def _edit_manifest(directory: Path, rank: int, changes: dict[str, Any]) -> None:
    path = _manifest(directory, rank)
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.fixture(name="marker")
def _marker(tmp_path: Path) -> Path:
    marker = tmp_path / "PAYLOAD_RAN"
    # the payload is live: plain pickle.loads runs it (so a missing marker below means "refused")
    control = tmp_path / "control_marker"
    pickle.loads(pickle.dumps(_Payload(str(control))))
    assert control.exists()
    return marker


# ------------------------------------------------------------------------------------ format round trip
def test_files_round_trip_bit_for_bit(tmp_path: Path) -> None:
    _write(tmp_path)
    portable = _portable()
    assert sorted(os.listdir(tmp_path)) == [f"cobalt_state_rank{r}.{ext}" for r in range(2)
                                            for ext in ("json", "safetensors")]  # no .tmp left behind
    assert portable.has_portable_state(str(tmp_path)) and not portable.has_portable_state(str(tmp_path / "none"))
    manifest = json.loads(_manifest(tmp_path, 1).read_text())
    assert manifest["format"] == "ds-cobalt/portable-state-v2" and manifest["rank"] == 1
    assert manifest["world_size"] == 2 and manifest["tensors"] == "cobalt_state_rank1.safetensors"
    assert manifest["tensors_bytes"] == _tensors(tmp_path, 1).stat().st_size
    state = portable.read_state_files(str(tmp_path))
    assert state.fields == {**FIELDS[0], **FIELDS[1]}
    assert state.group_steps == [3.0, 3.0] and state.global_steps == 3
    for key, row in {**ROWS[0], **ROWS[1]}.items():
        assert torch.equal(state.rows[key], row) and state.rows[key].dtype == torch.float32


def test_leftover_files_of_a_larger_older_save_are_ignored(tmp_path: Path) -> None:
    _write(tmp_path, save_id="old", world=2)
    _portable().write_state_files(str(tmp_path), rank=0, world_size=1, save_id="new", rows=ROWS[0],
                                  fields=FIELDS[0], group_steps=[], global_steps=5)
    state = _portable().read_state_files(str(tmp_path))
    assert set(state.rows) == set(ROWS[0]) and state.global_steps == 5


# ------------------------------------------------------------------------------- crafted pickles refused
@pytest.mark.parametrize("size_matches", [False, True])
def test_pickle_as_tensors_file_is_refused_not_run(tmp_path: Path, marker: Path, size_matches: bool) -> None:
    _write(tmp_path)
    evil = pickle.dumps(_Payload(str(marker)))
    _tensors(tmp_path, 1).write_bytes(evil)
    if size_matches:  # get past the size check to the safetensors parser
        _edit_manifest(tmp_path, 1, {"tensors_bytes": len(evil)})
    with pytest.raises(ValueError, match="cobalt_state_rank1.safetensors") as err:
        _portable().read_state_files(str(tmp_path))
    assert ("not a readable safetensors file" if size_matches else "bytes") in str(err.value)
    assert not marker.exists()


def test_pickle_as_manifest_is_refused_not_run(tmp_path: Path, marker: Path) -> None:
    _write(tmp_path)
    _manifest(tmp_path, 0).write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(ValueError, match=r"cobalt_state_rank0\.json is not a JSON manifest"):
        _portable().read_state_files(str(tmp_path))
    assert not marker.exists()


@pytest.mark.parametrize("how", ["torch.save", "raw pickle"])
def test_old_pt_file_with_code_is_refused_not_run(tmp_path: Path, marker: Path, how: str) -> None:
    path = tmp_path / "cobalt_state_rank0.pt"
    payload = {"format": "ds-cobalt/portable-state-v1", "rank": 0, "rows": {}, "fields": {},
               "group_steps": [], "global_steps": 0, "x": _Payload(str(marker))}
    if how == "torch.save":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload))
    assert not marker.exists()
    portable = _portable()
    assert portable.has_portable_state(str(tmp_path))  # so load_checkpoint reports it instead of skipping it
    with pytest.raises(ValueError, match=r"cobalt_state_rank0\.pt is the old pickle-based format") as err:
        portable.read_state_files(str(tmp_path))
    assert "load_checkpoint" in str(err.value)  # says how to proceed
    assert not marker.exists()


def test_old_pt_file_with_plain_content_loads_with_weights_only(tmp_path: Path) -> None:
    for rank in range(2):
        torch.save({"format": "ds-cobalt/portable-state-v1", "rank": rank, "rows": ROWS[rank],
                    "fields": FIELDS[rank], "group_steps": [2.0], "global_steps": 2},
                   tmp_path / f"cobalt_state_rank{rank}.pt")
    state = _portable().read_state_files(str(tmp_path))
    assert state.fields == {**FIELDS[0], **FIELDS[1]} and state.global_steps == 2 and state.group_steps == [2.0]
    assert all(torch.equal(state.rows[k], v) for k, v in {**ROWS[0], **ROWS[1]}.items())


def test_old_pt_file_of_another_tool_is_refused(tmp_path: Path) -> None:
    torch.save({"model": torch.ones(2)}, tmp_path / "cobalt_state_rank0.pt")
    with pytest.raises(ValueError, match=r"cobalt_state_rank0\.pt is not a ds_cobalt portable-state file"):
        _portable().read_state_files(str(tmp_path))


# ----------------------------------------------------------------------- truncated, missing, foreign files
@pytest.mark.parametrize("size_matches", [False, True])
def test_truncated_tensors_file_names_the_file(tmp_path: Path, size_matches: bool) -> None:
    _write(tmp_path)
    path = _tensors(tmp_path, 0)
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 7])
    if size_matches:
        _edit_manifest(tmp_path, 0, {"tensors_bytes": path.stat().st_size})
    match = "not a readable safetensors file" if size_matches else "truncated"
    with pytest.raises(ValueError, match=rf"cobalt_state_rank0\.safetensors .*{match}"):
        _portable().read_state_files(str(tmp_path))


def test_truncated_manifest_names_the_file(tmp_path: Path) -> None:
    _write(tmp_path)
    path = _manifest(tmp_path, 1)
    path.write_text(path.read_text()[:40])
    with pytest.raises(ValueError, match=r"cobalt_state_rank1\.json is not a JSON manifest"):
        _portable().read_state_files(str(tmp_path))


@pytest.mark.parametrize("rank", [0, 1])
def test_missing_manifest_names_it(tmp_path: Path, rank: int) -> None:
    _write(tmp_path)
    _manifest(tmp_path, rank).unlink()
    assert _portable().has_portable_state(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=rf"manifest .*cobalt_state_rank{rank}\.json is missing"):
        _portable().read_state_files(str(tmp_path))


def test_missing_tensors_file_names_it(tmp_path: Path) -> None:
    _write(tmp_path)
    _tensors(tmp_path, 1).unlink()
    with pytest.raises(FileNotFoundError, match=r"cobalt_state_rank1\.safetensors is missing"):
        _portable().read_state_files(str(tmp_path))


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no cobalt_state_rank"):
        _portable().read_state_files(str(tmp_path))


@pytest.mark.parametrize("content", [
    {"format": "ds-cobalt/layout-v1", "num_experts": 8},  # another ds_cobalt file
    {"rank": 0, "world_size": 2},  # no format at all
    [1, 2, 3],
])
def test_foreign_manifest_is_refused(tmp_path: Path, content: Any) -> None:
    _write(tmp_path)
    _manifest(tmp_path, 0).write_text(json.dumps(content))
    with pytest.raises(ValueError, match=r"cobalt_state_rank0\.json is not a ds_cobalt portable-state manifest"):
        _portable().read_state_files(str(tmp_path))


@pytest.mark.parametrize(("changes", "match"), [
    ({"rank": 1}, "'rank' must be 0"),
    ({"tensors": "../../elsewhere.safetensors"}, "'tensors' must be 'cobalt_state_rank0.safetensors'"),
    ({"keys": ["inp.weight"]}, "'fields' must be"),
    ({"global_steps": "3"}, "'global_steps' must be an int"),
    ({"world_size": None}, "'world_size' must be an int"),
])
def test_manifest_with_bad_fields_is_refused(tmp_path: Path, changes: dict, match: str) -> None:
    _write(tmp_path)
    _edit_manifest(tmp_path, 0, changes)
    with pytest.raises(ValueError, match=rf"cobalt_state_rank0\.json: {match}"):
        _portable().read_state_files(str(tmp_path))


def test_files_of_two_saves_are_not_mixed(tmp_path: Path) -> None:
    _write(tmp_path, save_id="save-a")
    other = tmp_path / "other"
    _write(other, save_id="save-b")
    shutil.copy(_manifest(other, 1), _manifest(tmp_path, 1))
    with pytest.raises(ValueError, match=r"cobalt_state_rank1\.json is from another save"):
        _portable().read_state_files(str(tmp_path))
    _write(tmp_path, save_id="save-a")
    shutil.copy(_tensors(other, 1), _tensors(tmp_path, 1))  # same size, other save's header
    with pytest.raises(ValueError, match=r"cobalt_state_rank1\.safetensors is not the tensors file"):
        _portable().read_state_files(str(tmp_path))


def test_tensor_of_wrong_dtype_is_refused(tmp_path: Path) -> None:
    _portable().write_state_files(str(tmp_path), rank=0, world_size=1, save_id="s", rows={"w": torch.ones(2, 2)},
                                  fields={"w": ["weight"]}, group_steps=[], global_steps=0)
    with pytest.raises(ValueError, match=r"cobalt_state_rank0\.safetensors: w must be a 1-D float32 tensor"):
        _portable().read_state_files(str(tmp_path))


# ------------------------------------------------------------------------------------------- traces
def test_trace_with_object_array_is_refused_not_run(tmp_path: Path, marker: Path) -> None:
    from ds_cobalt.planner.trace import load_trace

    path = tmp_path / "trace.npz"
    experts = np.empty((1, 1, 1), dtype=object)
    experts[0, 0, 0] = _Payload(str(marker))
    np.savez(path, experts=experts, num_experts=np.int64(4))  # np.savez pickles object arrays
    assert not marker.exists()
    with pytest.raises(ValueError, match=r"trace .*trace\.npz: cannot read field 'experts'.*pickles"):
        load_trace(path)
    assert not marker.exists()


def test_pickle_named_like_a_trace_is_refused_not_run(tmp_path: Path, marker: Path) -> None:
    from ds_cobalt.planner.trace import load_trace

    path = tmp_path / "trace.npz"
    path.write_bytes(pickle.dumps({"experts": _Payload(str(marker))}))
    with pytest.raises(ValueError, match=r"trace .*trace\.npz: not a readable \.npz file"):
        load_trace(path)
    assert not marker.exists()


# ------------------------------------------------------------------- the real save/load path, 2 ranks
E, D, HIDDEN = 4, 8, 16


def _build_engine(stage: int):
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from test_migration import expert_mlp

    import ds_cobalt

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(D, D)
            self.moe = ds_cobalt.MoE(D, expert_mlp(D, HIDDEN), num_experts=E, ep_size=2, k=2, drop_tokens=False,
                                     top2_2nd_expert_sampling=False)

        def forward(self, x, y):
            out, l_aux, _ = self.moe(self.inp(x))
            return ((out - y) ** 2).mean() + 0.01 * l_aux

    torch.manual_seed(dist.get_rank())  # ranks differ; the loaded state must still be the saved one
    model = Net()
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "cobalt": {}}
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"})
    engine, *_ = ds_cobalt.initialize(model=model, model_parameters=groups, config=config)
    return engine


def _full_state(engine) -> dict[str, np.ndarray]:
    from ds_cobalt.integrations.expert_state import ExpertStateIO
    from ds_cobalt.integrations.portable import _keyed_parameters

    return {key: ExpertStateIO(engine, piece[0]).read([piece]).numpy().copy()
            for key, piece, _ in _keyed_parameters(engine)}


def _save_then_load(rank: int, world: int, root: str, marker: str, stage: int) -> dict:
    import torch.distributed as dist

    engine = _build_engine(stage)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        loss = engine(torch.randn(4, D, generator=g), torch.randn(4, D, generator=g))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(root, tag="good")
    saved = _full_state(engine)
    engine.destroy()
    dist.barrier()
    if rank == 0:  # the same checkpoint, its portable state swapped for old-format files that carry code
        shutil.copytree(os.path.join(root, "good"), os.path.join(root, "evil"))
        for name in os.listdir(os.path.join(root, "evil")):
            if name.startswith("cobalt_state_rank"):
                os.remove(os.path.join(root, "evil", name))
        for r in range(world):
            torch.save({"format": "ds-cobalt/portable-state-v1", "rank": r, "x": _Payload(marker)},
                       os.path.join(root, "evil", f"cobalt_state_rank{r}.pt"))
    dist.barrier()
    out: dict[str, Any] = {"saved": saved, "files": sorted(n for n in os.listdir(os.path.join(root, "good"))
                                                           if n.startswith("cobalt_state"))}
    engine = _build_engine(stage)
    engine.load_checkpoint(root, tag="good", load_module_only=True, cobalt_portable_state=True)
    out["loaded"], out["global_steps"] = _full_state(engine), engine.global_steps
    try:
        engine.load_checkpoint(root, tag="evil", load_module_only=True, cobalt_portable_state=True)
        out["evil_error"] = None
    except ValueError as err:
        out["evil_error"] = str(err)
    out["marker_after_load"] = os.path.exists(marker)
    return out


@pytest.mark.parametrize("stage", [0, 2])
def test_real_checkpoint_round_trip_and_evil_old_format(run_ranks: Any, tmp_path: Path, stage: int) -> None:
    marker = tmp_path / "PAYLOAD_RAN"
    res = run_ranks(_save_then_load, 2, str(tmp_path / "ckpt"), str(marker), stage, timeout=240)
    saved = {k: v for r in res for k, v in r["saved"].items()}
    for r in res:
        assert r["files"] == [f"cobalt_state_rank{i}.{ext}" for i in range(2) for ext in ("json", "safetensors")]
        assert r["global_steps"] == 3
        for key, row in r["loaded"].items():  # weights, master copies and Adam moments, bit for bit
            np.testing.assert_array_equal(row, saved[key], err_msg=key)
        assert r["evil_error"] is not None and "old pickle-based format" in r["evil_error"]
        assert "cobalt_state_rank0.pt" in r["evil_error"]
        assert not r["marker_after_load"]
    assert not marker.exists()
