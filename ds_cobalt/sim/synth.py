"""Synthetic routing traces with controllable load skew and co-activation clustering.

Legend: L layers, T tokens, K top-k, E experts, C clusters.

Model (per layer, independent): expert popularity `p_E` follows a power law whose exponent is chosen
so the popularity Gini coefficient matches `gini`; experts are split into C random clusters; every token
picks one cluster (proportional to its popularity mass) and draws K distinct experts with probability
proportional to `p_E`, boosted inside its cluster so that about a `clustering` share of the mass lies in
the cluster. Sampling without replacement uses the Gumbel-top-k trick.
"""

from __future__ import annotations

import numpy as np

from ..planner.trace import Trace

__all__ = ["synth_trace", "gini", "popularity_for_gini"]


def gini(x_E: np.ndarray, size: int | None = None) -> float:
    """Gini coefficient of a non-negative vector (0 = uniform, -> 1 = all mass on one entry). `size`: the vector's
    length where `x_E` lists only some of its entries (the others 0)."""
    x = np.sort(np.asarray(x_E, dtype=np.float64))
    n = x.size if size is None else int(size)
    if n < x.size:
        raise ValueError(f"gini: size={size} is below the {x.size} entries given")
    if n == 0 or x.sum() <= 0:
        return 0.0
    cum = np.cumsum(x)
    return float((n + 1 - 2 * (cum / cum[-1]).sum()) / n)


def popularity_for_gini(num_experts: int, target: float) -> np.ndarray:
    """`[E]` float64 decreasing power-law popularity (sums to 1) whose Gini is about `target`."""
    if not 0.0 <= target < 1.0:
        raise ValueError(f"gini must be in [0, 1), got {target}")
    ranks = np.arange(1, num_experts + 1, dtype=np.float64)
    lo, hi = 0.0, 8.0
    # Step 1: bisection on the power-law exponent (Gini grows monotonically with it).
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if gini(ranks**-mid) < target:
            lo = mid
        else:
            hi = mid
    p = ranks ** -(0.5 * (lo + hi))
    return p / p.sum()


def synth_trace(
    *,
    num_experts: int,
    top_k: int,
    num_tokens: int,
    num_layers: int = 1,
    gini: float = 0.3,
    clustering: float = 0.6,
    num_clusters: int | None = None,
    seed: int = 0,
) -> Trace:
    """Generate a trace. `clustering` in [0, 1): share of each token's choices inside its cluster."""
    E, K, T = num_experts, top_k, num_tokens
    if E < 1 or K < 1 or K > E or T < 0 or num_layers < 1:
        raise ValueError(f"synth: need 1 <= top_k={K} <= num_experts={E}, num_tokens={T} >= 0, layers >= 1")
    if not 0.0 <= clustering < 1.0:
        raise ValueError(f"synth: clustering must be in [0, 1), got {clustering}")
    C = num_clusters if num_clusters is not None else max(1, E // max(2 * K, 1))
    if not 1 <= C <= E:
        raise ValueError(f"synth: num_clusters must be in [1, {E}], got {C}")
    rng = np.random.default_rng(seed)
    experts_LTK = np.empty((num_layers, T, K), dtype=np.int64)
    base_E = popularity_for_gini(E, gini)
    for layer in range(num_layers):
        # Step 1: popularity, shuffled so hot experts are not contiguous ids.
        p_E = base_E[rng.permutation(E)]
        # Step 2: random clusters of (nearly) equal size.
        cluster_E = rng.permutation(np.arange(E) % C)
        mass_C = np.bincount(cluster_E, weights=p_E, minlength=C)
        # Step 3: per cluster, boost so that ~`clustering` of a token's mass lies inside its cluster.
        out_mass_C = 1.0 - mass_C
        boost_C = np.where(mass_C > 0, clustering / (1 - clustering) * out_mass_C / np.maximum(mass_C, 1e-12), 1.0)
        boost_C = np.maximum(boost_C, 1.0)
        log_p_E = np.log(p_E)
        for start in range(0, T, 8192):
            n = min(8192, T - start)
            token_cluster = rng.choice(C, size=n, p=mass_C / mass_C.sum())
            in_cluster_nE = cluster_E[None, :] == token_cluster[:, None]
            scores_nE = log_p_E[None, :] + np.where(in_cluster_nE, np.log(boost_C[token_cluster])[:, None], 0.0)
            scores_nE += rng.gumbel(size=(n, E))
            top = np.argpartition(-scores_nE, K - 1, axis=1)[:, :K]
            # Order each token's experts by score, as a gate would.
            order = np.argsort(-np.take_along_axis(scores_nE, top, axis=1), axis=1)
            experts_LTK[layer, start : start + n] = np.take_along_axis(top, order, axis=1)
    return Trace(experts_LTK, E)
