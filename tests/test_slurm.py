"""Slurm's environment read as a launcher's (`slurm.py`, `config.py`, `launch/slurm.py`).

These tests read made-up environments and run at any world size; the tests that start a real
Slurm cluster are in `test_slurm_cluster.py`.
"""

from __future__ import annotations

from typing import NoReturn

import pytest

import dataparallel as dp
from dataparallel import startup
from dataparallel.config import Settings
from dataparallel.launch import slurm as in_slurm
from dataparallel.slurm import SlurmJob, expand_hostlist, rendezvous_port, tasks_per_node

# What srun gives task 2 of `srun -N 2 -n 5 python train.py` in job 4242 (step 3).
STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NTASKS": "5",
    "SLURM_STEP_ID": "3",
    "SLURM_PROCID": "4",
    "SLURM_STEP_NUM_TASKS": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_NODELIST": "gpu[07-08]",
    "SLURM_STEP_TASKS_PER_NODE": "3,2",
}
# An sbatch script's (or an salloc shell's) environment: the job, no step.
BATCH = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]"}


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("vm", ["vm"]),
        ("a,b", ["a", "b"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[08-11]", ["node08", "node09", "node10", "node11"]),
        ("gpu[1,3-4],login", ["gpu1", "gpu3", "gpu4", "login"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("x[007]y", ["x007y"]),
        ("a-1,b[9-10].site", ["a-1", "b9.site", "b10.site"]),
    ],
)
def test_hostlists_expand_as_scontrol_show_hostnames(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    ("hostlist", "message"),
    [
        ("node[1-3", r"a '\[' is not closed"),
        ("node1-3]", "unbalanced brackets"),
        ("node[3-1]", "runs backwards"),
        ("node[a-b]", "is not a number or a range"),
        ("n[[1]]", "unbalanced brackets"),
    ],
)
def test_malformed_hostlists_are_refused(hostlist: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        expand_hostlist(hostlist)


def test_tasks_per_node_expand() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="is not N or N"):
        tasks_per_node("2(3)")


def test_rendezvous_ports_differ_by_step_and_stay_below_the_ephemeral_range() -> None:
    ports = {rendezvous_port(job, step) for job in range(1, 300) for step in range(8)}
    assert len(ports) == 299 * 8  # every (job, step) of these its own port
    assert all(15000 <= port < 31000 for port in ports)
    assert rendezvous_port(7, 0) == rendezvous_port(7, 8)  # steps wrap after 8


def test_an_srun_step_stands_in_for_torchrun() -> None:
    settings = Settings.from_env(STEP)
    assert settings.slurm == SlurmJob(
        job_id=4242,
        ntasks=5,
        step_id=3,
        procid=4,
        localid=1,
        nodeid=1,
        nodelist="gpu[07-08]",
        tasks_per_node="3,2",
    )
    assert (settings.rank, settings.world_size) == (4, 5)
    assert (settings.local_rank, settings.local_world_size) == (1, 2)
    assert settings.master_addr == "gpu07"
    assert settings.master_port == rendezvous_port(4242, 3)
    assert settings.torchrun_launched and settings.launched_size == 5


def test_torchrun_and_master_variables_win_over_slurm() -> None:
    settings = Settings.from_env({**STEP, "MASTER_ADDR": "head", "MASTER_PORT": "29400"})
    assert (settings.master_addr, settings.master_port, settings.rank) == ("head", 29400, 4)
    inner = {**STEP, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    settings = Settings.from_env(inner)  # a rank of `srun -n 1 dataparallel run -n 2`
    assert (settings.rank, settings.world_size, settings.master_addr) == (0, 2, "127.0.0.1")


def test_under_srun_mpi_the_mpi_launcher_decides() -> None:
    pmi2 = {**STEP, "PMI_FD": "11", "PMI_RANK": "4", "PMI_SIZE": "5"}
    settings = Settings.from_env(pmi2)
    assert settings.mpi_launched and settings.slurm is not None
    assert settings.slurm.pmi == "pmi2"
    assert settings.rank is None and settings.master_addr is None  # MPI's rank, not Slurm's
    pmix = {**STEP, "PMIX_RANK": "4", "PMIX_NAMESPACE": "slurm.pmix.4242.3"}
    slurm = Settings.from_env(pmix).slurm
    assert slurm is not None and slurm.pmi == "pmix"


def test_a_batch_script_is_in_the_job_but_not_in_a_step() -> None:
    settings = Settings.from_env(BATCH)
    assert settings.slurm is not None and not settings.slurm.in_step
    assert settings.slurm.ntasks == 4
    assert settings.slurm.nodes == ["n1", "n2"]
    assert settings.rank is None and not settings.torchrun_launched


def test_a_world_of_one_in_a_job_of_several_tasks_is_refused() -> None:
    message = r"Slurm job 4242 of 4 tasks \(SLURM_NTASKS=4\) but was not started as one of them"
    with pytest.raises(dp.BackendUnavailableError, match=message):
        startup.check_slurm_step(Settings.from_env(BATCH))
    startup.check_slurm_step(Settings.from_env({**BATCH, "SLURM_NTASKS": "1"}))
    startup.check_slurm_step(Settings.from_env(STEP))  # a step: Gloo forms the world


class _UsageError(Exception):
    pass


def _error(message: str) -> NoReturn:
    raise _UsageError(message)


def test_run_in_an_allocation_defaults_to_its_tasks_and_refuses_more() -> None:
    job = Settings.from_env(BATCH).slurm
    assert job is not None
    assert in_slurm.ranks(None, job, _error) == 4
    assert in_slurm.ranks(3, job, _error) == 3
    with pytest.raises(_UsageError, match=r"-n 5 exceeds the 4 tasks of Slurm job 4242"):
        in_slurm.ranks(5, job, _error)
    unsized = Settings.from_env({"SLURM_JOB_ID": "9"}).slurm
    assert unsized is not None
    with pytest.raises(_UsageError, match="SLURM_NTASKS is unset"):
        in_slurm.ranks(None, unsized, _error)


def test_run_in_a_step_starts_its_ranks_there_but_only_from_one_task() -> None:
    one = Settings.from_env({**STEP, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}).slurm
    assert one is not None
    assert in_slurm.ranks(2, one, _error) == 2
    with pytest.raises(_UsageError, match="-n N is needed inside an srun step"):
        in_slurm.ranks(None, one, _error)
    several = Settings.from_env(STEP).slurm
    assert several is not None
    with pytest.raises(_UsageError, match="one of 5 tasks: each task would launch a job"):
        in_slurm.ranks(2, several, _error)


def test_srun_command_labels_lines_and_ends_the_step_on_a_failure() -> None:
    command = in_slurm.srun_command(3, ["train.py", "--lr", "1"])
    assert command[:5] == ["srun", "--ntasks=3", "--kill-on-bad-exit=1", "--label", "--mpi=none"]
    assert command[-4:] == ["--prefixed", "train.py", "--lr", "1"]


def test_pmix_is_refused_before_mpi_init_where_the_mpi_library_cannot_speak_it() -> None:
    from dataparallel.backends.mpi import library

    version = library.library_version()
    if "MPICH" not in version or "pmix" in version.lower():
        pytest.skip(f"the MPI here can speak PMIx, or there is none: {version[:60]!r}")
    pmix = Settings.from_env({**STEP, "PMIX_RANK": "4", "PMIX_NAMESPACE": "slurm.pmix.4242.3"})
    with pytest.raises(dp.BackendUnavailableError, match=r"srun --mpi=pmi2 .*or without --mpi"):
        library.check_pmi(pmix)
    library.check_pmi(Settings.from_env({**STEP, "PMI_FD": "3", "PMI_RANK": "4"}))  # PMI-2: fine
