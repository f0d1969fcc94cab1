"""On-device routing statistics of one MoE layer: expert load, co-activation, recent top-k rows.

Legend: T tokens, K routes, E experts, B sample buffer rows. `update` never syncs with the host;
`snapshot` does once (NOTE: host sync), when the planner asks.
"""

from __future__ import annotations

import numpy as np
import torch


class DeviceRoutingStats:
    """Counts since the last `reset`: `load_E`, and with `planning` also `coact_EE` (pairs of distinct experts
    chosen by one token) and a ring buffer of the latest `sample_tokens` top-k rows (for top-k set
    histograms, k > 2). Layers switch `planning` on only when a replanner will read them."""

    def __init__(self, num_experts: int, top_k: int, sample_tokens: int = 8192,
                 device: torch.device | str = "cpu", planning: bool = True) -> None:
        self.num_experts = num_experts
        self.planning = planning
        self.load_E = torch.zeros(num_experts, dtype=torch.float64, device=device)
        self.coact_EE = torch.zeros((num_experts, num_experts), dtype=torch.float64, device=device)
        self.sample_BK = torch.full((sample_tokens, top_k), -1, dtype=torch.long, device=device)
        self.tokens = 0  # tokens counted (host int; shapes are known on the host)
        self.sampled = 0  # rows written to the sample buffer (host int; a load-only update writes none)

    def update(self, topk_ids_TK: torch.Tensor, planned: bool = True) -> None:
        """Count one forward's routes; `planned=False` counts load only (a layer the replanner leaves out)."""
        if self.load_E.device != topk_ids_TK.device:  # the model moved after construction
            self.load_E, self.coact_EE, self.sample_BK = (_moved(t, topk_ids_TK.device)
                                                          for t in (self.load_E, self.coact_EE, self.sample_BK))
        T, K = topk_ids_TK.shape
        ids = topk_ids_TK.long()
        valid = ids >= 0
        if not (self.planning and planned):  # load only (a token picks an expert at most once): no [T, E] multi-hot
            self.load_E.index_add_(0, ids.clamp(min=0).reshape(-1), valid.reshape(-1).to(self.load_E.dtype))
            self.tokens += T
            return
        multi_hot_TE = torch.zeros((T, self.num_experts), dtype=torch.float32, device=ids.device)
        multi_hot_TE.scatter_add_(1, ids.clamp(min=0), valid.float())  # -1 adds 0 at column 0
        multi_hot_TE.clamp_(max=1.0)
        self.load_E += multi_hot_TE.sum(0).double()
        coact = multi_hot_TE.t() @ multi_hot_TE
        coact.fill_diagonal_(0)
        self.coact_EE += coact.double()
        B = self.sample_BK.shape[0]
        rows = torch.arange(self.sampled, self.sampled + T, device=ids.device) % B
        keep = min(T, B)
        self.sample_BK[rows[-keep:], : K] = ids[-keep:] if keep else ids[:0]
        self.tokens += T
        self.sampled += T

    def snapshot(self, rows: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(load_E, coact_EE, sample_BK)` on the host, copies (a CPU tensor's `numpy()` would share its memory, and
        `reset` zero it); `sample_BK` as in `recent_rows(rows)`."""
        return (self.load_E.cpu().numpy().copy(), self.coact_EE.cpu().numpy().copy(),  # NOTE: host sync
                self.recent_rows(rows))

    def recent_rows(self, rows: int | None = None) -> np.ndarray:
        """`[n, K]` the latest n = min(sampled, B, rows) top-k rows on the host, oldest first (NOTE: host sync)."""
        B = self.sample_BK.shape[0]
        n = min(self.sampled, B, B if rows is None else rows)
        index = torch.arange(self.sampled - n, self.sampled, device=self.sample_BK.device) % B
        return self.sample_BK[index].cpu().numpy()

    def reset(self) -> None:
        self.load_E.zero_()
        self.coact_EE.zero_()
        self.sample_BK.fill_(-1)
        self.tokens = self.sampled = 0


def _moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`. A layer built on the meta device (deferred initialisation, then `to_empty`) has counted
    nothing yet: its meta tensors, which hold no data, become what the constructor makes (-1 for the sample rows)."""
    if t.is_meta:
        return torch.full(t.shape, -1 if t.dtype == torch.long else 0, dtype=t.dtype, device=device)
    return t.to(device)
