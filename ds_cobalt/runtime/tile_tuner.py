"""Adaptive granularity for the overlapped schedule: cost-model guesses refined by a short measurement.

Tile size (`overlap.tile_rows: "auto"`): smaller tiles expose less communication before the first expert
compute can start but pay a per-message cost; the guess aims at messages of `target_message_bytes`, then
the tuner times the layer's forward at a few sizes around the guess. Rail chunks (`overlap.rail_chunks:
"auto"`): more chunks hide more of the relays' compute behind the inter-node transfer but add a count
exchange and messages per chunk; the guess is 2, then 1, 2 and 4 are timed (after the tile size is fixed,
so the two measurements do not mix). Overlap itself (`overlap.enabled: "auto"`): with the chosen tiles and
chunks, one forward overlapped and one phased; the faster schedule stays. Each trial is one forward after one
warm-up; the fastest wins. Every rank
of the EP group walks the same candidate list and agrees on the winner through one all-reduce, because
sender and receiver must cut rows into the same tiles and chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from .comm import slowest_rank
from .topology import EPGroups

RAIL_CHUNKS_GUESS = 2
RAIL_CHUNK_CANDIDATES = (1, 2, 4)


def guess_tile_rows(row_bytes: int, target_message_bytes: int = 256 << 10) -> int:
    return int(min(4096, max(16, target_message_bytes // max(1, row_bytes))))


class ChoiceTuner:
    """Times one forward per candidate (after `warmup` forwards) and keeps the fastest."""

    def __init__(self, candidates: Sequence[int] = (), warmup: int = 1) -> None:
        self.warmup = warmup
        self.candidates: list[int] = list(candidates)
        self.times: list[float] = []
        self.calls = 0
        self.chosen: int | None = None

    def value(self) -> int:
        if self.chosen is not None:
            return self.chosen
        trial = max(0, self.calls - self.warmup)
        return self.candidates[min(trial, len(self.candidates) - 1)]

    def start(self, device: torch.device) -> float | None:
        if self.chosen is not None:
            return None
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NOTE: host sync, only during the tuning trials
        return time.perf_counter()

    def record(self, started: float | None, device: torch.device, groups: EPGroups) -> None:
        if started is None:
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NOTE: host sync, only during the tuning trials
        if self.calls >= self.warmup:
            self.times.append(time.perf_counter() - started)
        self.calls += 1
        if len(self.times) == len(self.candidates):
            times = slowest_rank(self.times, groups.ep_group)  # the slowest rank decides
            self.chosen = self.candidates[int(times.argmin())]


class TileTuner(ChoiceTuner):
    """Tile rows: candidates are `factors` times the cost-model guess for the layer's row size."""

    def __init__(self, factors: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0), warmup: int = 1) -> None:
        super().__init__((), warmup)
        self.factors = factors

    def tile_rows(self, row_bytes: int) -> int:
        if not self.candidates:
            guess = guess_tile_rows(row_bytes)
            self.candidates = sorted({max(1, int(guess * f)) for f in self.factors})
        return self.value()


@dataclass(frozen=True)
class OverlapChoice:
    overlap: bool  # overlapped schedule (else the phased one)
    tile_rows: int
    rail_chunks: int
    timed: ChoiceTuner | None  # the tuner this forward is a trial of


class OverlapTuner:
    """Per-layer state for the `"auto"` overlap settings: tile rows first, then rail chunks, then (with
    `enabled: "auto"`) overlapped vs phased with the chosen tiles and chunks."""

    def __init__(self) -> None:
        self.tiles = TileTuner()
        self.chunks = ChoiceTuner(RAIL_CHUNK_CANDIDATES)
        self.mode = ChoiceTuner((1, 0))  # 1: overlapped, 0: phased
        self._last: OverlapChoice | None = None

    def settings(self, row_bytes: int, tile_rows: int | str, rail_chunks: int | str,
                 enabled: bool | str = True, tune: bool = True) -> OverlapChoice:
        """What this forward runs with, for the configured values; at most one tuner is on trial at a time.
        `tune=False` (the schedule itself is on trial, or an eval forward): what is chosen so far, else the guesses
        (the cost model's tile size, `RAIL_CHUNKS_GUESS`, overlapped), timing nothing and advancing no trial."""
        if not tune:
            return self._untuned(row_bytes, tile_rows, rail_chunks, enabled)
        timing: ChoiceTuner | None = None
        if tile_rows == "auto":
            tile_rows = self.tiles.tile_rows(row_bytes)
            if self.tiles.chosen is None:
                timing = self.tiles
        if rail_chunks == "auto":
            if timing is None:
                rail_chunks = self.chunks.value()
                timing = None if self.chunks.chosen is not None else self.chunks
            else:
                rail_chunks = RAIL_CHUNKS_GUESS
        overlap = bool(enabled)
        if enabled == "auto":
            overlap = True
            if timing is None:
                overlap = bool(self.mode.value())
                timing = None if self.mode.chosen is not None else self.mode
        self._last = OverlapChoice(overlap, int(tile_rows), int(rail_chunks), timing)
        return self._last

    def _untuned(self, row_bytes: int, tile_rows: int | str, rail_chunks: int | str,
                 enabled: bool | str) -> OverlapChoice:
        if tile_rows == "auto":
            tile_rows = self.tiles.chosen if self.tiles.chosen is not None else guess_tile_rows(row_bytes)
        if rail_chunks == "auto":
            rail_chunks = self.chunks.chosen if self.chunks.chosen is not None else RAIL_CHUNKS_GUESS
        overlap = bool(self.mode.chosen) if enabled == "auto" and self.mode.chosen is not None else bool(enabled)
        self._last = OverlapChoice(overlap, int(tile_rows), int(rail_chunks), None)
        return self._last

    def replay(self) -> OverlapChoice:
        """The settings of the last forward again, timing nothing: its recomputation inside backward (activation
        checkpointing) must cut the same tiles and chunks."""
        assert self._last is not None, "replay before any forward"
        return replace(self._last, timed=None)

    def chosen(self) -> dict[str, int | None]:
        return {"tile_rows": self.tiles.chosen, "rail_chunks": self.chunks.chosen, "overlap": self.mode.chosen}


class StepTimedChoice:
    """Picks one of `candidates` by timing whole training steps: a trial runs from the layer's forward to the
    end of the optimizer step (`step_end`), or to its next forward where nothing calls `step_end`, so it
    includes the backward (and everything else of the step, which is the same for every candidate). After
    `warmup` steps of the first candidate, `repeats` rounds time every candidate once, round r in the order
    rotated by r (no candidate always first); the lowest median wins, except that `prefer`
    (when it is a candidate) keeps the choice unless the winner is faster by more than `margin` (a fraction of
    its median): a close call on a noisy machine then stays with the safe candidate. Where the cost model
    (`use_model`) does not price the winner's communication at least `clear_saving` (a fraction) below `prefer`'s,
    the winner must be faster by `disputed_margin` instead: the model sees no saving it can resolve, so only a clear
    measurement replaces the safe candidate. Among the others, likewise, the candidate the model prices
    `clear_saving` below the fastest stays unless the fastest is faster by more than `favourite_margin` (default
    `margin`; at 100 Mbit/s here a 2 % faster 3-step median took one layer to `direct`, priced 36 % above
    hierarchical, and its steps then ran ~15 % slower). Every
    rank of the EP group walks the same trials and agrees through one all-reduce (MAX: the slowest rank decides).

    With `screen_ratio`, one more all-reduce after the first round drops the candidates whose first trial took
    more than `screen_ratio` times the fastest first trial, so a clearly slower schedule is not run for all its
    repeats. The first candidate (the model's favourite, which also ran the warm-up) is never dropped, and
    `prefer` only where the model also prices the fastest's communication at least `clear_saving` below its own: a
    slow outlier step can then cost a speed-up, not the safe choice where it is the right one. With `agreed_ratio`
    (below `screen_ratio`), any other candidate goes already past `agreed_ratio` times the fastest where the model
    also predicts it slower than the fastest: measurement and model agree.

    `known` gives candidates whose step time is already measured (every rank's slowest, e.g. a schedule whose
    traffic the change that started this choice leaves as it was): they run no trials and enter the decision
    with that time."""

    def __init__(self, candidates: Sequence[str], repeats: int = 3, warmup: int = 1, prefer: str | None = None,
                 margin: float = 0.0, screen_ratio: float | None = None, agreed_ratio: float | None = None,
                 known: dict[str, float] | None = None, disputed_margin: float | None = None,
                 favourite_margin: float | None = None,
                 clear_saving: float = 0.0) -> None:
        self.repeats = repeats
        self.known = {c: t for c, t in (known or {}).items() if c in candidates}
        self.warmup = warmup
        self.prefer, self.margin = prefer, margin
        self.disputed_margin = margin if disputed_margin is None else disputed_margin
        self.favourite_margin = margin if favourite_margin is None else favourite_margin
        self.clear_saving = clear_saving
        self.screen_ratio = screen_ratio
        self.agreed_ratio = screen_ratio if agreed_ratio is None else agreed_ratio
        self.screened: dict[str, float] = {}  # candidates dropped after the first round: their first trial (s)
        self._screen_done = False
        self.medians: dict[str, float] = {}
        self.predicted: dict[str, float] = {}  # the cost model's seconds per candidate (`use_model`)
        self.pruned: list[str] = []  # candidates the model ruled out
        self._trial = 0
        self._started: float | None = None
        self.warmup_s: list[float] = []  # the warm-up steps' seconds on this rank (not in the decision)
        self.sequence: list[tuple[str, float]] = []  # the timed trials in the order run: (candidate, seconds here)
        self._set_candidates(list(candidates))

    def _set_candidates(self, candidates: list[str]) -> None:
        """`candidates` to time (the `known` ones are left out of the trials)."""
        self.candidates = [c for c in candidates if c not in self.known]
        if not self.candidates:  # everything measured already
            self.trials, self.times, self.chosen = [], {}, None
            self._decide_known()
            return
        self.trials = [self.candidates[0]] * self.warmup + self._rounds()
        self.times: dict[str, list[float]] = {c: [] for c in self.candidates}
        self.chosen: str | None = self.candidates[0] if len(self.candidates) == 1 and not self.known else None

    def _rounds(self) -> list[str]:
        """The timed trials: round r runs the candidates rotated by r, so each takes every place in a round (the
        first steps of a run get faster step by step, at loopback here ~250, 200, 170, 150 ms, and a fixed order
        timed the first candidate in the slowest place of every round)."""
        n = len(self.candidates)
        return [c for r in range(self.repeats) for c in self.candidates[r % n:] + self.candidates[: r % n]]

    def lead_with(self, candidate: str) -> bool:
        """Between two warm-up steps with more to come: `candidate` runs the remaining ones and becomes the first
        candidate (the same on every rank); the warm-up windows timed so far, another candidate's, are dropped from
        `warmup_s`. False, changing nothing, where no warm-up step is left (several forwards per optimizer step, or
        a warm-up of one step) or a trial is running."""
        if candidate not in self.candidates:
            raise ValueError(f"lead_with: {candidate!r} is not among the candidates {self.candidates}")
        if self.chosen is not None or self._started is not None or self._trial >= self.warmup:
            return False
        self.candidates = [candidate] + [c for c in self.candidates if c != candidate]
        self.trials = self.trials[: self._trial] + [candidate] * (self.warmup - self._trial) + self._rounds()
        self.warmup_s = []
        return True

    @property
    def wants_model(self) -> bool:
        """True before the first trial of a choice between several candidates that no model has ordered yet."""
        return (self.chosen is None and self._trial == 0 and self._started is None and not self.predicted
                and len(self.candidates) > 1)

    @property
    def trials_due(self) -> bool:
        """The warm-up steps are over and no trial is timed yet: the next `pick` starts the trials."""
        return self.chosen is None and self._trial == self.warmup and self._started is None

    def use_model(self, predicted: dict[str, float], pruned: Sequence[str]) -> None:
        """Before the trials: leave out `pruned`, except `prefer` (the safe candidate is always measured, and then
        screened after one step where it is the slower by far), and time the rest best-predicted first (it also takes
        the warm-up steps). The same on every rank (the prediction is computed from gathered data)."""
        self.predicted, self.pruned = dict(predicted), [c for c in self.candidates if c in pruned]
        kept = sorted((c for c in self.candidates if c not in self.pruned or c == self.prefer),
                      key=lambda c: predicted.get(c, 0.0))
        self._set_candidates(kept or self.candidates[:1])

    def pick(self, device: torch.device, groups: EPGroups) -> str:
        """The candidate this forward runs with (closing the previous trial first, if `step_end` did not)."""
        if self.chosen is not None:
            return self.chosen
        now = self._now(device)
        if self._started is not None:  # no step_end since the last forward: time forward to forward
            self._close(now)
        if self._screen_due():
            self._screen(groups)
        if self._trial == len(self.trials):
            self._decide(groups)
        if self.chosen is not None:
            return self.chosen
        self._started = now
        return self.trials[self._trial]

    def untimed_pick(self) -> str:
        """The candidate a forward that is not a trial step runs (an eval forward): the one chosen, else the one
        leading the trials (the model's favourite). Nothing is timed or advanced, and no collective runs."""
        return self.chosen if self.chosen is not None else self.candidates[0]

    def step_end(self, device: torch.device) -> None:
        """The optimizer step after the trial's forward finished (`CobaltEngine.step`): the trial ends here, so
        work between steps (data loading, other models) stays out of it."""
        if self.chosen is None and self._started is not None:
            self._close(self._now(device))

    @staticmethod
    def _now(device: torch.device) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NOTE: host sync, only during the trials
        return time.perf_counter()

    def _close(self, now: float) -> None:
        if self._trial >= self.warmup:
            self.times[self.trials[self._trial]].append(now - self._started)
            self.sequence.append((self.trials[self._trial], now - self._started))
        else:
            self.warmup_s.append(now - self._started)
        self._trial += 1
        self._started = None

    def _screen_due(self) -> bool:
        """The first round just ended, with more rounds to come, and screening is on."""
        return (self.screen_ratio is not None and not self._screen_done and len(self.candidates) > 1
                and self._trial == self.warmup + len(self.candidates) < len(self.trials))

    def _screen(self, groups: EPGroups) -> None:
        self._screen_done = True
        first_t = slowest_rank([self.times[c][0] for c in self.candidates], groups.ep_group)
        first = dict(zip(self.candidates, first_t.tolist()))
        best = float(first_t.min())
        fastest = self.candidates[int(first_t.argmin())]

        def dropped(c: str, t: float) -> bool:
            if c == self.candidates[0]:
                return False
            if c == self.prefer:  # the safe choice goes only where the model prices it clearly above the fastest
                return self.priced_below(fastest, c, self.clear_saving) and t > self.screen_ratio * best
            # any other one sooner where the model, too, prices it above the fastest
            return t > self.screen_ratio * best or (self.priced_below(fastest, c) and t > self.agreed_ratio * best)

        self.screened = {c: t for c, t in first.items() if dropped(c, t)}
        kept = [c for c in self.candidates if c not in self.screened]
        self.trials = self.trials[: self._trial] + [c for c in self.trials[self._trial:] if c in kept]
        self.candidates = kept
        if len(kept) == 1 and not self.known:  # decided: the first round's times (every rank's slowest) are shown
            self.medians, self.chosen = first, kept[0]

    def _decide(self, groups: EPGroups) -> None:
        medians = slowest_rank([float(torch.tensor(self.times[c]).median()) for c in self.candidates],
                               groups.ep_group)
        self.medians = {**dict(zip(self.candidates, medians.tolist())), **self.screened}
        self._decide_known()

    def priced_below(self, a: str, b: str, saving: float = 0.0) -> bool:
        """The model prices `a`'s communication more than `saving` (a fraction) below `b`'s; False without both."""
        predicted = self.predicted
        return a in predicted and b in predicted and predicted[a] < (1.0 - saving) * predicted[b]

    def _priced_favourite(self, contenders: dict[str, float]) -> str | None:
        """Among the `contenders` other than `prefer` and the fastest, the one the model prices cheapest, where it
        prices it more than `clear_saving` below the fastest's; else None."""
        fastest = min(contenders, key=contenders.__getitem__)
        others = [c for c in contenders if c not in (self.prefer, fastest) and c in self.predicted]
        if fastest == self.prefer or not others:
            return None
        favourite = min(others, key=self.predicted.__getitem__)
        return favourite if self.priced_below(favourite, fastest, self.clear_saving) else None

    def _decide_known(self) -> None:
        """The fastest of the timed `medians` and the `known` times, `prefer` kept within `margin` (or
        `disputed_margin`, where the model prices the fastest's communication less than `clear_saving` below
        `prefer`'s)."""
        timed = {c: t for c, t in self.medians.items() if c not in self.screened}
        self.medians = {**self.medians, **self.known}
        contenders = {**timed, **self.known}
        self.chosen = min(contenders, key=contenders.__getitem__)
        favourite = self._priced_favourite(contenders)
        if favourite is not None and contenders[self.chosen] > (1.0 - self.favourite_margin) * contenders[favourite]:
            self.chosen = favourite  # the model's clear favourite stays within `favourite_margin` of a faster other
        safe = self.medians.get(self.prefer) if self.prefer is not None else None
        disputed = (self.chosen in self.predicted and self.prefer in self.predicted
                    and not self.priced_below(self.chosen, self.prefer, self.clear_saving))
        margin = self.disputed_margin if disputed else self.margin
        if safe is not None and self.medians[self.chosen] > (1.0 - margin) * safe:
            self.chosen = self.prefer
