"""Train a tiny randomly initialised Mixtral (or Qwen3-MoE / DeepSeek-V3) with the HuggingFace Trainer,
DeepSpeed AutoEP and ds_cobalt's dispatcher, on CPU.

    deepspeed --num_gpus 4 examples/hf_trainer_mixtral.py --deepspeed ds_config_templates/hf_autoep_cpu.json \
        [--model mixtral|qwen3_moe|deepseek_v3] [--steps 30] [--no-cobalt] [--save-steps N] [--metrics-out m.json]

The config's `"expert_parallel"` section makes DeepSpeed replace the model's MoE blocks by AutoEP layers
inside the engine the Trainer builds; its `"cobalt"` section plus `callbacks=[CobaltCallback()]` make those
layers move tokens through ds_cobalt (4 CPU ranks as 2 nodes x 2 with `cobalt.topology.ranks_per_node=2`).
`--no-cobalt` runs plain AutoEP (no callback, the `"cobalt"` section removed) for comparison: same seed,
same data, same losses. Data: byte windows of Python's standard-library source (no downloads).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from moe_lm import load_corpus  # examples/moe_lm.py: the stdlib source as bytes
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from ds_cobalt.commands.arg_types import positive_int

VOCAB = 256  # bytes


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model's and the batch's arguments (also `benchmarks/autoep_paired_steps.py`'s)."""
    p.add_argument("--model", choices=["mixtral", "qwen3_moe", "deepseek_v3"], default="mixtral")
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed", required=True, help="DeepSpeed JSON with 'expert_parallel' (and 'cobalt')")
    p.add_argument("--steps", type=positive_int, default=30)
    add_model_arguments(p)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--logging-steps", type=int, default=1)
    p.add_argument("--save-steps", type=int, default=0, help="Trainer checkpoints every N steps (0: none)")
    p.add_argument("--resume-from-checkpoint", default=None,
                   help="a Trainer checkpoint folder (OUTPUT/checkpoint-N) to resume from (Trainer.train's argument)")
    p.add_argument(
        "--no-cobalt", action="store_true", help="plain AutoEP: no CobaltCallback, no 'cobalt' section"
    )
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="the Trainer's activation checkpointing (transformers' default: non-reentrant)")
    p.add_argument("--report-to", default="none", help="Trainer reporters, e.g. tensorboard (default: none)")
    p.add_argument("--output-dir", default=None, help="Trainer output dir (default: a temporary one)")
    p.add_argument(
        "--metrics-out", default=None, help="rank 0 writes losses, step times, cobalt metrics and settings here"
    )
    p.add_argument(
        "--local_rank", type=int, default=-1, help=argparse.SUPPRESS
    )  # set by the deepspeed launcher
    return p.parse_args(argv)


def model_config(args: argparse.Namespace):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
        num_experts_per_tok=args.top_k,
        tie_word_embeddings=False,
    )
    if args.model == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(num_local_experts=args.experts, **common)
    if args.model == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            num_experts=args.experts,
            moe_intermediate_size=args.hidden,
            decoder_sparse_step=1,
            head_dim=args.hidden // 4,
            norm_topk_prob=True,
            **common,
        )
    from transformers import DeepseekV3Config

    # every layer MoE, no expert groups, no shared-expert width beyond one expert
    return DeepseekV3Config(
        n_routed_experts=args.experts,
        moe_intermediate_size=args.hidden,
        n_shared_experts=1,
        first_k_dense_replace=0,
        n_group=1,
        topk_group=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        **{**common, "num_key_value_heads": 4},
    )


class ByteWindows(torch.utils.data.Dataset):
    """`n` fixed windows of `seq_len` bytes, drawn once from `seed`; labels = inputs (the model shifts)."""

    def __init__(self, corpus: np.ndarray, n: int, seq_len: int, seed: int) -> None:
        starts = np.random.default_rng(seed).integers(0, len(corpus) - seq_len, size=n)
        self.rows = torch.from_numpy(np.stack([corpus[s : s + seq_len] for s in starts]).astype(np.int64))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class StepTimer(TrainerCallback):
    """Wall seconds of each optimizer step (forward, backward and step of every micro-batch), this rank's clock."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._started = 0.0

    def on_step_begin(self, args, state, control, **kwargs: Any) -> None:
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs: Any) -> None:
        self.seconds.append(time.perf_counter() - self._started)


def deepspeed_config(path: str, with_cobalt: bool) -> str | dict[str, Any]:
    if with_cobalt:
        return path  # the Trainer and DeepSpeed ignore the "cobalt" section; CobaltCallback reads it
    config = json.loads(Path(path).read_text())
    config.pop("cobalt", None)
    return config


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(model_config(args), dtype=torch.float32)
    dataset = ByteWindows(load_corpus(1 << 20), args.steps * args.batch_size * world, args.seq_len, args.seed)

    timer = StepTimer()
    callbacks: list[TrainerCallback] = [timer]
    if not args.no_cobalt:
        from ds_cobalt.hf import CobaltCallback

        callbacks.append(CobaltCallback())
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="hf_trainer_mixtral_")
    training_args = TrainingArguments(
        output_dir=output_dir, deepspeed=deepspeed_config(args.deepspeed, not args.no_cobalt),
        use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=args.batch_size, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=args.logging_steps,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        save_only_model=False, report_to=args.report_to, seed=args.seed, data_seed=args.seed,
        dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=args.gradient_checkpointing,
    )  # fmt: skip
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=callbacks)
    # What rank 0's forward returned, unrounded (the logs round to 4 decimals). The Trainer divides by the token
    # count of all ranks (average_tokens_across_devices), so these are about loss / world_size.
    exact_losses: list[float] = []
    model.register_forward_hook(lambda module, inputs, out: exact_losses.append(float(out.loss.detach())))
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)

    if trainer.is_world_process_zero():
        history = [row for row in trainer.state.log_history if "loss" in row]
        cobalt = {
            key: [row[key] for row in history if key in row]
            for key in sorted({k for row in history for k in row if k.startswith("cobalt/")})
        }
        report = {
            "model": args.model, "cobalt": not args.no_cobalt, "world_size": world, "steps": args.steps,
            "gradient_checkpointing": args.gradient_checkpointing,
            "losses": [row["loss"] for row in history], "exact_losses": exact_losses,
            "train_loss": result.training_loss, "step_times_s": timer.seconds,
            "cobalt_metrics": cobalt,
        }  # fmt: skip
        print("=== hf_trainer_mixtral report ===")
        print(json.dumps({k: v for k, v in report.items() if k not in ("cobalt_metrics", "step_times_s")},
                         indent=None)[:2000])
        first = len(timer.seconds) // 5  # left out: warm-up, and cobalt's schedule trials
        if timer.seconds[first:]:
            print(f"step time: median {1e3 * float(np.median(timer.seconds[first:])):.1f} ms over steps "
                  f"{first + 1}-{len(timer.seconds)}")
        for key, values in cobalt.items():
            # sums over the logging windows: bytes, tokens, migrations; ratios and layer counts are per window
            summed = not key.startswith("cobalt/layers_") and key not in (
                "cobalt/inter_node_vs_baseline", "cobalt/expert_load_max_over_mean")
            print((f"{key}: last {values[-1]:.4g}" + (f", total {sum(values):.4g}" if summed else "")) if values
                  else key)
        if args.metrics_out:
            Path(args.metrics_out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
