"""Which rank died: the surviving ranks name the peer on their host that was killed or failed.

A rank killed by the OS (SIGKILL, the OOM killer) prints nothing itself. Its peers then fail too: their next
collective with it raises (gloo and NCCL see the closed connection; a peer that vanishes without closing
one runs into ds_cobalt's group timeout, `cobalt.topology.group_timeout_s`), or the launcher stops them
(DeepSpeed's `launch.py` terminates every rank once one exits non-zero), often before they log anything useful.
`install` (called by `ds_cobalt.initialize`, one `all_gather_object` over the world group) records every rank's
host and pid and starts a daemon thread that reads its host's peers' `/proc/<pid>/stat` when one exits (and every
0.05 s where a peer has no pidfd, below). The first peer that becomes a zombie (dead, not yet reaped by its
launcher) with a signal or a non-zero exit status is logged as `ds_cobalt: rank R (local rank L, pid P) on HOST
died (killed by SIGKILL)` or `(exit status N)`; the deaths after it are mostly the launcher stopping the rest and
are not logged, nor are clean exits. An uncaught exception checks once more before the traceback. Ranks on other
hosts are not checked (their host's ranks report them). Linux only (`/proc`); elsewhere nothing is watched.

A zombie lasts only until the launcher reaps it (DeepSpeed's `launch.py` polls its ranks once a second), so the
watcher also holds a pidfd per peer (`os.pidfd_open`) and wakes the moment one exits rather than at its next
poll. If the launcher still reaped the peer first, the failing rank's exception names it as `exited before this
rank failed` (its exit status is gone by then), provided it is the only peer that exited; without pidfds (kernels
before 5.3) that case goes unnamed.

`install` also destroys the process groups at a clean interpreter exit (an `atexit` handler; a script that calls
`destroy_process_group` itself is left alone). Without it gloo can abort the exiting rank with "terminate called
without an active exception" (SIGABRT, exit status 250 through DeepSpeed's launcher): its worker threads still
hold finished work whose tensors are freed while the interpreter is torn down. After an uncaught exception the
groups are left as they are, since a peer that died could make waiting for pending work block.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from types import TracebackType

import torch.distributed as dist

_log = logging.getLogger("DeepSpeed").getChild("ds_cobalt")


@dataclass(frozen=True)
class Peer:
    rank: int
    local_rank: int
    host: str
    pid: int


_PEERS: list[Peer] = []
_PIDFDS: dict[int, Peer] = {}  # pidfd -> a peer on this host, until it signals the peer's exit
_EXITED: list[Peer] = []  # peers on this host whose pidfd signalled an exit, in order
_POLLED: list[Peer] = []  # peers on this host without a pidfd: their `/proc` entry is polled
PIDFD_WAIT_S = 60.0  # the watcher's wait where every peer has a pidfd (an exit ends it at once)
_LOCK = threading.Lock()
_REPORTED: set[int] = set()  # ranks already logged
_FAILED: list[str] = []  # the uncaught exception this process is exiting with, if any


def _death(pid: int) -> str | None:
    """How `pid` died, if it is a zombie that was killed or exited non-zero (None: running, clean, or gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] != "Z" or len(fields) < 50:
        return None
    status = int(fields[49])  # exit_code (field 52 of stat), as waitpid reports it
    if status & 0x7F:
        return f"killed by {signal.Signals(status & 0x7F).name}"
    return f"exit status {status >> 8}" if status >> 8 else None


def _wait_exits(timeout_s: float) -> None:
    """Wait up to `timeout_s` for a peer's pidfd to signal its exit; record every peer that exited."""
    with _LOCK:
        fds = list(_PIDFDS)
    if not fds:
        time.sleep(timeout_s)
        return
    poller = select.poll()  # not select.select: a pidfd may be numbered above FD_SETSIZE
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ready = poller.poll(timeout_s * 1000)
    with _LOCK:
        for fd, _ in ready:
            if fd in _PIDFDS:
                _EXITED.append(_PIDFDS.pop(fd))
                os.close(fd)


def _check(reason: str | None = None, wait_s: float = 0.0) -> Peer | None:
    """Log the first dead peer of this host (once per process: the deaths after it are mostly the launcher
    stopping the rest); returns it. With a `reason` (this rank is failing), a peer that exited but was reaped
    before its status could be read is named too. `wait_s`: how long to wait for a peer's exit to show."""
    if _REPORTED:
        return None
    _wait_exits(wait_s)
    host, me = socket.gethostname(), os.getpid()
    dead = [(p, death) for p in _PEERS if p.host == host and p.pid != me and (death := _death(p.pid)) is not None]
    # SIGTERM is how the launcher stops the others after the first death: those are not the news
    dead = [(p, f"died ({death})") for p, death in dead if death != "killed by SIGTERM"]
    if not dead and reason and len(_EXITED) == 1:  # with several gone, which went first is not known
        dead = [(p, "exited before this rank failed (reaped by its launcher before its exit status could be read)")
                for p in _EXITED if not os.path.exists(f"/proc/{p.pid}")]
    for p, what in dead[:1]:
        _REPORTED.add(p.rank)
        rank = dist.get_rank() if dist.is_initialized() else "?"
        message = (f"ds_cobalt: rank {p.rank} (local rank {p.local_rank}, pid {p.pid}) on {p.host} {what}; "
                   f"seen by rank {rank}" + (f" ({reason})" if reason else ""))
        _log.error(message)
        print(message, file=sys.stderr, flush=True)
        return p
    return None


def _open_pidfds() -> None:
    host, me = socket.gethostname(), os.getpid()
    for p in _PEERS:
        if p.host == host and p.pid != me:
            try:
                _PIDFDS[os.pidfd_open(p.pid)] = p
            except (AttributeError, OSError):  # no pidfds here (kernel < 5.3, seccomp) or already gone
                _POLLED.append(p)


def _watch(interval_s: float) -> None:
    # with a pidfd for every peer the exits wake the thread, so it need not poll: a thread waking 20 times a second
    # cost 7-9 % of the steps of 4 ranks sharing 2 cores here (each wake-up takes the GIL from the training thread)
    while _check() is None and not _REPORTED:
        _wait_exits(interval_s if _POLLED else PIDFD_WAIT_S)  # returns at once when a peer exits


def _destroy_groups_at_exit() -> None:
    if not _FAILED and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def install(interval_s: float = 0.05) -> None:
    """Record every rank's host and pid (collective on the world group, once), start the watcher thread, hook
    uncaught exceptions and destroy the groups at a clean exit (module docstring); the previous excepthook still
    runs afterwards."""
    if _PEERS or not (dist.is_available() and dist.is_initialized()):
        return
    me = (int(os.environ.get("LOCAL_RANK", -1)), socket.gethostname(), os.getpid())
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, me)
    _PEERS.extend(Peer(rank, *entry) for rank, entry in enumerate(table))
    atexit.register(_destroy_groups_at_exit)
    previous_hook = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        _FAILED.append(kind.__name__)
        if os.path.isdir("/proc"):
            # a peer's sockets close before it turns into a zombie: give its exit a moment to show
            _check(f"{kind.__name__}: {value}".splitlines()[0][:200], wait_s=0.5)
        previous_hook(kind, value, tb)

    sys.excepthook = excepthook
    if os.path.isdir("/proc"):
        _open_pidfds()
        threading.Thread(target=_watch, args=(interval_s,), name="ds_cobalt-peer-watch", daemon=True).start()
