"""Several hosts for real: two network namespaces joined by a veth pair, one rank in each.

Each rank runs in its own network namespace (`ip netns exec`), with its own hostname (`unshare
--uts`), so the ranks reach each other only through the veth link, by its 10.x addresses, as two
machines on a LAN would. Needs root and iproute2; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _jobs import require_mpiexec, run_job, run_ranks
from test_gloo import check_basic, results_of, worker

from dataparallel.arrays.comm_thread import THREAD_PAUSE

pytestmark = pytest.mark.spawns

SUBNET = "10.213.77"  # a /24 that exists only inside the namespaces
PORT = 29500  # free by construction: the namespaces are new
SETUP_TIMEOUT = 20


@dataclass(frozen=True)
class Host:
    """One emulated machine: a network namespace, its address and its hostname."""

    namespace: str
    address: str
    hostname: str

    def command(self, argv: list[str]) -> list[str]:
        """Return `argv` run inside this host (its namespace, and its hostname when possible)."""
        prefix = ["ip", "netns", "exec", self.namespace]
        if shutil.which("unshare"):
            script = f'hostname {self.hostname} && exec "$@"'
            return [*prefix, "unshare", "--uts", "sh", "-c", script, "sh", *argv]
        return [*prefix, *argv]


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=SETUP_TIMEOUT, check=False
    )


@pytest.fixture
def hosts() -> Iterator[tuple[Host, Host]]:
    """Create two namespaces joined by a veth pair; remove them afterwards, whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed: apt-get install -y iproute2")
    tag = f"dp{os.getpid() % 100000}"
    a = Host(f"{tag}a", f"{SUBNET}.1", f"{tag}-host-a")
    b = Host(f"{tag}b", f"{SUBNET}.2", f"{tag}-host-b")
    created: list[str] = []
    try:
        for host in (a, b):
            step = _ip("netns", "add", host.namespace)
            if step.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {step.stderr.strip()}")
            created.append(host.namespace)
        steps = [
            ("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb"),
            ("link", "set", f"{tag}va", "netns", a.namespace),
            ("link", "set", f"{tag}vb", "netns", b.namespace),
        ]
        for host, link in ((a, f"{tag}va"), (b, f"{tag}vb")):
            steps += [
                ("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", link),
                ("-n", host.namespace, "link", "set", link, "up"),
                ("-n", host.namespace, "link", "set", "lo", "up"),
            ]
        for args in steps:
            step = _ip(*args)
            if step.returncode != 0:
                pytest.skip(f"cannot set up the veth link (ip {' '.join(args)}): {step.stderr}")
        yield a, b
    finally:
        for namespace in created:  # deleting a namespace deletes its end of the veth pair
            _ip("netns", "delete", namespace)


def test_gloo_across_two_hosts(hosts: tuple[Host, Host]) -> None:
    url = f"tcp://{hosts[0].address}:{PORT}"
    commands = [
        host.command(worker("basic", "--init-method", url, "--rank", str(r), "--world-size", "2"))
        for r, host in enumerate(hosts)
    ]
    results = results_of(run_ranks(commands))
    check_basic(results)
    if shutil.which("unshare"):  # distinct hostnames: each rank is alone on its node
        assert [result["local"] for result in results] == [[0, 1], [0, 1]]


def test_mpi_across_two_hosts(hosts: tuple[Host, Host], tmp_path: Path) -> None:
    """MPI too: mpiexec runs on host a; Hydra starts host b's proxy through a launcher script."""
    before = received(hosts[1])
    results = mpi_job(hosts, tmp_path, "basic", {})
    check_basic(results, backend="mpi")
    assert [result["local"] for result in results] == [[0, 1], [0, 1]]
    # The basic scenario's 4 MiB allreduce went through the veth link (a ring moves half of it
    # each way at 2 ranks); Hydra's own traffic is a few KiB.
    assert received(hosts[1]) - before >= 2 * 2**20, "MPI's data did not cross the link"


def test_mpi_training_across_two_hosts_tests_the_threads_calls_with_pauses(
    hosts: tuple[Host, Host], tmp_path: Path
) -> None:
    # Each rank is alone on its node: the communication thread tests its MPI calls with pauses
    # instead of spinning in MPICH's wait (issue 24), and the averages are still exact.
    results = mpi_job(hosts, tmp_path, "train", {"DATAPARALLEL_OVERLAP": "1"})
    assert [result["rank"] for result in results] == [0, 1]
    for result in results:
        assert result["overlap"] is True
        assert result["pause"] == THREAD_PAUSE
        assert result["diff"] < 1e-5, result


def mpi_job(
    hosts: tuple[Host, Host], tmp_path: Path, scenario: str, extra: dict[str, str]
) -> list[dict[str, Any]]:
    """Run `gloo_worker.py SCENARIO` under mpiexec, one rank a host; return the ranks' RESULTs."""
    pytest.importorskip("mpi4py")
    mpiexec = require_mpiexec()
    if shutil.which("unshare") is None:
        pytest.skip("`unshare` is missing: without distinct hostnames MPI would use shared memory")
    # Hydra calls `LAUNCHER [-x] HOST COMMAND` where it would call ssh; run COMMAND in HOST.
    launcher = tmp_path / "netns-launcher"
    cases = "\n".join(f"  {h.address}) ns={h.namespace}; name={h.hostname};;" for h in hosts)
    launcher.write_text(
        "#!/bin/sh\n"
        'while [ "${1#-}" != "$1" ]; do shift; done\n'
        "host=$1; shift\n"
        f'case $host in\n{cases}\n  *) echo "unknown host $host" >&2; exit 1;;\nesac\n'
        'exec ip netns exec "$ns" unshare --uts sh -c "hostname $name; exec $*"\n'
    )
    launcher.chmod(0o755)
    a, b = hosts
    job = [
        str(mpiexec),
        "-hosts",
        f"{a.address},{b.address}",
        "-launcher",
        "ssh",
        "-launcher-exec",
        str(launcher),
        "-n",
        "2",
        "-ppn",
        "1",
        *worker(scenario),
    ]
    # UCX_TLS: without it UCX finds shared memory between the namespaces (one kernel), and MPI's
    # data would never cross the link. MPIEXEC_TIMEOUT: run_job's, under its hang guard.
    # MASTER_ADDR: the store of torch.distributed, made beside MPI, is on rank 0's hostname
    # otherwise, which resolves to nothing here.
    env = {"PYTHONUNBUFFERED": "1", "UCX_TLS": "tcp,self", "MASTER_ADDR": a.address, **extra}
    done = run_job(a.command(job), launcher=None, env=env)
    stdout, stderr = done.stdout, done.stderr
    assert done.returncode == 0, f"{stdout}\n{stderr}"
    decoder = json.JSONDecoder()  # the ranks' lines come through one pipe: parse each RESULT
    results = [decoder.raw_decode(part)[0] for part in stdout.split("RESULT ")[1:]]
    results.sort(key=lambda result: result["rank"])
    return results


def received(host: Host) -> int:
    """Bytes `host`'s end of the veth pair has received so far."""
    tag = host.namespace[:-1]
    device = f"{tag}v{host.namespace[-1]}"
    path = f"/sys/class/net/{device}/statistics/rx_bytes"
    done = subprocess.run(
        ["ip", "netns", "exec", host.namespace, "cat", path],
        capture_output=True, text=True, timeout=SETUP_TIMEOUT, check=True,
    )  # fmt: skip
    return int(done.stdout)
