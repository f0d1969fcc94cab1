"""Runs started by `mpirun` (Open MPI) get the right topology: DeepSpeed's MPI discovery (mpi4py) sets
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*, Open MPI sets OMPI_COMM_WORLD_LOCAL_SIZE, and ds_cobalt's
`detect_ranks_per_node` + `build_ep_groups` turn that into nodes, rails and node groups.

The test launches this file as a script: `mpirun ... -np 4 python THIS OUT PORT` (and DeepSpeed's runner).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# variables a launcher would set; removed so DeepSpeed really discovers everything through MPI
_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CROSS_RANK",
    "CROSS_SIZE",
)


def _probe(out_dir: str, port: int) -> None:
    """One MPI rank: init through DeepSpeed's MPI discovery, build ds_cobalt's groups, check they work."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from ds_cobalt.runtime.topology import build_ep_groups, detect_ranks_per_node

    deepspeed.init_distributed(
        dist_backend="gloo", auto_mpi_discovery=True, distributed_port=port, verbose=False
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    detected = detect_ranks_per_node(world)
    result = {
        "rank": rank, "world": world, "env_rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "ompi_local_rank": int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]),
        "ompi_local_size": int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"]), "detected_ranks_per_node": detected,
        "override_ranks_per_node": detect_ranks_per_node(world, 2),
    }  # fmt: skip
    for name, rpn in (("detected", detected), ("two_nodes", 2)):
        groups = build_ep_groups(None, rpn)
        topo = groups.topology
        entry = {
            "nodes": topo.nodes,
            "node": topo.node,
            "local": topo.local_rank,
            "ranks_per_node": topo.ranks_per_node,
        }
        for kind, group in (("rail_group", groups.rail_group), ("node_group", groups.node_group)):
            members = dist.get_process_group_ranks(group) if group is not None else [rank]
            total = torch.tensor([float(rank)])
            if group is not None:
                dist.all_reduce(total, group=group)  # the group really communicates
            entry[kind] = {"members": members, "rank_sum": int(total.item())}
        result[name] = entry
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# --noprefix: Open MPI started by its absolute path (shutil.which) acts as `--prefix /usr` and puts /usr/bin first on
# the ranks' PATH: their JIT build of DeepSpeed's shm op then ran the system's ninja instead of the Python
# environment's, whose build log does not match, and every switch between the two rebuilt the op (35-45 s), here
# and in the next launched test
_MPIRUN_ARGS = ["--allow-run-as-root", "--oversubscribe", "--stdin", "none", "--noprefix"]


@pytest.mark.parametrize("launcher", ["mpirun", "deepspeed --launcher openmpi"])
def test_mpirun_topology(tmp_path: Path, launcher: str) -> None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not found (apt-get install openmpi-bin; scripts/setup.sh does it as root)")
    pytest.importorskip("mpi4py")
    from conftest import REPO_ROOT, free_port, remove_deepspeed_shm

    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    ports = (free_port(), free_port())  # the probe's, and the runner's master port
    probe = [sys.executable, __file__, str(tmp_path), str(ports[0])]
    # --stdin none: with stdin forwarded from /dev/null (as under pytest), the ranks stall about a minute
    if launcher == "mpirun":
        cmd = [mpirun, *_MPIRUN_ARGS, "-np", "4", "-x", "OMP_NUM_THREADS", "-x", "PYTHONPATH", *probe]
    else:  # DeepSpeed's OpenMPI runner: one host from a hostfile, no ssh (it exports PYTHONPATH itself)
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("localhost slots=4\n")
        beside = Path(sys.executable).with_name("deepspeed")
        deepspeed_bin = str(beside) if beside.exists() else shutil.which("deepspeed")
        cmd = [deepspeed_bin, "--hostfile", str(hostfile), "--no_ssh_check", "--force_multi",
               "--master_addr", "127.0.0.1", "--master_port", str(ports[1]), "--launcher", "openmpi",
               "--launcher_args", " ".join([*_MPIRUN_ARGS, "-x", "OMP_NUM_THREADS"]), *probe[1:]]  # fmt: skip
    # its own session: on a timeout the whole tree goes (an orphaned rank compiling DeepSpeed's shm op would keep
    # its build lock, and every later process loading the op would wait on it); the ranks may rebuild the op first
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=360)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-9", "-f", str(tmp_path)], check=False)  # ranks mpirun put in groups of their own
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past 360 s:\n{output[-6000:]}")
    finally:
        remove_deepspeed_shm(*ports)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{output[-6000:]}"
    results = sorted(
        (json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")), key=lambda r: r["rank"]
    )
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r["world"] == 4 and r["env_rank"] == r["rank"]
        # DeepSpeed's discovery (hostname count) and Open MPI agree on the local rank; one host = one node
        assert r["local_rank"] == r["ompi_local_rank"] == r["rank"]
        assert r["ompi_local_size"] == 4 and r["detected_ranks_per_node"] == 4
        assert r["override_ranks_per_node"] == 2
        one, two = r["detected"], r["two_nodes"]
        assert (one["nodes"], one["node"], one["local"]) == (1, 0, r["rank"])
        assert (two["nodes"], two["node"], two["local"]) == (2, r["rank"] // 2, r["rank"] % 2)
    _check_groups({r["rank"]: r for r in results})


def _check_groups(by_rank: dict[int, dict]) -> None:
    for rank, r in by_rank.items():
        one, two = r["detected"], r["two_nodes"]
        # 1 node x 4: the node group is everyone, the rail group is just this rank
        assert one["node_group"]["members"] == [0, 1, 2, 3] and one["node_group"]["rank_sum"] == 6
        assert one["rail_group"]["members"] == [rank]
        # 2 nodes x 2: node groups {0,1} {2,3}; rails {0,2} {1,3}
        node = [2 * (rank // 2), 2 * (rank // 2) + 1]
        rail = [rank % 2, rank % 2 + 2]
        assert two["node_group"]["members"] == node and two["node_group"]["rank_sum"] == sum(node)
        assert two["rail_group"]["members"] == rail and two["rail_group"]["rank_sum"] == sum(rail)


if __name__ == "__main__":
    _probe(sys.argv[1], int(sys.argv[2]))
