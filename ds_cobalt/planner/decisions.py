"""What to do with one layer at a re-plan: keep it, change its replicas, or migrate owners.

Legend: E experts, K top-k, W EP ranks, S slots per rank, P = E / W owner slots, T sample tokens.
Pure: the replanner (`ds_cobalt.integrations.replan`) gathers the statistics and applies the decision.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .assign import assign_tasks, remote_nodes_per_token
from .layout import Layout, canonical_owner_order, copy_link_load, owner_rank_of
from .migration import LinkModel, copy_cost_per_token, migration_bytes, migration_worth_it
from .owner_moves import align_owner_slots
from .policies import LayerInput, plan_layer, replicas_for_owners
from .stats import RoutingStats, merge_sets, topk_sets

__all__ = ["KEEP", "REPLICAS", "MIGRATE", "LayerStats", "LayerDecision", "Confirmation", "cross_node_per_token",
           "plan_layer_decision", "confirm_on_newer_routing", "remote_nodes_of"]

KEEP, REPLICAS, MIGRATE = 0, 1, 2
# A migration confirmed on newer routing must pay at its gain's lower bound: the mean per-token gain less this many
# standard errors (the rows of one step: a few thousand tokens, paired under both layouts).
CONFIRM_STANDARD_ERRORS = 2.0


@dataclass(frozen=True)
class LayerStats:
    """Routing statistics of one layer over one interval, summed over all ranks."""

    load_E: np.ndarray
    coact_EE: np.ndarray
    tokens: int
    samples_TK: np.ndarray  # [T, K] recent top-k rows, -1 = dropped
    source_rank_T: np.ndarray  # [T] EP rank each sample came from


@dataclass(frozen=True)
class LayerDecision:
    action: int  # KEEP, REPLICAS or MIGRATE
    slots_WS: np.ndarray
    old_cross: float = 0.0
    new_cross: float = 0.0
    saving_s: float = 0.0  # modelled saving over the interval, migration time subtracted
    # MIGRATE: the slots with the owners left in place and only the spare slots chosen (applied instead where the
    # migration is not confirmed on newer routing, `confirm_on_newer_routing`); None otherwise
    fallback_WS: np.ndarray | None = None


def remote_nodes_of(samples_TK: np.ndarray, source_rank_T: np.ndarray, slots_WS: np.ndarray,
                    gpus_per_node: int) -> np.ndarray:
    """`[T]` the distinct remote nodes each sample token is sent to under `slots_WS` (`assign_tasks`)."""
    dest, _ = assign_tasks(samples_TK, source_rank_T, slots_WS, gpus_per_node)
    return remote_nodes_per_token(dest, source_rank_T, gpus_per_node)


def cross_node_per_token(samples_TK: np.ndarray, source_rank_T: np.ndarray, slots_WS: np.ndarray,
                         gpus_per_node: int) -> float:
    """Mean distinct remote nodes per sample token under `slots_WS` (the runtime's task assignment)."""
    if samples_TK.shape[0] == 0:
        return 0.0
    return float(remote_nodes_of(samples_TK, source_rank_T, slots_WS, gpus_per_node).mean())


# stage 1's seeds in a re-plan: `plan_nodes`' "fast" (every seed but Mt-KaHyPar). On 69 synthetic layers (E 32-256,
# top-2 to top-8, 2-8 nodes, one spare slot; planned on half the tokens, scored on the other) the Mt-KaHyPar seed
# changed the `cobalt` policy's layout in 8, by at most 1.1 % cross-node tokens, 4 better and 4 worse, and took 2-4x
# the planning CPU (E=32, k=6: 0.17 against 0.06 s). A re-plan's worker shares the host with training: on the 2 x 2
# testbed (4 ranks on 2 cores, 1 Gbit/s, fine-grained model) the steps after a re-plan's gather ran 70-110 ms
# (of ~230) shorter without it, in one pair of jobs. Offline planning (`plan_layout`, `ds-cobalt plan`) keeps "auto".
REPLAN_PARTITIONER = "fast"


def plan_layer_decision(stats: LayerStats, current_WS: np.ndarray, *, nodes: int, gpus_per_node: int,
                        policy: str, redundant_slots: int, seed: int, link: LinkModel, interval: int,
                        tokens_per_step: float, ignore_cost_model: bool) -> LayerDecision:
    """Pure: what to do with one layer. Owners move only when the cost model says it pays."""
    E = stats.load_E.size
    W = nodes * gpus_per_node
    P = E // W
    valid = stats.samples_TK[(stats.samples_TK >= 0).any(axis=1)] if stats.samples_TK.size else stats.samples_TK
    sets_MK, count_M = merge_sets(topk_sets(valid), np.ones(valid.shape[0]))
    routing = RoutingStats(E, stats.samples_TK.shape[1], decay=0.0, load_E=stats.load_E, coact_EE=stats.coact_EE,
                           sets_MK=sets_MK, count_M=count_M)
    # Step 1: the policy's layout, owners first, owners that stay on a rank in their current slot; traffic copies
    # priced by their weights' bytes.
    copy_cost = copy_cost_per_token(link, tokens_per_step)
    inp = LayerInput(stats=routing, topk_ids_TK=stats.samples_TK, source_rank_T=stats.source_rank_T,
                     nodes=nodes, gpus_per_node=gpus_per_node, redundant_slots=redundant_slots,
                     current_slots_WS=current_WS, seed=seed, copy_cost=copy_cost, partitioner=REPLAN_PARTITIONER)
    slots = plan_layer(policy, inp)
    slots = canonical_owner_order(Layout(E, nodes, gpus_per_node, slots[None])).layer(0)
    slots = align_owner_slots(current_WS, slots, P)
    # Step 2: same owners -> only replicas change (free); else ask the cost model.
    if np.array_equal(slots[:, :P], current_WS[:, :P]):
        same = slots.shape == current_WS.shape and np.array_equal(slots, current_WS)
        return LayerDecision(KEEP if same else REPLICAS, slots)
    old = cross_node_per_token(stats.samples_TK, stats.source_rank_T, current_WS, gpus_per_node)
    new = cross_node_per_token(stats.samples_TK, stats.source_rank_T, slots, gpus_per_node)
    moved = int((owner_rank_of(current_WS, E) != owner_rank_of(slots, E)).sum())
    # the migration's saving counts the change in traffic copies too (their weights cross every step), priced as
    # the busiest link carries them
    copies = [copy_link_load(w, E, gpus_per_node) for w in (current_WS, slots)]
    new_priced = new + copy_cost * (copies[1] - copies[0])
    saved_bytes, cost_bytes = migration_bytes(moved, old, new_priced, tokens_per_step, interval, link)
    saving_s = (saved_bytes - cost_bytes) / link.bytes_per_s
    worth = migration_worth_it(moved, old, new_priced, int(tokens_per_step), interval, link)
    # The owners stay and only the spare slots are chosen (free): where the migration does not pay, and as its
    # fallback where it is not confirmed on newer routing (not needed where the user overrides the cost model).
    kept = None if ignore_cost_model and moved else (
        replicas_for_owners(inp, current_WS[:, :P]) if redundant_slots else current_WS)
    if not (worth or (ignore_cost_model and moved)):
        if kept.shape == current_WS.shape and np.array_equal(kept, current_WS):
            return LayerDecision(KEEP, current_WS, old, new, saving_s)
        kept_cross = cross_node_per_token(stats.samples_TK, stats.source_rank_T, kept, gpus_per_node)
        return LayerDecision(REPLICAS, kept, old, kept_cross)
    return LayerDecision(MIGRATE, slots, old, new, saving_s, fallback_WS=kept)


@dataclass(frozen=True)
class Confirmation:
    """A decision checked on routing newer than the sample it was planned from."""

    action: int  # the decision's action where the newer rows confirm it, else KEEP
    old_cross: float = 0.0  # remote nodes per newer token under the current layout
    new_cross: float = 0.0  # ... under the decision's layout
    gain_low: float = 0.0  # the per-token gain's lower bound (CONFIRM_STANDARD_ERRORS below its mean)


def confirm_on_newer_routing(action: int, slots_WS: np.ndarray, current_WS: np.ndarray, old_T: np.ndarray,
                             new_T: np.ndarray, *, num_experts: int, link: LinkModel, interval: int,
                             tokens_per_step: float, gpus_per_node: int) -> Confirmation:
    """Pure: whether a layer's decision (`slots_WS` replacing `current_WS`) still holds on rows routed after its
    planning sample, given each of those tokens' remote nodes under the current layout (`old_T`) and under the
    decision's (`new_T`; the runtime counts them with its own task assignment, `cross_node_per_token` is the
    planner's).

    A plan fits the step it was sampled from; early in training the routing moves within a few steps, and a
    layout that fitted it can be worse than the current one on the steps that follow. A replica-only change moves
    no owner and stands where it is no worse on the newer rows (mean remote nodes per token), the traffic copies it
    adds priced as in planning (`copy_cost_per_token` each, counted as the busiest link carries them,
    `layout.copy_link_load`: their weights cross every step, whether or not the tokens they were planned for still
    come; with an E=32 top-4 AutoEP model at 100 Mbit/s here, re-plans whose copies were judged on token counts alone
    cut cross-node token rows by 0.7 % and added 19 % cross-node bytes, 1.46x plain AutoEP's step against 1.75x
    without re-planning). A migration stands
    where the cost model still says it pays with the per-token gain at its lower bound (paired over the same
    rows). KEEP, and a check without rows, leave the action as it is."""
    if action == KEEP or old_T.size == 0:
        return Confirmation(action)
    gain_T = (np.asarray(old_T) - np.asarray(new_T)).astype(np.float64)
    gain_low = float(gain_T.mean() - CONFIRM_STANDARD_ERRORS * gain_T.std() / np.sqrt(gain_T.size))
    old, new = float(np.mean(old_T)), float(np.mean(new_T))
    if action == REPLICAS:
        added = (copy_link_load(slots_WS, num_experts, gpus_per_node)
                 - copy_link_load(current_WS, num_experts, gpus_per_node))
        holds = new + copy_cost_per_token(link, tokens_per_step) * added <= old
    else:
        E = num_experts
        moved = int((owner_rank_of(current_WS, E) != owner_rank_of(slots_WS, E)).sum())
        holds = migration_worth_it(moved, old, old - gain_low, int(tokens_per_step), interval, link)
    return Confirmation(action if holds else KEEP, old, new, gain_low)
