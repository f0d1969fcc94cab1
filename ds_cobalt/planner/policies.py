"""Placement policies (`ds-cobalt plan --policy`): one pure function per policy, one registry.

Legend: T tokens, K top-k, E experts, N nodes, G GPUs per node, W = N * G ranks, S slots per rank,
R spare (redundant) slots per rank.

Each policy maps a `LayerInput` (statistics and sample tokens of one layer) and the topology to `[W, S]`
slots following the owner convention (owners in the first E / W slots of each rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .assign import assign_tasks, remote_nodes_per_token
from .eplb import eplb_layer
from .joint import refine_joint, swap_owners
from .layout import Layout, canonical_owner_order, copy_link_load, owners_first
from .objective import PartitionState
from .replicas import ReplicaPartitionState, _traffic_order_sets
from .stage1 import greedy_coact_partition, plan_nodes, refine_swaps
from .stage2 import fill_spares, node_loads, pack_node, plan_gpus, replicate_hot
from .stats import RoutingStats, topk_sets
from .trace import Trace

__all__ = ["LayerInput", "POLICIES", "plan_layer", "plan_layout", "register_policy", "check_topology"]


@dataclass(frozen=True)
class LayerInput:
    """What a policy may look at for one layer."""

    stats: RoutingStats  # load_E, coact_EE, top-k set histogram
    topk_ids_TK: np.ndarray  # [T, K] sample tokens (for evaluating candidates), -1 = none
    source_rank_T: np.ndarray  # [T] their ranks
    nodes: int
    gpus_per_node: int
    redundant_slots: int
    current_slots_WS: np.ndarray | None = None  # [W, S] the layout in use, if any
    seed: int = 0
    # what one traffic copy (a spare slot holding an expert owned on another node) costs per step, in cross-node
    # tokens per token: its weights cross in forward and its gradients in backward (`migration.copy_cost_per_token`);
    # 0: free, i.e. candidates are scored on token traffic alone
    copy_cost: float = 0.0
    # the part of its node's inter-node bandwidth one GPU can use alone (`layout.copy_link_load`; None: 1/G, a NIC
    # per GPU): copies are priced as the busiest link carries them, so one owner copied to many nodes costs more
    copy_gpu_link_share: float | None = None
    # stage 1's seeds (`plan_nodes`' `partitioner`) for the partition without everywhere-copies; the others use "fast"
    partitioner: str = "auto"


Policy = Callable[[LayerInput], np.ndarray]
POLICIES: dict[str, Policy] = {}


def register_policy(name: str) -> Callable[[Policy], Policy]:
    def deco(fn: Policy) -> Policy:
        POLICIES[name] = fn
        return fn

    return deco


def check_topology(num_experts: int, nodes: int, gpus_per_node: int, redundant_slots: int = 0) -> None:
    """ValueError naming the bad value when the topology cannot hold the experts."""
    for name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node), ("redundant_slots", redundant_slots)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise ValueError(f"{name} must be an int, got {value!r}")
    for name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if redundant_slots < 0:
        raise ValueError(f"redundant_slots must be >= 0, got {redundant_slots}")
    W = nodes * gpus_per_node
    if num_experts % W:
        raise ValueError(
            f"nodes x gpus_per_node = {nodes} x {gpus_per_node} = {W} does not divide num_experts={num_experts}"
        )
    if redundant_slots > num_experts - num_experts // W:
        raise ValueError(f"redundant_slots={redundant_slots}: a rank holds at most num_experts - num_experts / W = "
                         f"{num_experts - num_experts // W} experts besides its own (num_experts={num_experts}, "
                         f"W={W})")


def _current_nodes(inp: LayerInput, E: int) -> np.ndarray | None:
    if inp.current_slots_WS is None:
        return None
    owners = inp.current_slots_WS[:, : E // (inp.nodes * inp.gpus_per_node)]
    node_of_E = np.empty(E, dtype=np.int64)
    node_of_E[owners.reshape(-1)] = np.repeat(np.arange(inp.nodes), owners.size // inp.nodes)
    return node_of_E


def _evaluate(inp: LayerInput, slots_WS: np.ndarray) -> tuple[float, float]:
    """(cross-node tokens per token, traffic copies' cost included, and GPU load max/mean) of `slots_WS` on the
    sample tokens."""
    return _evaluate_loads(inp, slots_WS)[:2]


def _evaluate_loads(inp: LayerInput, slots_WS: np.ndarray) -> tuple[float, float, np.ndarray]:
    """`_evaluate` plus the `[W]` sample pairs each GPU serves."""
    T = inp.topk_ids_TK.shape[0]
    if T == 0:
        return 0.0, 1.0, np.zeros(slots_WS.shape[0], dtype=np.int64)
    dest, _ = assign_tasks(inp.topk_ids_TK, inp.source_rank_T, slots_WS, inp.gpus_per_node)
    load_W = np.bincount(dest[dest >= 0], minlength=slots_WS.shape[0])
    balance = float(load_W.max() / load_W.mean()) if load_W.sum() else 1.0
    traffic = float(remote_nodes_per_token(dest, inp.source_rank_T, inp.gpus_per_node).mean())
    if inp.copy_cost:
        traffic += inp.copy_cost * copy_link_load(slots_WS, inp.stats.num_experts, inp.gpus_per_node,
                                                  inp.copy_gpu_link_share)
    return traffic, balance, load_W


@register_policy("deepspeed")
def deepspeed_policy(inp: LayerInput) -> np.ndarray:
    """DeepSpeed: rank r owns experts [r E/W, (r+1) E/W); spare slots stay empty."""
    E = inp.stats.num_experts
    W = inp.nodes * inp.gpus_per_node
    slots = np.full((W, E // W + inp.redundant_slots), -1, dtype=np.int64)
    slots[:, : E // W] = np.arange(E).reshape(W, E // W)
    return slots


@register_policy("load")
def load_policy(inp: LayerInput) -> np.ndarray:
    """Load only (FlexMoE-like): owners LPT over all GPUs, hottest experts replicated anywhere."""
    load_E = inp.stats.load_E.astype(np.float64)
    W = inp.nodes * inp.gpus_per_node
    R = inp.redundant_slots
    # Step 1: replicas to the experts with most load per copy (at most one copy per GPU).
    copies = np.minimum(replicate_hot(load_E, W * R), W)
    per_copy = load_E / copies
    ids = np.arange(load_E.size)
    # Step 2: pack the whole cluster as one group of W GPUs, ignoring nodes.
    return pack_node(per_copy, ids, np.repeat(per_copy, copies - 1), np.repeat(ids, copies - 1), W, R)


@register_policy("eplb")
def eplb_policy(inp: LayerInput) -> np.ndarray:
    """DeepSeek EPLB, hierarchical (groups to nodes, replicas inside nodes, packing to GPUs)."""
    return eplb_layer(inp.stats.load_E.astype(np.float64), inp.nodes, inp.gpus_per_node, inp.redundant_slots)


def _node_load_NE(inp: LayerInput, node_of_E: np.ndarray, extra_NE: np.ndarray) -> np.ndarray:
    holds_NE = extra_NE.copy()
    holds_NE[node_of_E, np.arange(node_of_E.size)] = True
    if inp.topk_ids_TK.shape[0] == 0:
        return np.where(holds_NE, inp.stats.load_E[None, :] / holds_NE.sum(axis=0).clip(1), 0.0)
    return node_loads(inp.topk_ids_TK, inp.source_rank_T // inp.gpus_per_node, holds_NE)


@register_policy("pairwise")
def pairwise_policy(inp: LayerInput) -> np.ndarray:
    """Pairwise co-activation partition (Occult-like): minimise the co-activation cut between nodes,
    then replicate each node's hottest experts inside the node."""
    st = inp.stats
    E, N = st.num_experts, inp.nodes
    node_of_E = np.zeros(E, dtype=np.int64)
    if N > 1:
        # Step 1: the pair graph as 2-pin sets; its connectivity is the co-activation cut.
        i, j = np.nonzero(np.triu(st.coact_EE, 1))
        pairs_MK = np.stack([i, j], axis=1).astype(np.int64)
        state = PartitionState(pairs_MK, st.coact_EE[i, j].astype(np.float64),
                               greedy_coact_partition(st.load_E, st.coact_EE, N), N)
        refine_swaps(state, st.load_E.astype(np.float64), 1.05 * st.load_E.sum() / N)
        node_of_E = state.node_of_E
    extra_NE = np.zeros((N, E), dtype=bool)
    return plan_gpus(node_of_E, extra_NE, _node_load_NE(inp, node_of_E, extra_NE), inp.gpus_per_node,
                     inp.redundant_slots)


def _strip(sets_MK: np.ndarray, drop_E: np.ndarray) -> np.ndarray:
    """Sets with the experts in `drop_E` (bool) removed (they are local on every node)."""
    return topk_sets(np.where((sets_MK >= 0) & drop_E[np.maximum(sets_MK, 0)], -1, sets_MK))


@register_policy("cobalt")
def cobalt_policy(inp: LayerInput) -> np.ndarray:
    """Stage 1 + stage 2, choosing owners and replicas together (`cobalt_layer` with the default joint step)."""
    return cobalt_layer(inp, joint=COBALT_JOINT)


@register_policy("cobalt-alternate")
def cobalt_alternate_policy(inp: LayerInput) -> np.ndarray:
    """`cobalt` with the joint step that alternates owner refinement and greedy copy re-picks."""
    return cobalt_layer(inp, joint="alternate")


@register_policy("cobalt-moves")
def cobalt_moves_policy(inp: LayerInput) -> np.ndarray:
    """`cobalt` with the joint step of exact owner swaps and copy moves (`joint.refine_joint`)."""
    return cobalt_layer(inp, joint="moves")


def cobalt_layer(inp: LayerInput, *, joint: str = "moves") -> np.ndarray:
    """Stage 1 + stage 2, choosing owners and replicas together.

    Candidates differ in how the G * R spare slots of a node are used:
    - x of them hold the x hottest experts on every node (they then never cause a crossing, and their load
      splits over the nodes by where tokens live), so stage 1 partitions the other experts' sets;
    - y of them hold per-node traffic copies (`traffic_replicas`: the experts whose copy on that node
      removes the most remote nodes from its tokens, given the owners);
    - the rest replicate each node's hottest experts inside the node (GPU balance).
    Every candidate (and EPLB's layout) is scored with `assign_tasks` on the sample tokens; the fewest
    cross-node tokens among those with GPU max/mean within max(1.05, 1.02 x best) wins; when it is worse than
    EPLB in traffic or balance, the fewest cross-node tokens among own candidates at or below EPLB in both
    (if none is, a slightly worse balance is kept rather than EPLB's much larger traffic).

    `joint` (candidates with copies, N <= 16): "alternate" re-partitions the owners with the copies counted as
    local and re-picks the greedy copies, twice; "moves" runs `refine_joint` (owner swaps and copy moves
    scored exactly on one objective, the everywhere-copies kept) and scores its result next to the candidate.
    """
    if joint not in ("alternate", "moves"):
        raise ValueError(f"joint must be 'alternate' or 'moves', got {joint!r}")
    st = inp.stats
    E, N, G, R = st.num_experts, inp.nodes, inp.gpus_per_node, inp.redundant_slots
    current = _current_nodes(inp, E)
    load_E = st.load_E.astype(np.float64)
    spare = 0 if N == 1 else G * R
    everywhere_max = min(spare, E)
    options = sorted({0, everywhere_max // 2, everywhere_max})
    src_node_T = inp.source_rank_T // G
    sample_sets_TK = topk_sets(np.asarray(inp.topk_ids_TK, dtype=np.int64))  # reused by every traffic pick
    results: list[tuple[float, float, np.ndarray]] = []
    for x in options:
        # Step 1: the x hottest experts get a copy on every node.
        hot = np.zeros(E, dtype=bool)
        hot[np.argsort(-load_E, kind="stable")[:x]] = True
        sets_MK = _strip(st.sets_MK, hot) if x else st.sets_MK
        # Step 2: stage 1 on the remaining sets; replicated experts weigh 1/N on their owner node.
        node_of_E = plan_nodes(np.where(hot, load_E / N, load_E), st.coact_EE, sets_MK, st.count_M, N,
                               current_node_of_E=current, partitioner=inp.partitioner if x == 0 else "fast",
                               seed=inp.seed)
        everywhere_NE = np.repeat(hot[None, :], N, axis=0)
        everywhere_NE[node_of_E, np.arange(E)] = False
        holds_NE = everywhere_NE.copy()
        holds_NE[node_of_E, np.arange(E)] = True
        left = spare - x
        # Step 3: per-node traffic copies, greedily (the largest y is computed once, prefixes reused).
        ys = sorted({0, left // 2, left}) if inp.topk_ids_TK.shape[0] else [0]
        order_NE = _traffic_order_sets(sample_sets_TK, src_node_T, node_of_E, holds_NE, max(ys))
        for y in ys:
            owners, extra_NE = node_of_E, everywhere_NE | (order_NE < y)
            joint_ok = (x or y) and N <= JOINT_MAX_NODES
            if joint == "moves":
                slots = _slots(inp, owners, extra_NE)
                results.append((*_evaluate(inp, slots), slots))
                if joint_ok:
                    # Step 4 (joint): owner swaps and copy moves on one exact objective, then copies traded
                    # for balance on the node of the busiest GPU (each step a candidate).
                    for tol in JOINT_LOAD_TOLERANCES:
                        new_owners, new_extra = refine_joint(st.sets_MK, st.count_M, load_E, owners, extra_NE, x + y,
                                                             fixed_NE=everywhere_NE, load_tolerance=tol)
                        results += _trade_copies_for_balance(inp, new_owners, new_extra, everywhere_NE)
                continue
            for joint_round in range(JOINT_ROUNDS + 1 if joint_ok else 1):
                if joint_round:
                    # Step 4 (joint): re-partition owners with these copies counted as local, then re-pick
                    # the traffic copies for the new owners. Unchanged owners would give the same copies,
                    # slots and score as the candidate just scored (and so every later round): stop.
                    new_owners = refine_owners(st.sets_MK, st.count_M, load_E, owners, extra_NE)
                    if np.array_equal(new_owners, owners):
                        break
                    owners = new_owners
                    holds = everywhere_NE.copy()
                    holds[owners, np.arange(E)] = True
                    extra_NE = everywhere_NE | (_traffic_order_sets(sample_sets_TK, src_node_T, owners, holds, y) < y)
                # Step 5: stage 2, spare slots left over go to the node's hottest experts; pack GPUs.
                slots = plan_gpus(owners, extra_NE, _node_load_NE(inp, owners, extra_NE), G, R)
                traffic, balance = _evaluate(inp, slots)
                results.append((traffic, balance, slots))
    # Step 6: EPLB's layout competes too; the pick is never worse than it on the sample in traffic or balance.
    eplb_slots = eplb_policy(inp)
    eplb_result = (*_evaluate(inp, eplb_slots), eplb_slots)
    results.append(eplb_result)
    best_balance = min(r[1] for r in results)
    ok = [r for r in results if r[1] <= max(BALANCE_TARGET, best_balance * BALANCE_SLACK) + 1e-12]
    pick = min(ok, key=lambda r: (r[0], r[1]))
    dominating = [r for r in results[:-1] if r[0] <= eplb_result[0] and r[1] <= eplb_result[1]]
    if (pick[0] > eplb_result[0] or pick[1] > eplb_result[1]) and dominating:
        # Not at or below EPLB on both: the least traffic among own candidates that are.
        pick = min(dominating, key=lambda r: (r[0], r[1]))
    elif pick[0] > eplb_result[0]:
        pick = eplb_result  # EPLB has less traffic (and balance within the cap): take its layout
    return pick[2]


JOINT_ROUNDS = 2  # "alternate": owner re-partitions per candidate with copies counted as local
JOINT_MAX_NODES = 16  # ReplicaPartitionState keeps N * M * N counters
JOINT_LOAD_TOLERANCES = (0.02,)  # "moves": modelled node load within these of the mean (one search each)
COBALT_JOINT = "moves"  # the joint step of the registered `cobalt` policy
BALANCE_TARGET = 1.05  # GPU max/mean on the sample up to which candidates compete on traffic alone (and "moves"
# keeps traffic copies)
BALANCE_SLACK = 1.02  # ... or within this factor of the best candidate's balance, where none reaches the target
JOINT_MAX_DROPS = 4  # "moves": copies traded for balance per joint result


def _trade_copies_for_balance(inp: LayerInput, owners: np.ndarray, copies_NE: np.ndarray,
                              fixed_NE: np.ndarray) -> list[tuple[float, float, np.ndarray]]:
    """Scored layouts, starting with (owners, copies): while the busiest GPU on the sample is above
    `BALANCE_TARGET`, its node drops the movable copy that costs the least in the replica-aware objective
    (stage 2 gives the freed slot to the node's hottest experts), at most `JOINT_MAX_DROPS` times."""
    st = inp.stats
    state = ReplicaPartitionState(st.sets_MK, st.count_M, owners, copies_NE)
    out = []
    for _ in range(JOINT_MAX_DROPS + 1):
        slots = _slots(inp, owners, state.copies_NE())
        traffic, balance, load_W = _evaluate_loads(inp, slots)
        out.append((traffic, balance, slots))
        node = int(np.argmax(load_W)) // inp.gpus_per_node
        movable_E = state.copies_NE()[node] & ~fixed_NE[node]
        if balance <= BALANCE_TARGET or not movable_E.any():
            break
        state.toggle_copy(node, int(np.argmax(np.where(movable_E, state.copy_gains(node), -np.inf))))
    return out


def replicas_for_owners(inp: LayerInput, owner_WP: np.ndarray) -> np.ndarray:
    """`[W, P + R]` slots that keep the owners of `owner_WP` in place and choose only the spare slots (free:
    no owner moves): 0, half or all of each node's G * R spare slots hold per-node traffic copies
    (`traffic_replicas` order), the rest copies of the node's hottest experts; the fewest cross-node tokens on
    the sample among those with GPU max/mean within max(1.05, 1.02 x best) wins."""
    E, N, G, R = inp.stats.num_experts, inp.nodes, inp.gpus_per_node, inp.redundant_slots
    owner_WP = np.asarray(owner_WP, dtype=np.int64)
    node_of_E = np.zeros(E, dtype=np.int64)
    rank_W = np.repeat(np.arange(owner_WP.shape[0]), owner_WP.shape[1])
    node_of_E[owner_WP.reshape(-1)] = rank_W // G
    holds_NE = np.zeros((N, E), dtype=bool)
    holds_NE[node_of_E, np.arange(E)] = True
    spare = 0 if N == 1 else G * R
    ys = sorted({0, spare // 2, spare}) if inp.topk_ids_TK.shape[0] else [0]
    sets_TK = topk_sets(np.asarray(inp.topk_ids_TK, dtype=np.int64))
    order_NE = _traffic_order_sets(sets_TK, inp.source_rank_T // G, node_of_E, holds_NE, max(ys))
    results = []
    for y in ys:
        extra_NE = order_NE < y
        slots = fill_spares(owner_WP, _node_load_NE(inp, node_of_E, extra_NE), extra_NE, G, R)
        results.append((*_evaluate(inp, slots), slots))
    best_balance = min(r[1] for r in results)
    ok = [r for r in results if r[1] <= max(BALANCE_TARGET, best_balance * BALANCE_SLACK) + 1e-12]
    return min(ok, key=lambda r: (r[0], r[1]))[2]


def _slots(inp: LayerInput, owners: np.ndarray, extra_NE: np.ndarray) -> np.ndarray:
    """Stage 2 for given owners and copies: free spare slots to the node's hottest experts, GPUs packed."""
    return plan_gpus(owners, extra_NE, _node_load_NE(inp, owners, extra_NE), inp.gpus_per_node, inp.redundant_slots)


def refine_owners(sets_MK: np.ndarray, count_M: np.ndarray, load_E: np.ndarray, node_of_E: np.ndarray,
                  copies_NE: np.ndarray, load_tolerance: float = 0.02) -> np.ndarray:
    """`[E]` owners after swap refinement on the expected remote nodes with `copies_NE` held locally.

    Node load model (sources uniform): a copy of e on node s serves s's tokens, `load_E / N`; the owner
    serves the nodes without a copy, `load_E * (1 - copies / N)`. Node loads are kept within
    `1 + load_tolerance` of the mean (or the starting maximum, if larger).
    """
    N = copies_NE.shape[0]
    copies_NE = copies_NE & (node_of_E[None, :] != np.arange(N)[:, None])
    state = ReplicaPartitionState(sets_MK, count_M, node_of_E, copies_NE)
    swap_owners(state, load_E, (1 + load_tolerance) * load_E.sum() / N)
    return state.node_of_E


def plan_layer(policy: str, inp: LayerInput) -> np.ndarray:
    """`[W, S]` slots of one layer by the named policy."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; valid: {', '.join(sorted(POLICIES))}")
    return POLICIES[policy](inp)


def _check_current(current: Layout, trace: Trace, nodes: int, gpus_per_node: int) -> None:
    """ValueError naming what differs when `current` cannot be the layout a plan for `trace` starts from."""
    found = (current.num_experts, current.nodes, current.gpus_per_node)
    if found != (trace.num_experts, nodes, gpus_per_node):
        raise ValueError(f"current layout is for num_experts={found[0]} on {found[1]} x {found[2]} GPUs, the plan for "
                         f"num_experts={trace.num_experts} on {nodes} x {gpus_per_node}")
    if current.num_layers not in (1, trace.num_layers):
        raise ValueError(f"current layout has {current.num_layers} layers but the trace has {trace.num_layers} "
                         "(need equal, or 1 layer)")


def plan_layout(
    trace: Trace,
    nodes: int,
    gpus_per_node: int,
    redundant_slots: int = 0,
    policy: str = "cobalt",
    *,
    current: Layout | None = None,
    max_sample_tokens: int = 32768,
    seed: int = 0,
    copy_cost: float = 0.0,
    copy_gpu_link_share: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> Layout:
    """A layout for every layer of `trace` (statistics from all its tokens). `copy_cost`: what one cross-node
    traffic copy costs per step in cross-node tokens per token (`migration.copy_cost_per_token`; 0: free), priced
    as the busiest inter-node link carries the copies (`layout.copy_link_load` with `copy_gpu_link_share`)."""
    E = trace.num_experts
    check_topology(E, nodes, gpus_per_node, redundant_slots)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; valid: {', '.join(sorted(POLICIES))}")
    if max_sample_tokens < 1:
        raise ValueError(f"max_sample_tokens must be >= 1, got {max_sample_tokens}")
    if current is not None:
        _check_current(current, trace, nodes, gpus_per_node)
        current = owners_first(current)
    W = nodes * gpus_per_node
    src_T = trace.source_ranks(W)
    T = trace.num_tokens
    sample = np.linspace(0, T - 1, min(T, max_sample_tokens)).astype(np.int64) if T else np.zeros(0, np.int64)
    out = []
    for layer in range(trace.num_layers):
        topk_TK = trace.experts_LTK[layer]
        inp = LayerInput(
            stats=RoutingStats.from_topk(topk_TK, E),
            topk_ids_TK=topk_TK[sample],
            source_rank_T=src_T[sample],
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            redundant_slots=redundant_slots,
            current_slots_WS=None if current is None else current.layer(min(layer, current.num_layers - 1)),
            seed=seed,
            copy_cost=copy_cost,
            copy_gpu_link_share=copy_gpu_link_share,
        )
        out.append(plan_layer(policy, inp))
        if progress is not None:
            progress(layer)
    return canonical_owner_order(Layout(E, nodes, gpus_per_node, np.stack(out)))
