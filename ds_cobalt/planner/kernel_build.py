"""The child process that compiles every planner kernel into numba's cache at once (see `kernel_cache`).

    python -m ds_cobalt.planner.kernel_build     # started by `kernel_cache.ensure_built`, under its lock
"""

from __future__ import annotations

import sys

import numpy as np

from . import kernel_cache


def compile_all() -> None:
    """Call every kernel with the argument types the planner passes, so that all of them are compiled (and
    cached) by this one process: the planner worker's warm-up (a small 2-node plan with a spare slot and its
    migration decision), a task assignment with pending rows (tokens whose expert has copies on two remote
    nodes), and the single-pair helpers of the two objectives."""
    from .assign import assign_tasks, remote_nodes_per_token
    from .objective import PartitionState
    from .replicas import ReplicaPartitionState
    from .worker import warm_up

    warm_up("cobalt")
    # 3 nodes x 2 GPUs; expert 0 is held on every node, expert 7 on node 2 only.
    slots_WS = np.array([[0, 1], [2, 3], [4, 0], [5, 6], [7, 0], [-1, -1]], dtype=np.int64)
    topk_TK = np.array([[0, 7], [0, 1], [7, 4], [0, 5], [2, 6], [0, -1]], dtype=np.int64)
    source_T = np.arange(6, dtype=np.int64)
    dest_rank_TK, _ = assign_tasks(topk_TK, source_T, slots_WS, 2)
    remote_nodes_per_token(dest_rank_TK, source_T, 2)
    rng = np.random.default_rng(0)
    E, N = 8, 2
    sets_MK = np.stack([rng.choice(E, 2, replace=False) for _ in range(16)]).astype(np.int64)
    node_of_E = np.arange(E) % N
    PartitionState(sets_MK, np.ones(16), node_of_E, N).swap_delta(0, 1)
    copies_NE = np.zeros((N, E), dtype=bool)
    copies_NE[0, 1] = True
    replicas = ReplicaPartitionState(sets_MK, np.ones(16), node_of_E, copies_NE)
    replicas.value()
    replicas.swap_delta(0, 1)
    replicas.copy_gain(0, 3)


def main() -> int:
    kernel_cache.mark_building()
    compile_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
