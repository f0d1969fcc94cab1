"""The metrics JSON of a training run (`examples/train_moe.py --metrics-out`) as the report verbs read it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def check_run_metrics(data: Any, path: Path, keys: tuple[str, ...]) -> dict:
    """`data` when it is an object with every key of `keys` and at least one step time; else ValueError naming the
    file and what it lacks."""
    missing = [k for k in keys if not isinstance(data, dict) or k not in data]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)} (examples/train_moe.py --metrics-out writes them)")
    if "step_times_s" in keys and not data["step_times_s"]:
        raise ValueError(f"{path}: step_times_s is empty")
    return data
