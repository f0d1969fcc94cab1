"""`ds-cobalt report RUN_DIR`: PNG figures (matplotlib Agg) and an `index.html` from what runs write.

Legend: L layers, T tokens, K top-k, E experts, N nodes, G GPUs per node, W ranks.

Inputs found in RUN_DIR (and its immediate sub-folders), each optional:
- metrics JSON of examples/train_moe.py `--metrics-out` (any `*.json` with `step_times_s`); the variant name is
  the file stem, or the folder name for `metrics.json` (benchmarks/e2e_cluster.py writes `<rate>-<impl>/`);
- `links.json` of benchmarks/cluster/run_cluster.sh next to a metrics file (bytes on the inter-node link);
- a routing trace `*.npz` and layout-v1 `*.json` files (co-activation heatmap before / after placement,
  per-GPU load); "before" is DeepSpeed's contiguous placement;
- `layout_changes.jsonl`: one JSON object per line with `step` and the moved experts (`moved_experts` or
  `moved`: a list or a count; optional `layer`).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np

from ..planner.assign import assign_tasks
from ..planner.layout import LAYOUT_FORMAT, Layout, contiguous_layout, load_layout
from ..planner.stats import count_routing
from ..planner.trace import Trace, load_trace
from .run_metrics import check_run_metrics

__all__ = ["find_inputs", "render_report"]



def _save(fig, path, dpi: int = 100) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    _plt().close(fig)

# what the report reads of a run's metrics (examples/train_moe.py --metrics-out)
METRICS_KEYS = ("step_times_s", "steps", "traffic", "final_loss", "tokens_per_s", "world_size", "ranks_per_node")


def find_inputs(run_dir: str | Path) -> dict:
    """`{"metrics": {variant: dict}, "links": {variant: dict}, "trace": path|None, "layouts": {name: path},
    "changes": path|None}`."""
    root = Path(run_dir)
    if not root.is_dir():
        raise ValueError(f"report: {run_dir} is not a directory")
    found: dict = {"metrics": {}, "links": {}, "trace": None, "layouts": {}, "changes": None}
    for path in sorted([*root.glob("*"), *root.glob("*/*")]):
        if path.name == "layout_changes.jsonl" and found["changes"] is None:
            found["changes"] = path
        elif path.suffix == ".npz" and found["trace"] is None:
            found["trace"] = path
        elif path.suffix == ".json" and path.name != "links.json":
            try:
                data = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                if path.name == "metrics.json":
                    raise ValueError(f"report: {path} is not JSON ({err})") from None
                continue  # some other file
            if isinstance(data, dict) and "step_times_s" in data:
                check_run_metrics(data, path, METRICS_KEYS)
                name = path.parent.name if path.stem == "metrics" and path.parent != root else path.stem
                found["metrics"][name] = data
                if (path.parent / "links.json").is_file() and path.parent != root:
                    found["links"][name] = json.loads((path.parent / "links.json").read_text())
            elif isinstance(data, dict) and data.get("format") == LAYOUT_FORMAT:
                found["layouts"][path.stem] = path
    return found


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_training(metrics: dict[str, dict], links: dict[str, dict], path: Path) -> None:
    plt = _plt()
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = list(metrics)
    for name in names:
        m = metrics[name]
        t = np.asarray(m["step_times_s"], dtype=float)
        ax0.plot(np.arange(1, t.size + 1), m["tokens_per_step"] / t, lw=1.2, label=name)
    ax0.set_xlabel("step")
    ax0.set_ylabel("tokens/s")
    ax0.set_yscale("log")
    ax0.set_title("throughput per step")
    ax0.legend(fontsize=8)
    x = np.arange(len(names))
    per_step = [m["traffic"]["inter_node_bytes"] / max(m["traffic"].get("steps", m["steps"]), 1) / 2**20
                for m in metrics.values()]
    padded = [m["traffic"]["deepspeed_inter_node_bytes_padded"] / max(m["traffic"].get("steps", m["steps"]), 1)
              / 2**20 for m in metrics.values()]
    ax1.bar(x - 0.2, per_step, 0.4, label="sent (forward, all ranks)")
    ax1.bar(x + 0.2, padded, 0.4, label="DeepSpeed padded, same tokens", color="0.7")
    for name, xi in zip(names, x):
        if name in links and links[name].get("sent_bytes") and None not in links[name]["sent_bytes"]:
            link = sum(links[name]["sent_bytes"]) / metrics[name]["steps"] / 2**20
            ax1.plot([xi - 0.4, xi + 0.4], [link, link], "k--", lw=1)
    ax1.plot([], [], "k--", lw=1, label="tbf link counter, all traffic")
    ax1.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    ax1.set_ylabel("MiB per step")
    ax1.set_title("cross-node bytes per step (metrics hold run totals)")
    ax1.legend(fontsize=8)
    _save(fig, path)


def _plot_placement(trace: Trace, layouts: dict[str, Layout], path: Path, layer: int = 0) -> list[dict]:
    """Co-activation heatmaps (experts ordered by owner, node blocks marked) and per-GPU load per layout."""
    plt = _plt()
    n = len(layouts)
    fig, axes = plt.subplots(2, n, figsize=(5.8 * n, 10), squeeze=False)
    topk_TK = trace.experts_LTK[layer]
    _, coact_EE = count_routing(topk_TK, trace.num_experts)
    summary = []
    for col, (name, layout) in enumerate(layouts.items()):
        E, N, G, W = layout.num_experts, layout.nodes, layout.gpus_per_node, layout.world_size
        slots_WS = layout.layer(min(layer, layout.num_layers - 1))
        order_E = slots_WS[:, : E // W].reshape(-1)
        inside = sum(coact_EE[np.ix_(b, b)].sum() for b in np.split(order_E, N)) / max(coact_EE.sum(), 1)
        ax = axes[0, col]
        ax.imshow(np.log1p(coact_EE[np.ix_(order_E, order_E)]), cmap="viridis", interpolation="nearest")
        for b in range(1, N):
            ax.axhline(b * E / N - 0.5, color="w", lw=1)
            ax.axvline(b * E / N - 0.5, color="w", lw=1)
        ax.set_title(f"{name}: log(1+co-activation), layer {layer}\n{inside:.0%} of pairs inside a node")
        if E <= 32:
            ax.set_xticks(np.arange(E), order_E.tolist(), fontsize=7)
            ax.set_yticks(np.arange(E), order_E.tolist(), fontsize=7)
        ax.set_xlabel("expert id (ordered by owner GPU)")
        src_T = trace.source_ranks(W)
        dest_TK, _ = assign_tasks(topk_TK, src_T, slots_WS, G)
        load_W = np.bincount(dest_TK[dest_TK >= 0], minlength=W)
        ax = axes[1, col]
        ax.bar(np.arange(W), load_W, color=[f"C{(r // G) % 10}" for r in range(W)])
        ax.axhline(load_W.mean(), color="k", ls="--", lw=0.8)
        mom = float(load_W.max() / max(load_W.mean(), 1e-12))
        ax.set_title(f"{name}: per-GPU load, max/mean {mom:.3f}")
        ax.set_xlabel("global rank (colour = node)")
        ax.set_ylabel("(token, expert) pairs")
        summary.append({"layout": name, "coact_inside_node": float(inside), "gpu_load_max_over_mean": mom})
    _save(fig, path, dpi=90)
    return summary


def _read_changes(path: Path) -> list[dict]:
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{i + 1}: not JSON ({err})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row["step"], bool):
            raise ValueError(f"{path}:{i + 1}: expected an object with an int 'step', got {line.strip()[:80]}")
        moved = row.get("moved_experts", row.get("moved", 0))
        if not isinstance(moved, (list, int)) or isinstance(moved, bool):
            raise ValueError(f"{path}:{i + 1}: 'moved_experts' / 'moved' must be a list or a count, got {moved!r}")
        count = len(moved) if isinstance(moved, list) else moved
        out.append({"step": row["step"], "moved": count, "layer": row.get("layer")})
    return out


def _plot_changes(changes: list[dict], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    layers = sorted({c["layer"] for c in changes}, key=lambda v: (v is None, v))
    for i, layer in enumerate(layers):
        rows = [c for c in changes if c["layer"] == layer]
        ax.bar([c["step"] + 0.15 * i for c in rows], [c["moved"] for c in rows], width=0.6,
               label="all layers" if layer is None else f"layer {layer}")
    ax.set_xlabel("step")
    ax.set_ylabel("experts moved")
    ax.set_title("layout changes (migrations)")
    ax.legend(fontsize=8)
    _save(fig, path)


def render_report(run_dir: str | Path, out_dir: str | Path | None = None, layer: int = 0) -> Path:
    """Write PNGs and `index.html` to `out_dir` (default RUN_DIR/report); return the HTML path."""
    found = find_inputs(run_dir)
    changes = _read_changes(found["changes"]) if found["changes"] is not None else None  # errors before writing
    trace = load_trace(found["trace"]) if found["trace"] is not None else None
    if trace is not None and not 0 <= layer < trace.num_layers:
        raise ValueError(f"report: --layer {layer} is outside the trace's {trace.num_layers} layers")
    out = Path(out_dir) if out_dir else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    parts = [f"<h1>ds_cobalt report: {html.escape(str(run_dir))}</h1>"]
    if found["metrics"]:
        _plot_training(found["metrics"], found["links"], out / "training.png")
        rows = []
        for name, m in found["metrics"].items():
            tr = m["traffic"]
            steps = max(tr.get("steps", m["steps"]), 1)
            sent = tr["inter_node_bytes"] / steps
            rows.append(f"<tr><td>{html.escape(name)}</td><td>{m.get('moe_impl', '')}</td><td>{m['final_loss']:.4f}"
                        f"</td><td>{m['tokens_per_s']:.0f}</td><td>{sent / 2**20:.3f}</td>"
                        f"<td>{sent / max(tr['deepspeed_inter_node_bytes_padded'] / steps, 1):.3f}</td></tr>")
        parts += ["<h2>Training runs</h2><table border=1 cellpadding=4><tr><th>variant</th><th>impl</th>"
                  "<th>final loss</th><th>tokens/s</th><th>cross-node MiB/step</th><th>vs DeepSpeed padded</th>"
                  "</tr>", *rows, "</table>", '<img src="training.png">']
    else:
        parts.append("<p>No metrics JSON (examples/train_moe.py --metrics-out) found.</p>")
    loaded = {name: load_layout(p) for name, p in found["layouts"].items()}
    other = sorted(k for k, v in loaded.items() if trace is not None and v.num_experts != trace.num_experts)
    if other:
        parts.append(f"<p>Layouts for another number of experts than the trace's, left out: "
                     f"{html.escape(', '.join(other))}.</p>")
    loaded = {k: v for k, v in loaded.items() if k not in other}
    if trace is not None and not loaded and not found["metrics"]:
        parts.append("<p>A routing trace but no layout or metrics JSON: the nodes and GPUs per node are unknown, so "
                     "no placement plots.</p>")
    elif trace is not None:
        if loaded:
            first = next(iter(loaded.values()))
            N, G = first.nodes, first.gpus_per_node
        else:
            m = next(iter(found["metrics"].values()))
            G = m["ranks_per_node"]
            N = m["world_size"] // G
        layouts = {"before (DeepSpeed contiguous)": contiguous_layout(trace.num_experts, N, G)}
        layouts.update({f"after ({k})": v for k, v in loaded.items()})
        summary = _plot_placement(trace, layouts, out / "placement.png", layer)
        parts += [f"<h2>Placement (trace {html.escape(found['trace'].name)}, layer {layer})</h2><ul>"]
        parts += [f"<li>{html.escape(s['layout'])}: {s['coact_inside_node']:.1%} of co-activated pairs inside "
                  f"a node, GPU load max/mean {s['gpu_load_max_over_mean']:.3f}</li>" for s in summary]
        parts += ["</ul>", '<img src="placement.png">']
    else:
        parts.append("<p>No routing trace (.npz) found: no co-activation or load plots.</p>")
    if changes is not None:
        if changes:
            _plot_changes(changes, out / "layout_changes.png")
            parts += [f"<h2>Layout changes</h2><p>{len(changes)} changes, "
                      f"{sum(c['moved'] for c in changes)} experts moved.</p>", '<img src="layout_changes.png">']
    else:
        parts.append("<p>No layout_changes.jsonl: no migrations recorded.</p>")
    page = out / "index.html"
    page.write_text("<!doctype html><html><head><meta charset='utf-8'><title>ds_cobalt report</title></head><body>"
                    + "\n".join(parts) + "</body></html>\n")
    return page
