"""One launch of the soak run (benchmarks/soak.py starts it under the `deepspeed` launcher, 4 CPU ranks as 2 x 2).

Trains examples/moe_lm.py's model with ds_cobalt (hierarchical schedule, re-planning on as by default) and
- every `--migrate-every` steps moves the owners to a random layout (asynchronously, seeded by the step);
- makes every `--fault-every`-th of those migrations fail in its transfer on one rank (fault hook), so it must
  roll back on all ranks;
- saves a checkpoint every `--save-every` steps into `--ckpt` (with torch's RNG state in the client state: the
  gate's second-expert sampling draws from it), and resumes from the latest one when it exists;
- with `--kill-at K` (and no checkpoint to resume from), rank 1 SIGKILLs itself after step K.
Rank 0 appends one JSON line per step (`{"step", "loss"}`) and per migration report (`{"migration", "ok"}`) to
`--log`, flushed as it goes, so a killed launch leaves what it did.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from _job import (
    MoELM,
    add_model_arguments,
    batch_for_rank,
    initialize,
    job_parser,
    load_corpus,
    model_config_from,
    read_config,
    start_job,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = job_parser(__doc__)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--migrate-every", type=int, required=True)
    p.add_argument("--fault-every", type=int, required=True)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--log", required=True)
    add_model_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    import ds_cobalt
    from ds_cobalt.integrations.migration import migrate, set_fault_hook

    rank, world = start_job()
    config = copy.deepcopy(read_config(args.deepspeed_config))
    cobalt = config.setdefault("cobalt", {})
    cobalt["transport"] = {"schedule": "hierarchical"}  # exact resume: fixed choices (schedule, stage 2)
    cobalt["planner"] = {**cobalt.get("planner", {}), "stage2": "step"}
    path = Path(f"/tmp/soak_job_rank{rank}.json")
    path.write_text(json.dumps(config))
    torch.manual_seed(args.seed)
    cfg = model_config_from(args, world)
    engine = initialize("cobalt", MoELM(cfg, ds_cobalt.MoE), str(path), config)
    resumed = (Path(args.ckpt) / "latest").exists()
    if resumed:  # the gate's second-expert sampling draws from torch's RNG: its state is part of the checkpoint
        _, client = engine.load_checkpoint(args.ckpt)
        torch.set_rng_state(client["torch_rng_state"])
    start = int(engine.global_steps)
    log = open(args.log, "a") if rank == 0 else None

    def say(**fields) -> None:
        if log is not None:
            log.write(json.dumps(fields) + "\n")
            log.flush()

    say(launch={"start_step": start, "resumed": resumed})
    failing = {"on": False}

    def fault(stage: str, layer: int) -> None:
        if failing["on"] and stage == "transfer" and rank == layer % world:
            raise RuntimeError("soak: injected transfer failure")

    set_fault_hook(fault)
    corpus = load_corpus(8 << 20)
    micro = engine.train_micro_batch_size_per_gpu()
    seen = len(getattr(engine, "cobalt_migrations", []))
    for step in range(start, args.steps):
        if step and step % args.migrate_every == 0:
            failing["on"] = (step // args.migrate_every) % args.fault_every == 0
            rng = np.random.default_rng(args.seed * 100003 + step)
            layers = ds_cobalt.cobalt_layers(engine)
            W = layers[0].topology.world_size
            migrate(engine, [rng.permutation(layer.num_experts).reshape(W, -1) for layer in layers],
                    reason="soak", asynchronous=True)
        ids, targets = batch_for_rank(corpus, seed=args.seed, step=step, rank=rank, world_size=world,
                                      micro_batch=micro, seq_len=args.seq_len)
        loss, _, _ = engine(ids, targets, 0.01)
        engine.backward(loss)
        engine.step()  # commits what the migration still had in flight
        failing["on"] = False  # faults hit the soak's own migrations only, not the checkpoint's
        mean = loss.detach().double()
        dist.all_reduce(mean)
        say(step=step + 1, loss=float(mean) / world)
        reports = getattr(engine, "cobalt_migrations", [])
        for report in reports[seen:]:
            if report.reason == "soak":
                say(migration=report.step, ok=report.ok)
        seen = len(reports)
        if step + 1 == args.kill_at and rank == 1 and not resumed:
            os.kill(os.getpid(), signal.SIGKILL)
        if (step + 1) % args.save_every == 0:
            engine.save_checkpoint(args.ckpt, client_state={"torch_rng_state": torch.get_rng_state()})
    say(done=args.steps)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
