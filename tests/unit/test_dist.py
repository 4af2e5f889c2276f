"""Rank discovery (runtime.launch.env) on fake launcher environments (tests/support/envs.py) and
runtime.launch.dist's helpers before init and device binding, in this process.

One process or a child (a world of one, mpi4py never imported, an srun step's scancel):
tests/integration/test_dist_integration.py. Real launchers - the venv's MPICH ``mpiexec``,
``torchrun``, Open MPI's ``mpirun``, ``srun`` on the test cluster:
tests/ranks/test_dist_ranks.py."""
from __future__ import annotations

import pytest

from runtime.launch.env import (LaunchError, LaunchInfo, derived_port, discover, first_host,
                                mpi_launcher_family, parse_tasks_per_node)
from runtime.launch.env import _vendor_fits
from tests.support.envs import MPICH_ENV, OMPI_ENV, SRUN_ENV, TORCHRUN_ENV


# ---------------------------------------------------------------------------------------------
# discover() on fake environments (use_mpi=False: never MPI_Init inside pytest)


def test_no_launcher_is_single_process():
    info = discover({}, use_mpi=False)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (0, 0, 1, 1)
    assert info.launcher == "single" and info.rendezvous == "local" and info.is_main


def test_torchrun_env():
    info = discover(TORCHRUN_ENV, use_mpi=False)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (3, 1, 4, 2)
    assert info.launcher == "torchrun" and info.node_rank == 1
    assert (info.rendezvous, info.master_addr, info.master_port) == ("tcp", "10.0.0.1", 29500)
    assert not info.is_main


def test_torchrun_without_master_addr_fails():
    env = {k: v for k, v in TORCHRUN_ENV.items() if k != "MASTER_ADDR"}
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        discover(env, use_mpi=False)


@pytest.mark.parametrize("value,counts", [
    ("4", [4]), ("2(x3)", [2, 2, 2]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3]),
])
def test_parse_tasks_per_node(value, counts):
    assert parse_tasks_per_node(value) == counts


def test_parse_tasks_per_node_rejects_garbage():
    with pytest.raises(LaunchError, match=r"SLURM_TASKS_PER_NODE='2\(3\)'"):
        parse_tasks_per_node("2(3)")


@pytest.mark.parametrize("nodelist,host", [
    ("node1", "node1"), ("gpu[07-09,12],cpu1", "gpu07"), ("a,b", "a"),
    ("rack1-n[003-004]", "rack1-n003"),
])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_srun_env():
    info = discover(SRUN_ENV, use_mpi=False)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (5, 1, 7, 2)
    assert info.launcher == "srun" and info.node_rank == 2 and info.rendezvous == "tcp"
    assert info.master_addr == "gpu07"
    assert info.master_port == derived_port("1234.0")
    assert 15000 <= info.master_port < 32000
    assert info.slurm_step == "1234.0"   # what a failing rank asks Slurm to kill


def test_srun_env_last_node_and_other_forms():
    last = dict(SRUN_ENV, SLURM_PROCID="6", SLURM_LOCALID="0", SLURM_NODEID="3")
    assert discover(last, use_mpi=False).local_world_size == 1
    # Job-level list when the step's is missing; MASTER_* override the derived values.
    env = {k: v for k, v in SRUN_ENV.items() if k != "SLURM_STEP_TASKS_PER_NODE"}
    env.update(SLURM_TASKS_PER_NODE="3,2(x3)", MASTER_ADDR="10.1.1.1", MASTER_PORT="24000")
    info = discover(env, use_mpi=False)
    assert info.local_world_size == 2 and (info.master_addr, info.master_port) == ("10.1.1.1", 24000)
    env = {k: v for k, v in SRUN_ENV.items() if k != "SLURM_STEP_TASKS_PER_NODE"}
    env["SLURM_NTASKS_PER_NODE"] = "2"
    assert discover(env, use_mpi=False).local_world_size == 2


def test_srun_concurrent_steps_get_different_ports():
    a = discover(SRUN_ENV, use_mpi=False).master_port
    b = discover(dict(SRUN_ENV, SLURM_STEP_ID="1"), use_mpi=False).master_port
    assert a != b


@pytest.mark.parametrize("step", [None, "4294967291"])
def test_batch_script_shell_is_not_an_srun_rank(step):
    """sbatch's shell has SLURM_PROCID=0 and SLURM_NTASKS=N but is one process, not rank 0 of N."""
    env = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "9"}
    if step:
        env["SLURM_STEP_ID"] = step
    assert discover(env, use_mpi=False).launcher == "single"


def test_openmpi_env_one_node_uses_a_file_in_the_session_dir():
    info = discover(OMPI_ENV, use_mpi=False)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (1, 1, 2, 2)
    assert info.launcher == "mpi" and info.rendezvous == "file"
    assert info.store_path == "/tmp/ompi.vm.0/pid.5022/presto-rendezvous-2136997889"


def test_openmpi_env_several_nodes():
    env = dict(OMPI_ENV, OMPI_COMM_WORLD_SIZE="4")
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        discover(env, use_mpi=False)
    info = discover(dict(env, MASTER_ADDR="node1"), use_mpi=False)
    assert info.rendezvous == "tcp" and info.master_addr == "node1"
    assert info.master_port == derived_port("2136997889")


def test_mpich_env():
    info = discover(MPICH_ENV, use_mpi=False)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (1, 1, 2, 2)
    assert info.launcher == "mpi" and info.rendezvous == "tcp" and info.master_port == 23456
    env = {k: v for k, v in MPICH_ENV.items() if not k.startswith("MASTER")}
    with pytest.raises(LaunchError, match="mpi4py"):
        discover(env, use_mpi=False)


def test_innermost_launcher_wins():
    slurm_daemon = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
                    "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]",
                    "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NNODES": "2"}
    # mpirun / hydra inside an allocation start their daemons with srun: ranks see both.
    assert discover({**slurm_daemon, **OMPI_ENV}, use_mpi=False).rank == 1
    hydra = discover({**slurm_daemon, **MPICH_ENV}, use_mpi=False)
    assert (hydra.rank, hydra.launcher) == (1, "mpi")
    # srun --mpi=pmi2 without mpi4py: PMI_RANK but no MPI_LOCALRANKID -> srun's variables.
    pmi2 = discover({**SRUN_ENV, "PMI_RANK": "5", "PMI_SIZE": "7"}, use_mpi=False)
    assert (pmi2.rank, pmi2.launcher, pmi2.local_world_size) == (5, "srun", 2)
    # torchrun started by srun, one agent per node (even with PMI there: MPI is not asked).
    assert discover({**slurm_daemon, **TORCHRUN_ENV}, use_mpi=False).launcher == "torchrun"
    info = discover({**slurm_daemon, **TORCHRUN_ENV, "PMI_RANK": "0", "PMI_SIZE": "2"})
    assert (info.launcher, info.rank) == ("torchrun", 3)


@pytest.mark.parametrize("env,names", [
    (dict(TORCHRUN_ENV, RANK="4"), ["RANK=4", "WORLD_SIZE=4"]),
    (dict(TORCHRUN_ENV, LOCAL_RANK="2"), ["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"]),
    (dict(OMPI_ENV, OMPI_COMM_WORLD_RANK="2"), ["OMPI_COMM_WORLD_RANK=2", "OMPI_COMM_WORLD_SIZE=2"]),
    (dict(MPICH_ENV, PMI_SIZE="0"), ["PMI_SIZE=0"]),
    (dict(SRUN_ENV, SLURM_PROCID="7"), ["SLURM_PROCID=7", "SLURM_STEP_NUM_TASKS=7"]),
    (dict(TORCHRUN_ENV, WORLD_SIZE="four"), ["WORLD_SIZE='four'"]),
])
def test_inconsistent_env_names_the_variables(env, names):
    with pytest.raises(LaunchError) as e:
        discover(env, use_mpi=False)
    for name in names:
        assert name in str(e.value)


def test_launch_info_validates_itself():
    with pytest.raises(LaunchError, match="rank=2"):
        LaunchInfo(2, 0, 2, 1, "mpi")
    with pytest.raises(LaunchError, match="launcher"):
        LaunchInfo(0, 0, 1, 1, "pbs")


def test_mpi_family_and_vendor_rules():
    assert mpi_launcher_family(OMPI_ENV) == "openmpi"
    assert mpi_launcher_family(MPICH_ENV) == "pmi"
    assert mpi_launcher_family({"PMIX_RANK": "0"}) == "pmix"
    assert mpi_launcher_family(TORCHRUN_ENV) is None
    assert _vendor_fits("MPICH", "pmi") and not _vendor_fits("MPICH", "openmpi")
    assert _vendor_fits("Open MPI", "openmpi") and not _vendor_fits("Open MPI", "pmi")
    assert not _vendor_fits("MPICH", "pmix")


def test_bad_presto_mpi_value():
    with pytest.raises(LaunchError, match="PRESTO_MPI"):
        discover({"PRESTO_MPI": "maybe"})


# ---------------------------------------------------------------------------------------------
# helpers as a world of one, in-process


def test_helpers_before_init_act_as_a_world_of_one():
    import torch
    from runtime.launch import dist
    t = torch.ones(3)
    assert dist.all_reduce_sum(t) is t and t.tolist() == [1, 1, 1]
    assert dist.broadcast_object({"a": 1}) == {"a": 1}
    assert dist.all_gather_object(5) == [5]
    dist.barrier()
    assert len(dist.check_same_on_all_ranks("config", {"a": 1})) == 64
    assert dist._ranges([1, 2, 3, 7, 9, 10]) == "1-3,7,9-10"


# ---------------------------------------------------------------------------------------------
# device binding


def test_device_binding_errors(monkeypatch):
    import torch
    from runtime.launch import dist
    info = LaunchInfo(3, 1, 4, 2, "mpi", rendezvous="mpi")
    assert dist._bind_device(info, "cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dist._bind_device(info, "auto") == torch.device("cpu")
    with pytest.raises(dist.DistError, match="rank 3: device 'cuda'"):
        dist._bind_device(info, "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    # Each task sees only its own GPU (srun --gpus-per-task=1): local rank 1 takes cuda:0.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert dist._bind_device(info, "auto") == torch.device("cuda", 0) and bound == [0]
    # Every task sees the node's GPUs: local rank i takes cuda:i.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert dist._bind_device(info, "cuda") == torch.device("cuda", 1) and bound[-1] == 1
    # 4 ranks on a node that shows each of them 2 GPUs: which one is ambiguous.
    crowded = LaunchInfo(3, 3, 8, 4, "mpi", rendezvous="mpi")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(dist.DistError, match=r"rank 3 \(local rank 3 of 4.*sees 2 CUDA devices"):
        dist._bind_device(crowded, "auto")
    with pytest.raises(dist.DistError, match=r"needs cuda:5, but this node shows 2"):
        dist._bind_device(info, "cuda:5")
    with pytest.raises(dist.DistError, match="only cpu and cuda"):
        dist._bind_device(info, "meta")
