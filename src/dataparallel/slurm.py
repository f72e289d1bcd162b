"""Slurm's environment, read as a launcher's: who this task is, and where the world meets.

Inside an `srun` step every task has `SLURM_PROCID` (its rank), `SLURM_STEP_NUM_TASKS` (the
world size), `SLURM_LOCALID`, `SLURM_NODEID` and the step's nodes (`SLURM_STEP_NODELIST`, in
Slurm's compressed hostlist form, `node[01-04,07]`). `config.Settings` reads them (it reads every
variable) and hands them over as a `SlurmJob`; this module only interprets: hostlists, tasks per
node, and the rendezvous port every task derives alike from the job and step ids, as Lightning's
`SLURMEnvironment` does (rank 0 listens on the first node of the step).

A batch script (sbatch) and an salloc shell are in the job but not in a step: `SLURM_NTASKS` there
is the allocation's, which `dataparallel run` uses (`launch/slurm.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["SlurmJob", "expand_hostlist", "rendezvous_port", "tasks_per_node"]

# Ports derived from job and step ids stay in 15000-30999, below Linux's ephemeral range
# (32768-60999), so that no outgoing connection holds one by chance.
_PORT_BASE, _PORT_SPAN, _STEPS = 15000, 16000, 8


@dataclass(frozen=True)
class SlurmJob:
    """What Slurm says of this process: the job, and the step and task when srun started it.

    `step_id` is None in a batch script or an salloc shell (the job, outside any step); `ntasks`
    is then the allocation's number of tasks, and the task fields are not meaningful.
    """

    job_id: int
    ntasks: int | None = None
    step_id: int | None = None
    procid: int | None = None
    localid: int | None = None
    nodeid: int | None = None
    nodelist: str | None = None
    tasks_per_node: str | None = None
    # The process-management interface srun gave the tasks (`--mpi=`): "pmi2", "pmix" or None.
    pmi: str | None = None

    @property
    def in_step(self) -> bool:
        """Whether srun started this process as a task of a step (rank and size are known)."""
        return self.step_id is not None and self.procid is not None and self.ntasks is not None

    @property
    def nodes(self) -> list[str]:
        """The step's (else the job's) hosts, expanded, in Slurm's order."""
        return expand_hostlist(self.nodelist) if self.nodelist else []

    @property
    def local_size(self) -> int | None:
        """The number of this step's tasks on this task's node."""
        if self.tasks_per_node is None or self.nodeid is None:
            return None
        counts = tasks_per_node(self.tasks_per_node)
        return counts[self.nodeid] if self.nodeid < len(counts) else None

    @property
    def master_addr(self) -> str | None:
        """Where rank 0 listens: the first host of the step (Slurm places task 0 there)."""
        nodes = self.nodes
        return nodes[0] if nodes else None

    @property
    def port(self) -> int:
        """The rendezvous port of this step (`rendezvous_port`)."""
        return rendezvous_port(self.job_id, self.step_id or 0)


def rendezvous_port(job_id: int, step_id: int) -> int:
    """Return the port where rank 0 of step `step_id` of job `job_id` listens.

    Every task computes it alike without talking; steps of one job (up to 8 at once) and jobs
    (2000 apart) differ. `MASTER_PORT`, when set, is used instead (`config.py`).

    >>> rendezvous_port(1234, 0), rendezvous_port(1234, 1), rendezvous_port(3234, 0)
    (24872, 24873, 24872)
    """
    return _PORT_BASE + (job_id * _STEPS + step_id % _STEPS) % _PORT_SPAN


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand Slurm's compressed hostlist into host names, in order (`scontrol show hostnames`).

    Brackets hold comma-separated numbers and ranges; zero padding is kept; several bracketed
    parts in one name multiply out (`rack[1-2]-n[1-2]`).

    >>> expand_hostlist("node[01-03,07],login,gpu[9-10]")
    ['node01', 'node02', 'node03', 'node07', 'login', 'gpu9', 'gpu10']

    Raises:
        ValueError: unbalanced brackets or a range that is not `a-b` with `a <= b`.
    """
    hosts: list[str] = []
    for name in _split_top(hostlist):
        hosts.extend(_expand_name(name, hostlist))
    return hosts


def _split_top(hostlist: str) -> list[str]:
    """Split at the commas outside brackets."""
    names, depth, start = [], 0, 0
    for i, char in enumerate(hostlist):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth < 0 or depth > 1:
            raise ValueError(f"hostlist {hostlist!r}: unbalanced brackets at position {i}.")
        if char == "," and depth == 0:
            names.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"hostlist {hostlist!r}: a '[' is not closed.")
    names.append(hostlist[start:])
    return [name.strip() for name in names if name.strip()]


def _expand_name(name: str, hostlist: str) -> list[str]:
    opening = name.find("[")
    if opening < 0:
        return [name]
    closing = name.index("]", opening)
    head, body, tail = name[:opening], name[opening + 1 : closing], name[closing + 1 :]
    numbers: list[str] = []
    for part in body.split(","):
        found = _RANGE.match(part.strip())
        if found is None:
            raise ValueError(f"hostlist {hostlist!r}: {part!r} is not a number or a range a-b.")
        first, last = found.group(1), found.group(2) or found.group(1)
        if int(last) < int(first):
            raise ValueError(f"hostlist {hostlist!r}: the range {part!r} runs backwards.")
        width = len(first) if first.startswith("0") else 0
        numbers.extend(str(n).zfill(width) for n in range(int(first), int(last) + 1))
    return [head + number + rest for number in numbers for rest in _expand_name(tail, hostlist)]


_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def tasks_per_node(spec: str) -> list[int]:
    """Expand `SLURM_STEP_TASKS_PER_NODE` (`2(x3),1`) into one count per node.

    >>> tasks_per_node("2(x3),1")
    [2, 2, 2, 1]

    Raises:
        ValueError: a part that is not `N` or `N(xK)`.
    """
    counts: list[int] = []
    for part in spec.split(","):
        found = _COUNT.match(part.strip())
        if found is None:
            raise ValueError(f"SLURM tasks per node {spec!r}: {part!r} is not N or N(xK).")
        counts.extend([int(found.group(1))] * int(found.group(2) or 1))
    return counts
