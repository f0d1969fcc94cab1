"""One process compiles the planner's numba kernels into their on-disk cache, all of them at once.

Numba caches each kernel separately (`cache=True`), so a process can load some kernels compiled by an earlier
process and compile the others itself. With numba 0.68.1 that mix is not safe here: after a 1-node plan had
cached the task-assignment and GPU-packing kernels, a later 2-node plan that compiled the stage-1 kernels in its
own process and loaded those from the cache read out of bounds in `_stage2_kernels.pack_items` (IndexError with
`NUMBA_BOUNDSCHECK=1`, a segfault without it, on every later run until the cache was deleted; a single process
that compiled everything ran the same inputs correctly). Two cold processes can also write the same cache index
at once.

So the first import of a kernel module checks a stamp file in numba's cache directory (kernel sources, numba,
llvmlite and Python versions, the bounds-check setting). Where it is missing or stale, one child process
(`python -m ds_cobalt.planner.kernel_build`, under an exclusive file lock, so that concurrent ranks and CLI runs
wait for it) removes the old cache files of these kernels, compiles every kernel with the argument types the
planner passes (`kernel_build.compile_all`) and writes the stamp; every process after that only loads. Where
numba keeps no on-disk cache (no writable cache directory), each process compiles in memory and nothing is
shared.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

KERNEL_MODULES = ("_assign_kernels", "_replica_kernels", "_stage1_kernels", "_stage2_kernels")
STAMP_NAME = "ds_cobalt_planner_kernels.stamp"
LOCK_NAME = "ds_cobalt_planner_kernels.lock"
BUILD_TIMEOUT_S = 900

_building = False  # set in the child that compiles: its kernel imports must not start another child
_checked: set[str] = set()  # cache directories this process has confirmed


def mark_building() -> None:
    """This process is the one that compiles (`kernel_build`): its kernel imports check nothing."""
    global _building
    _building = True


def cache_dir(dispatcher: Any) -> Path | None:
    """Numba's on-disk cache directory of a `cache=True` kernel; None when it keeps none."""
    path = getattr(getattr(dispatcher, "_cache", None), "_cache_path", None)
    return Path(path) if path else None


def stamp() -> str:
    """What a complete cache was built from: the kernel sources and the compiler's versions and settings."""
    import llvmlite
    import numba
    from numba.core import config

    here = Path(__file__).parent
    sources = hashlib.sha256(b"".join((here / f"{m}.py").read_bytes() for m in KERNEL_MODULES)).hexdigest()
    return json.dumps({"sources": sources, "numba": numba.__version__, "llvmlite": llvmlite.__version__,
                       "python": sys.version, "boundscheck": bool(config.BOUNDSCHECK)}, sort_keys=True)


def _stamp_holds(directory: Path) -> bool:
    try:
        return (directory / STAMP_NAME).read_text() == stamp()
    except OSError:
        return False


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    with open(directory / LOCK_NAME, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_built(dispatcher: Any) -> None:
    """Make sure the kernels' cache next to `dispatcher`'s was built whole by one process (see the module
    docstring); called by each kernel module when it is imported. Raises RuntimeError if the build fails."""
    directory = cache_dir(dispatcher)
    if _building or directory is None or str(directory) in _checked:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / LOCK_NAME).touch()
    except OSError:  # not writable: numba cannot cache there either, each process compiles in memory
        _checked.add(str(directory))
        return
    if not _stamp_holds(directory):
        with _locked(directory):
            if not _stamp_holds(directory):  # another process may have built it while this one waited
                _build(directory)
    _checked.add(str(directory))


def _build(directory: Path) -> None:
    for module in KERNEL_MODULES:
        for old in directory.glob(f"{module}.*.nb[ic]"):
            old.unlink(missing_ok=True)
    (directory / STAMP_NAME).unlink(missing_ok=True)
    print(f"[ds_cobalt] compiling the planner's kernels into {directory} (once per install, about 20-30 s)",
          file=sys.stderr, flush=True)
    # the child imports this copy of the package, also where only the parent's sys.path reached it
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "ds_cobalt.planner.kernel_build"], capture_output=True,
                          text=True, timeout=BUILD_TIMEOUT_S, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"compiling the planner's numba kernels failed (exit code {done.returncode}; cache "
                           f"{directory}):\n{(done.stdout + done.stderr)[-3000:]}")
    (directory / STAMP_NAME).write_text(stamp())
