"""Adaptive tile size for the overlapped schedule: a cost-model guess refined by a short measurement.

Smaller tiles expose less communication before the first expert compute can start but pay a per-message
cost; the guess aims at messages of `target_message_bytes`, then the tuner times the layer's forward at
a few sizes around the guess (one forward each, after one warm-up) and keeps the fastest. Every rank of
the EP group walks the same candidate list and agrees on the winner through one all-reduce, because
sender and receiver must cut rows into the same tiles.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .topology import EPGroups


def guess_tile_rows(row_bytes: int, target_message_bytes: int = 256 << 10) -> int:
    return int(min(4096, max(16, target_message_bytes // max(1, row_bytes))))


class TileTuner:
    """Per-layer state: `tile_rows()` for the next forward, `record(seconds)` after it."""

    def __init__(self, factors: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0), warmup: int = 1) -> None:
        self.factors = factors
        self.warmup = warmup
        self.candidates: list[int] = []
        self.times: list[float] = []
        self.calls = 0
        self.chosen: int | None = None

    def tile_rows(self, row_bytes: int) -> int:
        if self.chosen is not None:
            return self.chosen
        if not self.candidates:
            guess = guess_tile_rows(row_bytes)
            self.candidates = sorted({max(1, int(guess * f)) for f in self.factors})
        trial = max(0, self.calls - self.warmup)
        return self.candidates[min(trial, len(self.candidates) - 1)]

    def start(self, device: torch.device) -> float | None:
        if self.chosen is not None:
            return None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def record(self, started: float | None, device: torch.device, groups: EPGroups) -> None:
        if started is None:
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if self.calls >= self.warmup:
            self.times.append(time.perf_counter() - started)
        self.calls += 1
        if len(self.times) == len(self.candidates):
            times = torch.tensor(self.times, dtype=torch.float64)
            if groups.ep_group is not None:
                dist.all_reduce(times, op=dist.ReduceOp.MAX, group=groups.ep_group)  # slowest rank decides
            self.chosen = self.candidates[int(times.argmin())]
