"""Expert layouts: which logical expert each physical slot holds (the DESIGN.md layout-v1 format).

Shapes: L layers, W = nodes * gpus_per_node ranks, S slots per rank, E logical experts.
`slots_LWS[l, r, s]` is the logical expert in slot s of rank r (rank = node * G + local_rank), -1 = empty.

Owner convention used by the runtime: the first E / W slots of every rank are *owner* slots (they hold
the DeepSpeed parameters and the optimizer state) and together hold every expert exactly once; the other
slots are *redundant* (replicas refreshed from the owner every step). `canonical_owner_order` reorders the
slots inside each rank so that any valid layout follows the convention.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .files import write_text_atomically

LAYOUT_FORMAT = "ds-cobalt/layout-v1"


@dataclass(frozen=True)
class Layout:
    """A placement of E logical experts on nodes x gpus_per_node ranks with slots_per_gpu slots each."""

    num_experts: int
    nodes: int
    gpus_per_node: int
    slots_LWS: np.ndarray  # [L, W, S] int64, -1 = empty

    def __post_init__(self) -> None:
        slots = np.asarray(self.slots_LWS)
        object.__setattr__(self, "slots_LWS", slots)
        validate_layout(self)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def num_layers(self) -> int:
        return int(self.slots_LWS.shape[0])

    @property
    def slots_per_gpu(self) -> int:
        return int(self.slots_LWS.shape[2])

    @property
    def owner_slots_per_gpu(self) -> int:
        return self.num_experts // self.world_size

    @property
    def redundant_slots_per_gpu(self) -> int:
        return self.slots_per_gpu - self.owner_slots_per_gpu

    def layer(self, layer: int) -> np.ndarray:
        """`[W, S]` slots of one layer."""
        return self.slots_LWS[layer]

    def replica_count(self, layer: int) -> np.ndarray:
        """`[E]` number of slots holding each expert in `layer`."""
        held = self.slots_LWS[layer].reshape(-1)
        return np.bincount(held[held >= 0], minlength=self.num_experts)

    def owner_rank(self, layer: int) -> np.ndarray:
        """`[E]` rank owning each expert (requires the owner convention)."""
        return owner_rank_of(self.slots_LWS[layer], self.num_experts)

    def node_holds(self, layer: int) -> np.ndarray:
        """`[N, E]` bool: node n holds at least one copy of expert e."""
        slots = self.slots_LWS[layer].reshape(self.nodes, -1)
        holds = np.zeros((self.nodes, self.num_experts), dtype=bool)
        node_ids = np.repeat(np.arange(self.nodes), slots.shape[1])
        flat = slots.reshape(-1)
        keep = flat >= 0
        holds[node_ids[keep], flat[keep]] = True
        return holds

    def to_json_dict(self) -> dict:
        return {
            "format": LAYOUT_FORMAT,
            "num_experts": int(self.num_experts),
            "nodes": int(self.nodes),
            "gpus_per_node": int(self.gpus_per_node),
            "slots_per_gpu": int(self.slots_per_gpu),
            "layers": [{"slots": layer.tolist()} for layer in self.slots_LWS],
        }


def owner_rank_of(slots_WS: np.ndarray, num_experts: int) -> np.ndarray:
    """`[E]` rank owning each expert of one layer `[W, S]` whose first E/W slots per rank are owner slots."""
    owners = np.asarray(slots_WS)[:, : num_experts // slots_WS.shape[0]]
    rank_of = np.empty(num_experts, dtype=np.int64)
    rank_of[owners.reshape(-1)] = np.repeat(np.arange(slots_WS.shape[0]), owners.shape[1])
    return rank_of


def cross_node_copies(slots_WS: np.ndarray, num_experts: int, gpus_per_node: int) -> np.ndarray:
    """`[W, S]` bool: the spare slots of one layer holding an expert owned on another node (traffic copies: their
    weights cross the inter-node link in every forward, their gradients in every backward)."""
    slots_WS = np.asarray(slots_WS)
    W = slots_WS.shape[0]
    node_of_E = owner_rank_of(slots_WS, num_experts) // gpus_per_node
    held = np.where(slots_WS >= 0, node_of_E[np.maximum(slots_WS, 0)], -1)
    copies = (slots_WS >= 0) & (held != (np.arange(W) // gpus_per_node)[:, None])
    copies[:, : num_experts // W] = False
    return copies


def copy_link_load(slots_WS: np.ndarray, num_experts: int, gpus_per_node: int,
                   gpu_link_share: float | None = None) -> float:
    """One layer's traffic copies as its busiest inter-node link carries them, counted in copies of an even layout:
    N x max(the most copies a node sends or receives, the most a GPU does / `gpu_link_share`), where
    `gpu_link_share` is the part of its node's inter-node bandwidth one GPU can use alone (default 1/G: a NIC per
    GPU, as the runtime's probed model and the GPU presets have it; 1: one link the node's GPUs share). Where every
    GPU sends and receives at most one copy this is the number of copies; where one owner's expert is copied to
    many nodes it sends them all, one after another (the weights in forward, their gradients back in backward), and
    that owner's link sets the time (`sim.cluster.replica_fetch` prices them so)."""
    share = 1.0 / gpus_per_node if gpu_link_share is None else float(gpu_link_share)
    if not 0.0 < share <= 1.0:
        raise ValueError(f"gpu_link_share must be in (0, 1], got {gpu_link_share!r}")
    slots_WS = np.asarray(slots_WS)
    W = slots_WS.shape[0]
    N = W // gpus_per_node
    copies = cross_node_copies(slots_WS, num_experts, gpus_per_node)
    if not copies.any():
        return 0.0
    holder_W = np.nonzero(copies)[0]
    sender_W = owner_rank_of(slots_WS, num_experts)[slots_WS[copies]]
    busiest = 0.0
    for ranks in (sender_W, holder_W):
        per_gpu = np.bincount(ranks, minlength=W)
        per_node = per_gpu.reshape(N, gpus_per_node).sum(1)
        busiest = max(busiest, float(per_node.max()), per_gpu.max() / share)
    return float(N * busiest)


def validate_layout(layout: Layout) -> None:
    """Raise ValueError naming what is wrong with a layout."""
    slots = layout.slots_LWS
    E, N, G = layout.num_experts, layout.nodes, layout.gpus_per_node
    for name, value in (("num_experts", E), ("nodes", N), ("gpus_per_node", G)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"layout: {name} must be a positive integer, got {value!r}")
    W = N * G
    if E % W != 0:
        raise ValueError(f"layout: num_experts={E} is not divisible by nodes*gpus_per_node={N}*{G}={W}")
    if slots.ndim != 3 or not np.issubdtype(slots.dtype, np.integer):
        raise ValueError(
            f"layout: slots must be an integer array [layers, ranks, slots], got {slots.dtype} {slots.shape}")
    if slots.shape[0] < 1:
        raise ValueError("layout: 'layers' is empty")
    if slots.shape[1] != W:
        raise ValueError(f"layout: each layer needs {W} ranks of slots (nodes*gpus_per_node), got {slots.shape[1]}")
    if slots.shape[2] < E // W:
        raise ValueError(f"layout: slots_per_gpu={slots.shape[2]} is below num_experts/world_size={E // W}")
    bad = (slots < -1) | (slots >= E)
    if bad.any():
        layer, rank, slot = (int(i[0]) for i in np.nonzero(bad))
        raise ValueError(
            f"layout: layer {layer} rank {rank} slot {slot} holds expert {int(slots[layer, rank, slot])}, "
            f"outside [0, {E}) and not -1"
        )
    for layer in range(slots.shape[0]):
        held = slots[layer][slots[layer] >= 0]
        missing = np.setdiff1d(np.arange(E), held)
        if missing.size:
            raise ValueError(f"layout: layer {layer} is missing expert(s) {missing[:8].tolist()}")


def contiguous_layout(num_experts: int, nodes: int, gpus_per_node: int, num_layers: int = 1) -> Layout:
    """DeepSpeed's placement: rank r holds experts [r * E/W, (r + 1) * E/W)."""
    for name, value in (("num_experts", num_experts), ("nodes", nodes), ("gpus_per_node", gpus_per_node)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    W = nodes * gpus_per_node
    if num_experts % W != 0:
        raise ValueError(f"num_experts={num_experts} is not divisible by nodes*gpus_per_node={W}")
    per_rank = np.arange(num_experts, dtype=np.int64).reshape(W, num_experts // W)
    return Layout(num_experts, nodes, gpus_per_node, np.repeat(per_rank[None], num_layers, axis=0))


def canonical_owner_order(layout: Layout) -> Layout:
    """Reorder slots inside each rank so the first E/W slots own every expert exactly once.

    Owner choice is a bipartite matching (expert -> rank holding it, E/W owners per rank); raises
    ValueError when no such choice exists (some rank holds too few distinct experts).
    """
    E, W, S = layout.num_experts, layout.world_size, layout.slots_per_gpu
    per_rank = E // W
    out = np.empty_like(layout.slots_LWS)
    for layer in range(layout.num_layers):
        slots = layout.slots_LWS[layer]
        owner_of = _match_owners(slots, E, per_rank, layer)
        for r in range(W):
            owned = [e for e in slots[r] if e >= 0 and owner_of[e] == r]
            rest = list(slots[r])
            for e in owned:
                rest.remove(e)
            out[layer, r] = np.array(sorted(owned) + rest, dtype=np.int64)[:S]
    return Layout(E, layout.nodes, layout.gpus_per_node, out)


def owners_first(layout: Layout) -> Layout:
    """`layout` where the first E/W slots of every rank already hold every expert once per layer (the convention
    the planner, the simulator's replica pricing and the runtime read owners from), else `canonical_owner_order`
    of it: a layout written by hand may hold its experts in any slot order (DESIGN.md). ValueError where no owner
    choice exists."""
    E, W = layout.num_experts, layout.world_size
    owners_LX = layout.slots_LWS[:, :, : E // W].reshape(layout.num_layers, -1)
    if all(np.array_equal(np.sort(owners), np.arange(E)) for owners in owners_LX):
        return layout
    return canonical_owner_order(layout)


def _match_owners(slots_WS: np.ndarray, E: int, per_rank: int, layer: int) -> np.ndarray:
    """Augmenting-path matching of experts to ranks with capacity per_rank each."""
    holders = [np.unique(np.nonzero(slots_WS == e)[0]).tolist() for e in range(E)]
    owner_of = np.full(E, -1, dtype=np.int64)
    owned: list[list[int]] = [[] for _ in range(slots_WS.shape[0])]

    def augment(e: int, seen: set[int], current: int = -1) -> bool:
        for r in holders[e]:
            if r == current or r in seen:
                continue
            seen.add(r)
            displaced = None
            if len(owned[r]) >= per_rank:
                displaced = next((o for o in owned[r] if augment(o, seen, current=r)), None)
                if displaced is None:
                    continue
                owned[r].remove(displaced)
            owned[r].append(e)
            owner_of[e] = r
            return True
        return False

    # Rarest experts first keeps the search short.
    for e in sorted(range(E), key=lambda e: len(holders[e])):
        if not augment(e, set()):
            raise ValueError(
                f"layout: layer {layer} has no owner assignment with {per_rank} distinct experts per rank "
                f"(expert {e} cannot be given an owner)"
            )
    return owner_of


def load_layout(path: str | Path) -> Layout:
    """Read a layout-v1 JSON file; errors name the bad field."""
    if not Path(path).is_file():
        raise ValueError(f"layout {path}: no such file")
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"layout {path}: not valid JSON ({err})") from err
    return layout_from_dict(data, source=str(path))


def is_json_int(value: object) -> bool:
    """An int read from JSON (`True` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def layout_from_dict(data: dict, source: str = "layout") -> Layout:
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object")
    if data.get("format") != LAYOUT_FORMAT:
        raise ValueError(f"{source}: 'format' must be {LAYOUT_FORMAT!r}, got {data.get('format')!r}")
    for key in ("num_experts", "nodes", "gpus_per_node", "slots_per_gpu", "layers"):
        if key not in data:
            raise ValueError(f"{source}: missing key {key!r}")
    for key in ("num_experts", "nodes", "gpus_per_node", "slots_per_gpu"):
        if not is_json_int(data[key]) or data[key] < 1:
            raise ValueError(f"{source}: {key!r} must be an int >= 1, got {data[key]!r}")
    layers = data["layers"]
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"{source}: 'layers' must be a non-empty list")
    S = data["slots_per_gpu"]
    W = data["nodes"] * data["gpus_per_node"]
    for i, layer in enumerate(layers):
        slots = layer.get("slots") if isinstance(layer, dict) else None
        if not isinstance(slots, list) or len(slots) != W:
            raise ValueError(f"{source}: layers[{i}].slots must list {W} ranks, got {type(slots).__name__}"
                             f"{'' if not isinstance(slots, list) else f' of length {len(slots)}'}")
        for r, row in enumerate(slots):
            if not isinstance(row, list) or len(row) != S:
                raise ValueError(f"{source}: layers[{i}].slots[{r}] must have slots_per_gpu={S} entries")
            bad = [v for v in row if not is_json_int(v)]
            if bad:
                raise ValueError(f"{source}: layers[{i}].slots[{r}] holds {bad[0]!r}; slots are expert ids (ints) or "
                                 "-1")
    slots_LWS = np.array([layer["slots"] for layer in layers], dtype=np.int64)
    return Layout(int(data["num_experts"]), int(data["nodes"]), int(data["gpus_per_node"]), slots_LWS)


def save_layout(layout: Layout, path: str | Path) -> None:
    write_text_atomically(path, json.dumps(layout.to_json_dict()) + "\n")
