"""GPU session checks for ds_cobalt.kernels: the gpu-marked tests, then CuPy kernel vs torch reference timings.

Run through `benchmarks/gpu_checks.sh` (it makes sure the matching CuPy wheel is there), or directly:

    OUT=./gpu_results python3 benchmarks/gpu_checks.py [--skip-tests] [--iters 20]

Writes under $OUT (default ./gpu_results): `pytest_gpu.log`, `gpu_checks.json` (every timing, the test
summary, device and versions) and `gpu_checks.md` (the table for docs/kernels.md). Sizes: from a realistic
layer (T=16k tokens, K=8, D=4096, N=8 nodes) down to T=512, D=1024, in bf16 and fp32: the sizes where
`kernels.auto_backend` switches between torch and CuPy are among them. About a minute on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from ds_cobalt.kernels import chunk_ready_flags, dedup_pairs, gather_rows, weighted_scatter_add  # noqa: E402

SIZES = {  # name: (T, K, D, N)
    "layer_T16k_K8_D4096_N8": (16384, 8, 4096, 8),
    "T8192_K4_D2048_N4": (8192, 4, 2048, 4),  # rows x hidden 67M
    "T4096_K4_D1024_N4": (4096, 4, 1024, 4),  # 16.8M: where `auto` starts the row kernels (CUPY_MIN_ROW_ELEMENTS)
    "mid_T4096_K2_D1024_N2": (4096, 2, 1024, 2),  # 8.4M: benchmarks/gpu_moe_check.py's layer
    "small_T512_K8_D1024_N8": (512, 8, 1024, 8),
}


def run_tests(out: Path) -> dict:
    """`pytest -m gpu tests/kernels/test_kernels.py`; returns pass/fail counts and the exit code."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests/kernels/test_kernels.py",
           "-rfEs", "--junitxml", str(out / "pytest_gpu.xml")]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    log = proc.stdout + proc.stderr
    (out / "pytest_gpu.log").write_text(log)
    tail = [line for line in log.splitlines() if line.strip()][-1:] or [""]
    print(log[-3000:], flush=True)
    return {"command": " ".join(cmd), "returncode": proc.returncode, "summary": tail[0],
            "seconds": round(time.perf_counter() - start, 1)}


def cuda_time_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` on the current stream (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def make_inputs(T: int, K: int, D: int, N: int, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    # routes concentrate on a few nodes per token (what the planner aims for): node of expert e = e // per_node
    experts = torch.randint(0, 64, (T, K), device="cuda", generator=g)
    dest_node_TK = experts * N // 64
    dest_node_TK[torch.rand(T, K, device="cuda", generator=g) < 0.02] = -1
    pair_token_P, rail_send_N, pair_index_TK = dedup_pairs(dest_node_TK, 0, N, backend="torch")
    R = T * K
    return {
        "dest_node_TK": dest_node_TK,
        "x_TD": torch.randn(T, D, device="cuda", generator=g).to(dtype),
        "pair_token_P": pair_token_P,
        "relay_pool_R": torch.randint(0, T, (R,), device="cuda", generator=g),
        "rows_RD": torch.randn(R, D, device="cuda", generator=g).to(dtype),
        "weight_R": torch.rand(R, device="cuda", generator=g),
        "grad_TD": torch.randn(T, D, device="cuda", generator=g).to(dtype),
    }


def bench_size(name: str, T: int, K: int, D: int, N: int, dtype: torch.dtype, iters: int) -> list[dict]:
    inp = make_inputs(T, K, D, N, dtype)
    P, R, E = inp["pair_token_P"].numel(), T * K, torch.finfo(dtype).bits // 8
    ops = {
        # op: (callable(backend), bytes moved (the kernel's minimum traffic), check output)
        "dedup_pairs": (lambda b: dedup_pairs(inp["dest_node_TK"], 0, N, backend=b), T * K * 8 * 2 + P * 8),
        "gather_rows[pairs]": (lambda b: gather_rows(inp["x_TD"], inp["pair_token_P"], backend=b), 2 * P * D * E),
        "gather_rows[routes]": (lambda b: gather_rows(inp["x_TD"], inp["relay_pool_R"], backend=b), 2 * R * D * E),
        "weighted_scatter_add": (
            lambda b: weighted_scatter_add(inp["rows_RD"], inp["relay_pool_R"], inp["weight_R"], T, backend=b),
            R * D * E + R * D * 4 + T * D * (4 + 4 + E)),
    }
    rows = []
    for op, (fn, nbytes) in ops.items():
        row = {"size": name, "op": op, "dtype": str(dtype).replace("torch.", ""), "T": T, "K": K, "D": D, "N": N,
               "P": P, "R": R, "bytes": nbytes}
        for backend in ("torch", "cupy"):
            row[f"{backend}_ms"] = round(cuda_time_ms(lambda fn=fn, backend=backend: fn(backend), iters), 4)
        got, want = fn("cupy"), fn("torch")
        if op == "dedup_pairs":
            row["matches_ref"] = all(torch.equal(a, b) for a, b in zip(got, want))
        else:
            row["max_abs_diff"] = float((got.float() - want.float()).abs().max()) if got.numel() else 0.0
        row["speedup"] = round(row["torch_ms"] / row["cupy_ms"], 2) if row["cupy_ms"] else None
        row["cupy_GBps"] = round(nbytes / row["cupy_ms"] / 1e6, 1) if row["cupy_ms"] else None
        rows.append(row)
        print(json.dumps(row), flush=True)

    # backward of weighted_scatter_add (grad rows + grad weight), and of gather_rows (scatter-add)
    def scatter_backward(backend: str):
        rows_RD = inp["rows_RD"].detach().requires_grad_(True)
        w_R = inp["weight_R"].detach().requires_grad_(True)
        out = weighted_scatter_add(rows_RD, inp["relay_pool_R"], w_R, T, backend=backend)
        return lambda: torch.autograd.grad(out, (rows_RD, w_R), inp["grad_TD"], retain_graph=True)

    def gather_backward(backend: str):
        x = inp["x_TD"].detach().requires_grad_(True)
        out = gather_rows(x, inp["relay_pool_R"], backend=backend)
        grad = inp["rows_RD"]
        return lambda: torch.autograd.grad(out, (x,), grad, retain_graph=True)

    for op, make, nbytes in (("weighted_scatter_add.backward", scatter_backward, 3 * R * D * E),
                             ("gather_rows[routes].backward", gather_backward, R * D * (E + 4) + T * D * (8 + E))):
        row = {"size": name, "op": op, "dtype": str(dtype).replace("torch.", ""), "T": T, "K": K, "D": D, "N": N,
               "P": P, "R": R, "bytes": nbytes}
        for backend in ("torch", "cupy"):
            row[f"{backend}_ms"] = round(cuda_time_ms(make(backend), iters), 4)
        row["speedup"] = round(row["torch_ms"] / row["cupy_ms"], 2)
        row["cupy_GBps"] = round(nbytes / row["cupy_ms"] / 1e6, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_flags(iters: int) -> dict:
    """Host-side cost of mark_ready + wait (per chunk), both backends."""
    result = {"op": "chunk_ready_flags mark+wait (host us/chunk)"}
    comm, compute = torch.cuda.Stream(), torch.cuda.Stream()
    for backend in ("torch", "cupy"):
        flags = chunk_ready_flags(16, "cuda", backend=backend)
        result[f"{backend}_wait_mode"] = flags.wait_mode
        for _ in range(2):  # first round compiles / warms up
            flags.new_epoch()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for c in range(16):
                flags.mark_ready(c, comm)
                flags.wait(c, compute)
            torch.cuda.synchronize()
            us = (time.perf_counter() - start) / 16 * 1e6
        result[f"{backend}_us"] = round(us, 1)
    return result


def markdown(report: dict) -> str:
    lines = [f"GPU: {report['device']} | torch {report['torch']} | cupy {report['cupy']} | CUDA {report['cuda']}",
             "", f"gpu tests: `{report['tests'].get('summary', 'skipped')}`", "",
             "| size | op | dtype | torch ms | cupy ms | speedup | cupy GB/s | check |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in report["timings"]:
        check = (f"equal={r['matches_ref']}" if "matches_ref" in r
                 else f"max|diff|={r['max_abs_diff']:.3g}" if "max_abs_diff" in r else "")
        lines.append(f"| {r['size']} | {r['op']} | {r['dtype']} | {r['torch_ms']} | {r['cupy_ms']} | {r['speedup']} "
                     f"| {r['cupy_GBps']} | {check} |")
    f = report["flags"]
    lines += ["", f"chunk_ready_flags mark+wait, host us per chunk: torch {f['torch_us']} ({f['torch_wait_mode']}), "
              f"cupy {f['cupy_us']} ({f['cupy_wait_mode']})"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-tests", action="store_true", help="only the timings")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    out = Path(os.environ.get("OUT") or "./gpu_results")
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    import cupy

    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cupy": cupy.__version__,
              "cuda": torch.version.cuda, "python": platform.python_version(), "timings": []}
    report["tests"] = {"summary": "skipped (--skip-tests)"} if args.skip_tests else run_tests(out)
    start = time.perf_counter()
    for name, (T, K, D, N) in SIZES.items():
        for dtype in (torch.bfloat16, torch.float32):
            report["timings"] += bench_size(name, T, K, D, N, dtype, args.iters)
            torch.cuda.empty_cache()
    report["flags"] = bench_flags(args.iters)
    report["bench_seconds"] = round(time.perf_counter() - start, 1)
    (out / "gpu_checks.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_checks.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if args.skip_tests or report["tests"]["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
