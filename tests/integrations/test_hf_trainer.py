"""HuggingFace Trainer glue: `ds_cobalt.hf.CobaltCallback` in a real Trainer, and the AutoEP example under the
real `deepspeed` launcher (4 CPU ranks as 2 nodes x 2)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from conftest import REPO_ROOT, free_port, remove_deepspeed_shm

D, VOCAB = 16, 32


def _tiny_lm():
    import torch

    import ds_cobalt

    class TinyMoELM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(VOCAB, D)
            expert = torch.nn.Sequential(torch.nn.Linear(D, 32), torch.nn.ReLU(), torch.nn.Linear(32, D))
            self.moe = ds_cobalt.MoE(D, expert, num_experts=4, ep_size=1, k=2)
            self.out = torch.nn.Linear(D, VOCAB)

        def forward(self, input_ids, labels):
            h = self.emb(input_ids)
            moe_out, aux, _ = self.moe(h)
            logits = self.out(h + moe_out)
            loss = (
                torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)) + 0.01 * aux
            )
            return {"loss": loss}

    return TinyMoELM()


def test_callback_metrics_reach_every_reporter(tmp_path: Path) -> None:
    """Single process, no DeepSpeed: the callback moves itself first, so reporters listed before it (as the
    Trainer's own TensorBoard/W&B callbacks are) see the cobalt/* metrics; log_history has them too."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ds_cobalt.hf import CobaltCallback
    from ds_cobalt.integrations.layers import layer_cores

    seen: list[dict] = []

    class Reporter(TrainerCallback):  # stands in for TensorBoardCallback
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    rows = torch.randint(0, VOCAB, (16, 8), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": r, "labels": r} for r in rows]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=4,
        logging_steps=2,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    callback = CobaltCallback({"traffic": {"log_interval": 0}})
    trainer = Trainer(model=_tiny_lm(), args=args, train_dataset=dataset, callbacks=[Reporter(), callback])
    assert trainer.callback_handler.callbacks[0] is callback
    trainer.train()
    logged = [row for row in seen if "loss" in row]
    assert len(logged) == 2
    for row in logged:
        assert row["cobalt/tokens"] == 2 * 4 * 8  # two steps of 4 x 8 tokens per logging window
        assert row["cobalt/inter_node_bytes"] == 0  # one rank, one node
        assert row["cobalt/expert_load_max_over_mean"] >= 1.0
        # every MoE layer on one schedule (one rank: dense, nothing to send), not summed over the window
        counts = {s: row[f"cobalt/layers_{s}"] for s in ("hierarchical", "direct", "dense", "undecided")}
        assert counts == {"hierarchical": 0, "direct": 0, "dense": len(layer_cores(trainer.model)), "undecided": 0}
    history = [row for row in trainer.state.log_history if "loss" in row]
    assert all("cobalt/tokens" in row for row in history)


def test_callback_config_errors_name_the_key(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from ds_cobalt.hf import CobaltCallback

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"cobalt\.topology\.ranks_per_nod: unknown key"):
        Trainer(model=_tiny_lm(), args=args, callbacks=[CobaltCallback({"topology": {"ranks_per_nod": 2}})])


# ------------------------------------------------------------------------------ the example, launcher
STEPS = 12
FULL_COBALT = {  # everything on, so the Trainer path exercises it: replanning with replicas, migration, overlap
    "topology": {"ranks_per_node": 2},
    "planner": {"replan_interval": 4, "redundant_slots": 1, "apply_lag": 1},
    "migration": {"ignore_cost_model": True},
    "overlap": {"enabled": True, "tile_rows": 64},
    "transport": {"schedule": "hierarchical"},  # the overlapped schedule itself (`auto` may keep dense here)
}


def _launch_example(tmp_path: Path, name: str, config: Path, *extra: str) -> dict:
    beside = Path(sys.executable).with_name("deepspeed")
    deepspeed_bin = str(beside) if beside.exists() else shutil.which("deepspeed")
    assert deepspeed_bin, "the deepspeed launcher is not on PATH (pip install -e .[test,hf])"
    metrics = tmp_path / f"{name}.json"
    port = free_port()
    cmd = [deepspeed_bin, "--num_gpus", "4", "--master_port", str(port),
           str(REPO_ROOT / "examples" / "hf_trainer_mixtral.py"), "--deepspeed", str(config),
           "--steps", str(STEPS), "--output-dir", str(tmp_path / name), "--metrics-out", str(metrics),
           *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    try:
        proc = subprocess.run(cmd, check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=420,
                              stdin=subprocess.DEVNULL)  # fmt: skip
    finally:
        remove_deepspeed_shm(port)
    log = (proc.stdout + proc.stderr)[-8000:]
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{log}"
    assert "=== hf_trainer_mixtral report" in proc.stdout, log
    return json.loads(metrics.read_text())


@pytest.mark.slow
def test_hf_trainer_example_under_deepspeed_launcher(tmp_path: Path) -> None:
    """Plain AutoEP vs AutoEP + CobaltCallback (replanning, migrations, overlap, a Trainer checkpoint in the
    middle, then the default section with the Trainer's gradient checkpointing), all through the real Trainer and
    `deepspeed` launcher: same unrounded losses (1e-5)."""
    template = json.loads((REPO_ROOT / "ds_config_templates" / "hf_autoep_cpu.json").read_text())
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({**template, "cobalt": FULL_COBALT}))
    plain = _launch_example(tmp_path, "plain", config, "--no-cobalt", "--save-steps", str(STEPS // 2))
    m = _launch_example(tmp_path, "cobalt", config, "--save-steps", str(STEPS // 2))
    assert m["world_size"] == 4 and m["cobalt"] is True and plain["cobalt"] is False
    assert len(m["losses"]) == STEPS and all(math.isfinite(x) for x in m["losses"])
    assert 5.0 < m["losses"][0] < 6.0, "first loss should be near ln(256) = 5.55"
    assert m["losses"][-1] < m["losses"][0]
    assert len(m["exact_losses"]) == STEPS
    assert len(m["step_times_s"]) == STEPS and all(t > 0 for t in m["step_times_s"])
    np.testing.assert_allclose(m["exact_losses"], plain["exact_losses"], rtol=0, atol=1e-5)
    c = m["cobalt_metrics"]
    assert len(c["cobalt/tokens"]) == STEPS and set(c["cobalt/tokens"]) == {4 * 4 * 64}  # ranks x batch x seq
    assert all(0 < r < 1 for r in c["cobalt/inter_node_vs_baseline"]), c  # fewer bytes than AutoEP's all-to-all
    assert all(x > 0 for x in c["cobalt/intra_node_bytes"])
    assert sum(c["cobalt/migrations"]) >= 1 and sum(c["cobalt/experts_moved"]) > 0, c
    assert sum(c["cobalt/migration_failures"]) == 0
    assert set(c["cobalt/layers_hierarchical"]) == {2.0} and set(c["cobalt/layers_dense"]) == {0.0}  # pinned
    # the Trainer's checkpoint went through ds_cobalt's save wrapper (logical order + portable state)
    saved = tmp_path / "cobalt" / f"checkpoint-{STEPS // 2}" / f"global_step{STEPS // 2}"
    manifests = sorted(p.name for p in saved.glob("cobalt_state_rank*.json"))
    assert manifests == [f"cobalt_state_rank{r}.json" for r in range(4)]
    # ... and its `model.safetensors` (`Trainer.save_model`: the module's state dict) holds the same experts under
    # the same names as plain AutoEP's, after migrations (it held the migrated slots' experts, 0.15 apart)
    from safetensors.torch import load_file

    ours, theirs = (load_file(tmp_path / run / f"checkpoint-{STEPS // 2}" / "model.safetensors")
                    for run in ("cobalt", "plain"))
    experts = [k for k in theirs if ".experts." in k]
    assert experts and set(ours) == set(theirs)
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in experts) < 1e-4
    # Trainer.train(resume_from_checkpoint=...) from that checkpoint (taken in a migrated layout, replicas on):
    # the callback converts the engine before the Trainer's load, so the resumed steps repeat bit for bit
    resumed = _launch_example(tmp_path, "resumed", config, "--resume-from-checkpoint",
                              str(tmp_path / "cobalt" / f"checkpoint-{STEPS // 2}"))
    assert resumed["exact_losses"] == m["exact_losses"][STEPS // 2:]
    assert sum(resumed["cobalt_metrics"]["cobalt/migrations"]) >= 1  # the re-planner went on migrating
    # the Trainer's activation checkpointing (transformers' default form, non-reentrant) under the template's bare
    # section: each decoder layer's recomputation repeats its forward's schedule (it failed with "Recomputed values
    # ... have different metadata" when it picked another one)
    bare = REPO_ROOT / "ds_config_templates" / "hf_autoep_cpu.json"
    checkpointed = _launch_example(tmp_path, "checkpointed", bare, "--gradient-checkpointing")
    assert checkpointed["gradient_checkpointing"] is True
    np.testing.assert_allclose(checkpointed["exact_losses"], plain["exact_losses"], rtol=0, atol=1e-5)
