"""argparse types shared by the verbs, the examples and the benchmarks."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An int >= 1 (steps, repeats, pairs): argparse names the flag and the value where it is not one, before any
    work starts."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value
