"""The metrics JSON of a training run (`examples/train_moe.py --metrics-out`) as the report verbs read it."""

from __future__ import annotations

from numbers import Real
from pathlib import Path
from typing import Any

# what each key the report verbs read must hold: "int" (>= 1), "number", "numbers" (a non-empty list), or an
# object with these keys of its own
_SHAPES: dict[str, Any] = {
    "step_times_s": "numbers", "steps": "int", "final_loss": "number", "tokens_per_s": "number",
    "world_size": "int", "ranks_per_node": "int", "tokens_per_step": "int",
    "traffic": {"inter_node_bytes": "number", "deepspeed_inter_node_bytes_padded": "number"},
    "model": {"num_experts": "int", "k": "int", "d_model": "int", "d_ff": "int"},
}


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _wrong(value: Any, shape: Any) -> str | None:
    """What is wrong with `value` for `shape`, or None."""
    if shape == "int":
        return None if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else "an int >= 1"
    if shape == "number":
        return None if _is_number(value) else "a number"
    if shape == "numbers":
        return None if isinstance(value, list) and value and all(map(_is_number, value)) else \
            "a non-empty list of numbers"
    return None if isinstance(value, dict) else "an object"


def check_run_metrics(data: Any, path: Path, keys: tuple[str, ...]) -> dict:
    """`data` when it is an object with every key of `keys`, each holding what the report verbs read of it (for
    `traffic` and `model`, their own keys too), and `ranks_per_node` dividing `world_size`; else ValueError naming
    the file and what is wrong."""
    missing = [k for k in keys if not isinstance(data, dict) or k not in data]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)} (examples/train_moe.py --metrics-out writes them)")
    for key in keys:
        shape = _SHAPES.get(key)
        if shape is None:
            continue
        problem = _wrong(data[key], shape)
        if problem:
            raise ValueError(f"{path}: {key} must be {problem}, got {data[key]!r:.80}")
        if isinstance(shape, dict):
            for sub, sub_shape in shape.items():
                if sub not in data[key]:
                    raise ValueError(f"{path}: {key}.{sub} is missing")
                problem = _wrong(data[key][sub], sub_shape)
                if problem:
                    raise ValueError(f"{path}: {key}.{sub} must be {problem}, got {data[key][sub]!r:.80}")
    if {"world_size", "ranks_per_node"} <= set(keys) and data["world_size"] % data["ranks_per_node"]:
        raise ValueError(f"{path}: world_size {data['world_size']} is not a multiple of ranks_per_node "
                         f"{data['ranks_per_node']}")
    return data
