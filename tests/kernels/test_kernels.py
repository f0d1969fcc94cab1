"""ds_cobalt.kernels: torch reference vs naive numpy, gradchecks, nvcc compile of every .cu, backend
selection, packaging of the .cu files, and (marked gpu) the CuPy kernels vs the reference."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch

from ds_cobalt.kernels import chunk_ready_flags, dedup_pairs, gather_rows, ref, resolve_backend, weighted_scatter_add

REPO = Path(__file__).resolve().parents[2]
CU_FILES = sorted((REPO / "cuda").glob("*.cu"))

# (T, K, N, src_node, drop fraction): odd sizes, empty inputs, k = 1, large k, one node, all dropped
DEDUP_CASES = [
    (0, 4, 3, 0, 0.0), (5, 0, 2, 1, 0.0), (1, 1, 1, 0, 0.0), (1, 1, 2, 0, 0.0), (17, 3, 4, 2, 0.2),
    (257, 8, 8, 5, 0.1), (33, 64, 5, 0, 0.3), (100, 8, 1, 0, 0.0), (13, 4, 3, 1, 1.0), (300, 2, 16, 15, 0.5),
]
# (rows in, rows out / routes, D)
ROW_CASES = [(0, 0, 7), (5, 0, 16), (1, 1, 1), (17, 33, 7), (64, 300, 129), (3, 9, 6), (40, 40, 2), (8, 5, 0)]


def _dest(T: int, K: int, N: int, drop: float, seed: int, dtype=torch.int64) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    d = rng.integers(0, N, size=(T, K))
    d[rng.random((T, K)) < drop] = -1
    return torch.from_numpy(d).to(dtype)


def _naive_dedup(dest: np.ndarray, src: int, N: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    T, K = dest.shape
    pairs = [(n, t) for n in range(N) if n != src for t in range(T) if any(dest[t, k] == n for k in range(K))]
    where = {p: i for i, p in enumerate(pairs)}
    index = np.full((T, K), -1, dtype=np.int64)
    for t in range(T):
        for k in range(K):
            if dest[t, k] >= 0 and dest[t, k] != src:
                index[t, k] = where[(int(dest[t, k]), t)]
    rail = np.array([sum(1 for n2, _ in pairs if n2 == n) for n in range(N)], dtype=np.int64)
    return np.array([t for _, t in pairs], dtype=np.int64), rail, index


def _naive_scatter(rows: np.ndarray, index: np.ndarray, weight: np.ndarray | None, O: int,
                   base: np.ndarray | None = None) -> np.ndarray:
    out = np.zeros((O, rows.shape[1])) if base is None else base.astype(np.float64).copy()
    for r in range(rows.shape[0]):
        out[index[r]] += rows[r].astype(np.float64) * (1.0 if weight is None else float(weight[r]))
    return out


# ---------------------------------------------------------------------------------- reference vs naive
@pytest.mark.parametrize("T,K,N,src,drop", DEDUP_CASES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_dedup_pairs_ref_matches_naive(T, K, N, src, drop, dtype):
    dest = _dest(T, K, N, drop, seed=T * 31 + K, dtype=dtype)
    pair_token, rail, index = ref.dedup_pairs(dest, src, N)
    want_token, want_rail, want_index = _naive_dedup(dest.numpy(), src, N)
    assert pair_token.dtype == rail.dtype == index.dtype == torch.int64
    np.testing.assert_array_equal(pair_token.numpy(), want_token)
    np.testing.assert_array_equal(rail.numpy(), want_rail)
    np.testing.assert_array_equal(index.numpy(), want_index)
    assert index.shape == (T, K) and rail.shape == (N,) and int(rail.sum()) == pair_token.numel()


@pytest.mark.parametrize("T,K,N,src,drop", DEDUP_CASES)
def test_dedup_pairs_padded_holds_the_pairs_first(T, K, N, src, drop):
    dest = _dest(T, K, N, drop, seed=T * 7 + N)
    pair_token, rail, index = ref.dedup_pairs(dest, src, N)
    padded, rail_p, index_p = ref.dedup_pairs(dest, src, N, padded=True)
    assert padded.numel() == T * min(K, max(N - 1, 0))  # the bound, whatever the data
    assert torch.equal(padded[: pair_token.numel()], pair_token)
    assert torch.equal(rail_p, rail) and torch.equal(index_p, index)


@pytest.mark.parametrize("T,P,D", ROW_CASES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gather_rows_ref_matches_naive(T, P, D, index_dtype):
    g = torch.Generator().manual_seed(P + D)
    x = torch.randn(T, D, generator=g)
    index = torch.randint(0, max(T, 1), (P,), generator=g).to(index_dtype) if T else torch.zeros(0, dtype=index_dtype)
    out = ref.gather_rows(x, index)
    assert out.shape == (P, D) and out.dtype == x.dtype
    np.testing.assert_array_equal(out.numpy(), x.numpy()[index.numpy()].reshape(P, D))


@pytest.mark.parametrize("O,R,D", ROW_CASES)
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("with_base", [False, True])
def test_weighted_scatter_add_ref_matches_naive(O, R, D, weighted, with_base):
    g = torch.Generator().manual_seed(O * 7 + R)
    rows = torch.randn(R, D, generator=g)
    index = torch.randint(0, max(O, 1), (R,), generator=g) if O else torch.zeros(0, dtype=torch.int64)
    weight = torch.rand(R, generator=g) if weighted else None
    base = torch.randn(O, D, generator=g) if with_base else None
    out = ref.weighted_scatter_add(rows, index, weight, O, base_OD=base)
    want = _naive_scatter(rows.numpy(), index.numpy(), None if weight is None else weight.numpy(), O,
                          None if base is None else base.numpy())
    assert out.shape == (O, D) and out.dtype == rows.dtype
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)


def test_weighted_scatter_add_ref_accumulates_in_fp32_then_casts():
    rows = torch.full((300, 4), 1.0, dtype=torch.bfloat16)  # 300 in bf16 arithmetic would stall at 256
    out = ref.weighted_scatter_add(rows, torch.zeros(300, dtype=torch.int64), None, 2)
    assert out.dtype == torch.bfloat16
    assert out[0].tolist() == [300.0] * 4 and out[1].tolist() == [0.0] * 4


def test_ref_ops_reproduce_dispatch_expressions_bitwise():
    """The ops are drop-in for dispatch.py's torch code (same values, bit for bit)."""
    g = torch.Generator().manual_seed(0)
    T, K, N, G, node = 37, 4, 3, 2, 1
    dest_rank_TK = torch.randint(-1, N * G, (T, K), generator=g)
    valid_TK = dest_rank_TK >= 0
    dest_node_TK = torch.where(valid_TK, dest_rank_TK // G, torch.full_like(dest_rank_TK, -1))
    remote_TK = valid_TK & (dest_node_TK != node)
    # dispatch.py Step 1, verbatim
    route_t, route_k = remote_TK.nonzero(as_tuple=True)
    route_node = dest_node_TK[route_t, route_k]
    by_node = torch.argsort(route_node, stable=True)
    route_t, route_k, route_node = route_t[by_node], route_k[by_node], route_node[by_node]
    pair_NT = torch.zeros((N, T), dtype=torch.bool)
    pair_NT[route_node, route_t] = True
    _, pair_token_P = pair_NT.nonzero(as_tuple=True)
    rail_send_N = pair_NT.sum(1)
    pair_start_N = torch.cumsum(rail_send_N, 0) - rail_send_N
    pair_pos_NT = torch.cumsum(pair_NT.reshape(-1), 0).reshape(N, T) - 1
    meta_row = pair_pos_NT[route_node, route_t] - pair_start_N[route_node]
    # the replacement
    tok, rail, pair_index_TK = dedup_pairs(dest_node_TK, node, N, backend="torch")
    assert torch.equal(tok, pair_token_P) and torch.equal(rail, rail_send_N)
    assert torch.equal(pair_index_TK[route_t, route_k] - pair_start_N[route_node], meta_row)
    # gathers and combine, in bf16
    x_TD = torch.randn(T, 8, generator=g).to(torch.bfloat16)
    assert torch.equal(gather_rows(x_TD, pair_token_P, backend="torch"), x_TD[pair_token_P])
    back_RD = torch.randn(50, 8, generator=g).to(torch.bfloat16)
    relay_pool_R = torch.randint(0, T + 5, (50,), generator=g)
    relay_weight_R = torch.rand(50, generator=g)
    contrib_RD = back_RD.float() * relay_weight_R.float().unsqueeze(1)
    pooled = contrib_RD.new_zeros((T + 5, 8)).index_add(0, relay_pool_R, contrib_RD).to(back_RD.dtype)
    assert torch.equal(weighted_scatter_add(back_RD, relay_pool_R, relay_weight_R, T + 5, backend="torch"), pooled)


# ------------------------------------------------------------------------------------------- gradcheck
def test_gradcheck_gather_rows():
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([3, 0, 3, 5, 5, 5, 1], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda x_: ref.gather_rows(x_, index), (x,))


@pytest.mark.parametrize("weighted,with_base", [(True, False), (False, False), (True, True)])
def test_gradcheck_weighted_scatter_add(weighted, with_base):
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(9, 4, dtype=torch.float64, generator=g, requires_grad=True)
    index = torch.tensor([0, 2, 2, 4, 0, 1, 4, 4, 2])
    weight = torch.rand(9, dtype=torch.float64, generator=g, requires_grad=True) if weighted else None
    base = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True) if with_base else None
    inputs = tuple(t for t in (rows, weight, base) if t is not None)

    def f(*args):
        it = iter(args)
        r = next(it)
        w = next(it) if weighted else None
        b = next(it) if with_base else None
        return ref.weighted_scatter_add(r, index, w, 5, base_OD=b)

    assert torch.autograd.gradcheck(f, inputs)


# -------------------------------------------------------------------------------------- input checks
def test_reference_rejects_bad_shapes():
    with pytest.raises(ValueError, match="dest_node_TK must be"):
        ref.dedup_pairs(torch.zeros(3, dtype=torch.int64), 0, 2)
    with pytest.raises(ValueError, match="index_P must be"):
        ref.gather_rows(torch.zeros(3, 2), torch.zeros(2, dtype=torch.float32))
    with pytest.raises(ValueError, match="index_R must be"):
        ref.weighted_scatter_add(torch.zeros(3, 2), torch.zeros(2, dtype=torch.int64), None, 4)
    with pytest.raises(ValueError, match="weight_R must be"):
        ref.weighted_scatter_add(torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64), torch.ones(2), 4)
    with pytest.raises(ValueError, match="base_OD must be"):
        ref.weighted_scatter_add(torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64), None, 4,
                                 base_OD=torch.zeros(4, 3))


# --------------------------------------------------------------------------------- backend selection
def test_backend_cupy_on_cpu_tensors_says_how_to_fix():
    x = torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"needs CUDA tensors.*\.cuda\(\).*backend='torch'"):
        gather_rows(x, torch.zeros(1, dtype=torch.int64), backend="cupy")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        dedup_pairs(torch.zeros(2, 2, dtype=torch.int64), 0, 2, backend="cupy")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        weighted_scatter_add(x, torch.zeros(3, dtype=torch.int64), None, 2, backend="cupy")


def test_backend_cupy_without_cupy_says_which_wheel(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    with pytest.raises(ImportError, match=r"pip install cupy-cuda12x.*pip install cupy-cuda13x"):
        resolve_backend("cupy", device=torch.device("cuda", 0))
    assert resolve_backend("auto", device=torch.device("cuda", 0)) == "torch"


def test_backend_auto_and_bad_names():
    assert resolve_backend("auto", torch.zeros(1)) == "torch"
    assert resolve_backend("torch", device=torch.device("cuda", 0)) == "torch"
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'cupy'\), got 'triton'"):
        gather_rows(torch.zeros(2, 2), torch.zeros(1, dtype=torch.int64), backend="triton")


def test_chunk_ready_flags_on_cpu():
    flags = chunk_ready_flags(3, "cpu")
    assert flags.backend == "torch" and flags.wait_mode == "host"
    with pytest.raises(RuntimeError, match="new_epoch"):
        flags.mark_ready(0)
    for epoch in (1, 2):
        assert flags.new_epoch() == epoch
        assert not flags.is_ready(1)
        with pytest.raises(RuntimeError, match=r"wait\(1\) before mark_ready\(1\)"):
            flags.wait(1)
        flags.mark_ready(1)
        flags.wait(1)
        assert flags.is_ready(1) and flags.flags_C.tolist() == [0, epoch, 0]
    with pytest.raises(ValueError, match="chunk must be in"):
        flags.wait(3)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        chunk_ready_flags(2, "cpu", backend="cupy")


# ------------------------------------------------------------------------------- CUDA sources, package
def _nvcc() -> str | None:
    return shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).exists()), None)


def test_cuda_sources_exist():
    assert {p.name for p in CU_FILES} >= {"dedup_pairs.cu", "gather_rows.cu", "weighted_scatter_add.cu",
                                          "chunk_flags.cu"}
    for path in CU_FILES:
        assert "Memory traffic" in path.read_text(), f"{path.name}: header comment must state memory traffic"


@pytest.mark.parametrize("path", CU_FILES, ids=[p.name for p in CU_FILES])
def test_cuda_source_compiles_with_nvcc(path, tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (install the CUDA toolkit to syntax-check the .cu files without a GPU)")
    result = subprocess.run([nvcc, "--ptx", "-arch=sm_90", "-std=c++14", str(path), "-o", str(tmp_path / "k.ptx")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    ptxas = Path(nvcc).with_name("ptxas")
    if ptxas.exists():  # assemble too: catches bad inline PTX that --ptx passes through
        result = subprocess.run([str(ptxas), "-arch=sm_90", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    for name in _extern_kernels(path):
        assert f".entry {name}(" in ptx, f"{name} missing from the PTX of {path.name}"


def _extern_kernels(path: Path) -> list[str]:
    import re

    text = path.read_text()
    names = [n for n in re.findall(r'extern "C" __global__ void (\w+)\(', text) if n != "NAME"]
    # kernels stamped out by the DS_COBALT_GATHER / DS_COBALT_SCATTER macros
    for args in re.findall(r"^DS_COBALT_GATHER\((\w+),", text, flags=re.M):
        names.append(args)
    for suffix in re.findall(r"^DS_COBALT_SCATTER\((\w+),", text, flags=re.M):
        names += [f"weighted_scatter_add_{suffix}", f"weighted_scatter_add_vec4_{suffix}",
                  f"weighted_scatter_add_backward_{suffix}"]
    return names


def test_cuda_sources_found_by_the_loader():
    from ds_cobalt.kernels.sources import cuda_source, cuda_source_names

    assert cuda_source_names() == [p.name for p in CU_FILES]
    for path in CU_FILES:
        assert cuda_source(path.name) == path.read_text()


def test_pyproject_lists_every_subpackage():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "ds_cobalt").rglob("__init__.py")}
    listed = set(config["packages"])
    assert on_disk <= listed, f"add {sorted(on_disk - listed)} to [tool.setuptools] packages in pyproject.toml"
    assert config["package-dir"]["ds_cobalt.cuda"] == "cuda"
    assert "*.cu" in config["package-data"]["ds_cobalt.cuda"]
    assert not (REPO / "cuda" / "__init__.py").exists(), "cuda/__init__.py would shadow the `cuda` namespace (cupy)"


def test_wheel_ships_cuda_sources(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("ds_cobalt", "cuda"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                             "-q", "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in CU_FILES:
        assert f"ds_cobalt/cuda/{path.name}" in names
    assert "ds_cobalt/kernels/cupy_backend.py" in names


# ------------------------------------------------------------------------- CuPy kernels vs reference
# Run on a GPU machine with CuPy installed (benchmarks/gpu_checks.sh installs the matching wheel).
# A CUDA machine without CuPy fails here with the install hint instead of skipping.
GPU_ROW_CASES = ROW_CASES + [(64, 300, 4096), (1000, 4000, 1024), (33, 65, 3)]
ROW_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
        torch.float16: dict(rtol=2e-3, atol=2e-3)}


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,N,src,drop", DEDUP_CASES + [(16384, 8, 8, 3, 0.05)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_gpu_dedup_pairs_matches_ref(T, K, N, src, drop, dtype):
    dest = _dest(T, K, N, drop, seed=T + K, dtype=dtype).cuda()
    got = dedup_pairs(dest, src, N, backend="cupy")
    want = ref.dedup_pairs(dest, src, N)
    for g, w, name in zip(got, want, ("pair_token_P", "rail_send_N", "pair_index_TK")):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name
    padded = dedup_pairs(dest, src, N, padded=True, backend="cupy")[0]
    assert padded.numel() == T * min(K, max(N - 1, 0)) and torch.equal(padded[: want[0].numel()], want[0])


@pytest.mark.gpu
@pytest.mark.parametrize("T,P,D", GPU_ROW_CASES)
@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_gather_rows_matches_ref(T, P, D, dtype, index_dtype):
    g = torch.Generator(device="cuda").manual_seed(P + D)
    x = torch.randn(T + 1, D, device="cuda", generator=g).to(dtype)
    index = torch.randint(0, max(T, 1), (P,), device="cuda", generator=g).to(index_dtype)
    for xs in (x[:T], x[1:]):  # x[1:] is misaligned for D*elsize % 16 != 0: exercises narrower vectors
        xs = xs.detach().requires_grad_(True)
        got = gather_rows(xs, index, backend="cupy")
        assert torch.equal(got, ref.gather_rows(xs.detach(), index))
        grad = torch.randn_like(got)
        (got_grad,) = torch.autograd.grad(got, xs, grad) if P and D else (torch.zeros_like(xs),)
        want_grad = ref.weighted_scatter_add(grad, index, None, xs.shape[0])
        torch.testing.assert_close(got_grad, want_grad, **_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("O,R,D", GPU_ROW_CASES)
@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("weighted,with_base", [(True, False), (False, False), (True, True)])
def test_gpu_weighted_scatter_add_matches_ref(O, R, D, dtype, index_dtype, weighted, with_base):
    g = torch.Generator(device="cuda").manual_seed(O * 7 + R)
    rows = torch.randn(R, D, device="cuda", generator=g).to(dtype)
    index = torch.randint(0, max(O, 1), (R,), device="cuda", generator=g).to(index_dtype)
    weight = torch.rand(R, device="cuda", generator=g) if weighted else None
    base = torch.randn(O, D, device="cuda", generator=g).to(dtype) if with_base else None
    leaves = [t for t in (rows, weight, base) if t is not None]
    outs, grads = [], []
    for backend in ("cupy", "torch"):
        args = [t.detach().requires_grad_(True) for t in leaves]
        it = iter(args)
        r, w, b = next(it), (next(it) if weighted else None), (next(it) if with_base else None)
        out = weighted_scatter_add(r, index, w, O, base_OD=b, backend=backend)
        assert out.dtype == dtype and out.shape == (O, D)
        outs.append(out)
        grads.append(torch.autograd.grad(out, args, torch.ones_like(out) * 0.5, allow_unused=True)
                     if out.numel() and R else None)
    torch.testing.assert_close(outs[0], outs[1], **_TOL[dtype])
    if grads[0] is not None:
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-3 if got.dtype == torch.float32 else 1e-2,
                                       atol=1e-3 * max(1, D) ** 0.5 if got.dim() == 1 else _TOL[dtype]["atol"])


@pytest.mark.gpu
def test_gpu_auto_picks_cupy_and_flags_order_streams():
    assert resolve_backend("auto", torch.zeros(1, device="cuda")) == "cupy"
    assert chunk_ready_flags(2, "cuda").backend == "torch"  # measured faster (ops.chunk_ready_flags)
    flags = chunk_ready_flags(2, "cuda", backend="cupy")
    assert flags.backend == "cupy" and flags.wait_mode in ("event", "stream_wait_value32")
    comm, compute = torch.cuda.Stream(), torch.cuda.Stream()
    src = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    dst = torch.zeros_like(src)
    for epoch in (1, 2):
        flags.new_epoch()
        with torch.cuda.stream(comm):
            torch.cuda._sleep(50_000_000)  # a slow "receive" (~tens of ms)
            dst.copy_(src * epoch)
            flags.mark_ready(1, comm)
        flags.wait(1, compute)
        with torch.cuda.stream(compute):
            seen = dst.sum()
        torch.cuda.synchronize()
        assert seen.item() == float(src.sum().item() * epoch)
        assert flags.flags_C.tolist() == [0, epoch] and flags.is_ready(1)


def test_auto_backend_by_op_and_size():
    from ds_cobalt.kernels import auto_backend
    assert auto_backend("dedup_pairs", 0) == "cupy"
    for op, at in (("weighted_scatter_add", 1 << 24), ("gather_rows", 1 << 26)):
        assert auto_backend(op, at - 1) == "torch"
        assert auto_backend(op, at) == "cupy"
    with pytest.raises(ValueError, match="unknown op 'gemm'"):
        auto_backend("gemm", 1)


@pytest.mark.gpu
def test_gpu_auto_runs_each_op_where_measured_faster(monkeypatch):
    from ds_cobalt.kernels import cupy_backend

    calls = []
    for name in ("dedup_pairs", "gather_rows", "weighted_scatter_add"):
        monkeypatch.setattr(cupy_backend, name, lambda *a, name=name, **k: calls.append(name))
    small = torch.zeros(4, 8, device="cuda")
    index = torch.zeros(4, dtype=torch.int64, device="cuda")
    gather_rows(small, index)
    weighted_scatter_add(small, index, None, 4)
    dedup_pairs(torch.zeros(4, 2, dtype=torch.int64, device="cuda"), 0, 2)
    assert calls == ["dedup_pairs"]
