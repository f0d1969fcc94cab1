"""A re-planning policy for the planner-worker tests, importable by a worker process (`planner.worker`).

`test_slow_shuffle`: random owners (so a plan always moves owners), one replica per rank of an expert it does
not own. On the rank named by DS_COBALT_TEST_SLOW_RANK, the first plan creates the file
DS_COBALT_TEST_SLOW_MARK and then sleeps for a long time (a worker to kill or to time out); later plans, and
every plan on other ranks, return at once.
"""

from __future__ import annotations

import os
import time

import numpy as np

from ds_cobalt.planner import register_policy

SLEEP_S = 120.0


@register_policy("test_slow_shuffle")
def slow_shuffle(inp):
    mark = os.environ.get("DS_COBALT_TEST_SLOW_MARK")
    if mark and os.environ.get("RANK") == os.environ.get("DS_COBALT_TEST_SLOW_RANK") and not os.path.exists(mark):
        open(mark, "w").close()
        time.sleep(SLEEP_S)
    W, S = inp.current_slots_WS.shape
    E = inp.stats.num_experts
    rng = np.random.default_rng(int(inp.current_slots_WS.sum()) + inp.seed + int(inp.stats.load_E.sum()))
    owners = rng.permutation(E).reshape(W, E // W)
    return np.concatenate([owners, np.roll(owners, 1, axis=0)[:, :1]], axis=1)
