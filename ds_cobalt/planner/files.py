"""Writing output files: a check before any work, and atomic replacement.

- `check_output_file`: ValueError naming the flag or key where a path cannot be written, before a run spends time
  on what it would write there.
- `write_atomically`: the new content goes to `<name>.tmp` in the same directory, is flushed to disk and renamed
  over the file, so a reader (and a crash, a full disk, a killed process) sees the old file or the whole new one,
  never a truncated one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

__all__ = ["check_output_file", "write_atomically", "write_text_atomically"]


def check_output_file(path: str | os.PathLike, flag: str) -> None:
    """ValueError naming `flag` where `path` cannot be written as a file (checked before any work, so a run never
    stops half-way with some of its outputs written)."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable (read-only file system or no permission)")


def write_atomically(path: str | os.PathLike, write: Callable[[str], None], durable: bool = True) -> None:
    """`write(tmp_path)`, flush it to disk (`durable`), rename over `path` (module docstring); the temporary file is
    removed where anything fails, and the error names `path`. A symbolic link is written through (its target is
    replaced); a path that is not a regular file (`/dev/stdout`, a pipe) is written directly."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isfile(path):
        write(path)
        return
    path = os.path.realpath(path) if os.path.islink(path) else path
    tmp = path + ".tmp"
    try:
        write(tmp)
        if durable:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(e.errno, f"could not write {path}: {e.strerror or e}") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """`write_atomically` of UTF-8 text."""
    write_atomically(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
