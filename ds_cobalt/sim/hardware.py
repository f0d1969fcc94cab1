"""Hardware and model-shape descriptions for the cluster simulator (`sim/cluster.py`), with presets.

All bandwidths are achieved bytes/s in one direction (not peak, not bidirectional); the `source` string of
each preset says where the number comes from. The presets and their sources are listed in docs/simulator.md.

Hardware JSON (`ds-cobalt/hardware-v1`, `ds-cobalt simulate --hardware-json FILE`, written by
`ds-cobalt calibrate`): an object with `"format": "ds-cobalt/hardware-v1"` and the `Hardware` fields below;
`name`, `source`, `overlap`, `overlap_chunks`, `collective_overhead_s` and `link_rates` are optional.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from ..planner.files import write_text_atomically

__all__ = [
    "HARDWARE_FORMAT", "Hardware", "ModelShape", "HARDWARE_PRESETS", "MODEL_SHAPES", "get_hardware",
    "get_model_shape", "load_hardware_json", "hardware_from_dict", "save_hardware_json", "parse_rate",
]

HARDWARE_FORMAT = "ds-cobalt/hardware-v1"


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One cluster: per-GPU links, per-node NIC limit, latencies and expert GEMM throughput."""

    name: str = "custom"
    gpus_per_node: int  # GPUs (ranks) per node
    inter_node_bw_gpu: float  # bytes/s one GPU can send to (and receive from) other nodes
    inter_node_bw_node: float  # bytes/s a whole node can send to other nodes (shared NICs / one link)
    intra_node_bw: float  # bytes/s one GPU can send to peers in its node
    latency_s: float  # per message (one peer of one collective)
    collective_overhead_s: float = 0.0  # per collective call (launch, host sync, python)
    gemm_flops: float  # sustained FLOP/s of the expert GEMMs on one GPU (rank)
    overlap: bool = False  # ds_cobalt overlaps its communication with expert compute
    overlap_chunks: int = 4  # chunks of the pipelined overlap (exposed part = 1/chunks of the shorter side)
    source: str = ""
    link_rates: dict[str, float] = field(default_factory=dict)  # measured bytes/s per nominal rate (calibration)

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "overlap_chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"hardware: {name} must be a positive integer, got {value!r}")
        for name in ("inter_node_bw_gpu", "inter_node_bw_node", "intra_node_bw", "gemm_flops"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"hardware: {name} must be a positive number (bytes/s or FLOP/s), got {value!r}")
        for name in ("latency_s", "collective_overhead_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"hardware: {name} must be a number >= 0 (seconds), got {value!r}")

    def with_inter_node_rate(self, rate: str | float) -> "Hardware":
        """A copy whose inter-node bandwidth is `rate` (bytes/s, or a tc rate such as `100mbit`, looked up
        in the calibrated `link_rates` first, else taken at face value). Per GPU and per node alike (one link)."""
        if isinstance(rate, str):
            bw = self.link_rates.get(rate, parse_rate(rate))
        else:
            bw = float(rate)
        return replace(self, inter_node_bw_gpu=bw, inter_node_bw_node=bw)

    def to_json_dict(self) -> dict:
        return {"format": HARDWARE_FORMAT, **asdict(self)}


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The MoE part of a model: experts, top-k, sizes, dtype, MoE layers, tokens per GPU per step."""

    name: str = "custom"
    num_experts: int
    top_k: int
    hidden: int
    ffn: int  # expert intermediate size
    ffn_matrices: int = 3  # 3 = SwiGLU (gate, up, down), 2 = plain MLP
    dtype_bytes: int = 2  # bf16
    moe_layers: int = 1
    tokens_per_gpu: int = 4096  # per micro-batch (sequence length x micro-batch size)
    source: str = ""

    @property
    def row_bytes(self) -> int:
        """Bytes of one token row on the wire."""
        return self.hidden * self.dtype_bytes

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (what a replica fetches)."""
        return self.ffn_matrices * self.hidden * self.ffn * self.dtype_bytes

    @property
    def flops_per_row(self) -> float:
        """Forward FLOPs of one (token, expert) pair (backward is twice this)."""
        return 2.0 * self.hidden * self.ffn * self.ffn_matrices


def parse_rate(rate: str) -> float:
    """tc rate (`100mbit`, `1gbit`, `10gbit`, `500kbit`, `1gbps`) -> bytes/s; `loopback` (no limit) -> inf."""
    if rate.strip().lower() == "loopback":
        return math.inf
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(bit|bps)\s*", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected a tc rate such as 100mbit, 1gbit or 10gbit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    value = float(m.group(1)) * scale
    return value / 8 if m.group(3) == "bit" else value


# 400 Gb/s per GPU (ConnectX-7 / 8, one NIC per GPU, rail-optimised fabric) at 80% achieved all-to-all.
_IB_400G = 400e9 / 8 * 0.8
HARDWARE_PRESETS: dict[str, Hardware] = {
    "B200": Hardware(
        name="B200", gpus_per_node=8, inter_node_bw_gpu=_IB_400G, inter_node_bw_node=8 * _IB_400G,
        intra_node_bw=900e9 * 0.8, latency_s=5e-6, collective_overhead_s=10e-6, gemm_flops=2.25e15 * 0.6,
        overlap=True,
        source="DGX B200: NVLink 5 1.8 TB/s bidirectional per GPU (900 GB/s per direction), 8x 400 Gb/s "
               "ConnectX-7 (one per GPU), 2.25 PFLOP/s dense BF16 per GPU; assumed achieved: 80% of link "
               "bandwidths, 60% of peak FLOP/s on grouped expert GEMMs, 5 us per message, 10 us per collective",
    ),
    "H100": Hardware(
        name="H100", gpus_per_node=8, inter_node_bw_gpu=_IB_400G, inter_node_bw_node=8 * _IB_400G,
        intra_node_bw=450e9 * 0.8, latency_s=5e-6, collective_overhead_s=10e-6, gemm_flops=989e12 * 0.6,
        overlap=True,
        source="DGX H100: NVLink 4 900 GB/s bidirectional per GPU (450 GB/s per direction), 8x 400 Gb/s "
               "ConnectX-7, 989 TFLOP/s dense BF16 (SXM); assumed achieved: 80% of link bandwidths, 60% of "
               "peak FLOP/s, 5 us per message, 10 us per collective",
    ),
    # Calibrated on the 2-core development machine with `ds-cobalt calibrate` (see docs/simulator.md):
    # 2 namespaces x 2 CPU ranks, one tbf-limited veth per direction, gloo. The default inter-node rate is
    # the 1gbit calibration; pass --inter-node-rate (e.g. 100mbit) for the others.
    "emulated-cpu": Hardware(
        name="emulated-cpu", gpus_per_node=2, inter_node_bw_gpu=119.5e6, inter_node_bw_node=119.5e6,
        intra_node_bw=716e6, latency_s=0.0, collective_overhead_s=2.82e-3, gemm_flops=21.7e9,
        overlap=False,
        source="ds-cobalt calibrate on the 2-core development machine, 2026-11-30 "
        "(tests/data/emulated_cpu_hardware.json): "
               "TCP goodput through the tbf veth (100mbit 12.29 MB/s, 1gbit 119.5 MB/s, 10gbit 658 MB/s), gloo "
               "all-to-all with 4 ranks on loopback (2.82 ms per collective, 716 MB/s intra-node), 4 concurrent "
               "single-thread expert MLPs 64x128 fwd+bwd (21.7 GFLOP/s each)",
        link_rates={"100mbit": 12.29e6, "1gbit": 119.5e6, "10gbit": 658.4e6},
    ),
}
# H200: H100's NVLink 4 and Hopper compute with more HBM, which this model does not use.
HARDWARE_PRESETS["H200"] = replace(
    HARDWARE_PRESETS["H100"], name="H200",
    source="DGX H200: as H100 (same NVLink 4 and Hopper compute, more HBM), 8x 400 Gb/s ConnectX-7; "
           "assumed achieved: 80% of link bandwidths, 60% of peak FLOP/s, 5 us per message, 10 us per collective")

MODEL_SHAPES: dict[str, ModelShape] = {
    "mixtral": ModelShape(
        name="mixtral", num_experts=8, top_k=2, hidden=4096, ffn=14336, ffn_matrices=3, moe_layers=32,
        source="Mixtral-8x7B config.json: 8 experts, top-2, hidden 4096, intermediate 14336, 32 layers, SwiGLU",
    ),
    "qwen": ModelShape(
        name="qwen", num_experts=128, top_k=8, hidden=2048, ffn=768, ffn_matrices=3, moe_layers=48,
        source="Qwen3-30B-A3B config.json: 128 experts, top-8, hidden 2048, moe_intermediate 768, 48 layers",
    ),
    "deepseek": ModelShape(
        name="deepseek", num_experts=256, top_k=8, hidden=7168, ffn=2048, ffn_matrices=3, moe_layers=58,
        source="DeepSeek-V3 config.json: 256 routed experts, top-8, hidden 7168, moe_intermediate 2048, "
               "58 MoE layers (the shared expert and node-limited routing are not modelled)",
    ),
}


def get_hardware(name: str) -> Hardware:
    if name not in HARDWARE_PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; valid: {', '.join(HARDWARE_PRESETS)}")
    return HARDWARE_PRESETS[name]


def get_model_shape(name: str) -> ModelShape:
    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; valid: {', '.join(MODEL_SHAPES)}")
    return MODEL_SHAPES[name]


def hardware_from_dict(data: dict, source: str = "hardware") -> Hardware:
    """Validate a `ds-cobalt/hardware-v1` object; errors name the bad key."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object")
    if data.get("format", HARDWARE_FORMAT) != HARDWARE_FORMAT:
        raise ValueError(f"{source}: 'format' must be {HARDWARE_FORMAT!r}, got {data.get('format')!r}")
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(data) - known - {"format"})
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown}; valid keys: {sorted(known)}")
    kwargs = {k: v for k, v in data.items() if k != "format"}
    if "link_rates" in kwargs:
        kwargs["link_rates"] = {str(k): float(v) for k, v in kwargs["link_rates"].items()}
    try:
        return Hardware(**kwargs)
    except TypeError as err:  # a missing required field
        raise ValueError(f"{source}: {err}") from None
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


def load_hardware_json(path: str | Path) -> Hardware:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"hardware {path}: not valid JSON ({err})") from err
    return hardware_from_dict(data, source=f"hardware {path}")


def save_hardware_json(hw: Hardware, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(hw.to_json_dict(), indent=1) + "\n")
