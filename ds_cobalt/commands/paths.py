"""Checks of the paths a verb writes."""

from __future__ import annotations

import os


def check_output_file(path: str, flag: str) -> None:
    """ValueError naming `flag` where `path` cannot be written as a file (checked before any work, so a run never
    stops half-way with some of its outputs written)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: the directory {parent} does not exist")
