"""Several hosts for real: two network namespaces joined by a veth pair.

Each rank runs in its own network namespace (`ip netns exec`), with its own hostname (`unshare
--uts`), so the ranks reach each other only through the veth link, by its 10.x addresses, as two
machines on a LAN would. Needs root and iproute2; skipped with the reason otherwise.

`dataparallel run -H a:2,b:2` runs in host a and reaches host b through a real sshd running
there (Debian's openssh-server, with keys made by the test), on a port of its own (`-p`) with
the test's key (`-i`). Skipped with the reason where sshd is not installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _jobs import require_mpiexec, run_job, run_ranks, spawn
from test_gloo import check_basic, results_of, worker

from dataparallel.arrays.comm_thread import THREAD_PAUSE

pytestmark = pytest.mark.spawns

SUBNET = "10.213.77"  # a /24 that exists only inside the namespaces
PORT = 29500  # free by construction: the namespaces are new
SETUP_TIMEOUT = 20
SSH_PORT = 2222  # not ssh's own: the launcher must pass -p
SCRIPTS = Path(__file__).parent / "scripts"


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


@contextlib.contextmanager
def emulated_hosts(count: int) -> Iterator[tuple[Host, ...]]:
    """Create `count` hosts, network namespaces joined by a Linux bridge in a namespace of its
    own (a switch: each host has one veth to it), host i at `SUBNET.i+1`; remove them
    afterwards, whatever happens. Skips with the reason where namespaces or bridges cannot be
    had."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed: apt-get install -y iproute2")
    tag = f"dp{os.getpid() % 100000}"
    switch = f"{tag}sw"
    hosts = tuple(
        Host(f"{tag}{letter}", f"{SUBNET}.{i + 1}", f"{tag}-host-{letter}")
        for i, letter in enumerate("abcdefgh"[:count])
    )
    created: list[str] = []
    try:
        for namespace in (switch, *(host.namespace for host in hosts)):
            step = _ip("netns", "add", namespace)
            if step.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {step.stderr.strip()}")
            created.append(namespace)
        steps = [
            ("-n", switch, "link", "add", "br0", "type", "bridge"),
            ("-n", switch, "link", "set", "br0", "up"),
        ]
        for host in hosts:
            device, port = _device(host), _port(host)
            steps += [
                ("link", "add", device, "type", "veth", "peer", "name", port),
                ("link", "set", device, "netns", host.namespace),
                ("link", "set", port, "netns", switch),
                ("-n", switch, "link", "set", port, "master", "br0"),
                ("-n", switch, "link", "set", port, "up"),
                ("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", device),
                ("-n", host.namespace, "link", "set", device, "up"),
                ("-n", host.namespace, "link", "set", "lo", "up"),
            ]
        for args in steps:
            step = _ip(*args)
            if step.returncode != 0:
                pytest.skip(f"cannot set up the bridged links (ip {' '.join(args)}): {step.stderr}")
        yield hosts
    finally:
        for namespace in created:  # deleting a namespace deletes its ends of the veth pairs
            _ip("netns", "delete", namespace)


@pytest.fixture
def hosts() -> Iterator[tuple[Host, ...]]:
    """Two hosts on the bridge."""
    with emulated_hosts(2) as made:
        yield made


@pytest.fixture
def three_hosts() -> Iterator[tuple[Host, ...]]:
    """Three hosts on the bridge."""
    with emulated_hosts(3) as made:
        yield made


def test_gloo_across_two_hosts(hosts: tuple[Host, ...]) -> None:
    url = f"tcp://{hosts[0].address}:{PORT}"
    commands = [
        host.command(worker("basic", "--init-method", url, "--rank", str(r), "--world-size", "2"))
        for r, host in enumerate(hosts)
    ]
    results = results_of(run_ranks(commands))
    check_basic(results)
    if shutil.which("unshare"):  # distinct hostnames: each rank is alone on its node
        assert [result["local"] for result in results] == [[0, 1], [0, 1]]


def test_mpi_across_two_hosts(hosts: tuple[Host, ...], tmp_path: Path) -> None:
    """MPI too: mpiexec runs on host a; Hydra starts host b's proxy through a launcher script."""
    before = received(hosts[1])
    results = mpi_job(hosts, tmp_path, "basic", {})
    check_basic(results, backend="mpi")
    assert [result["local"] for result in results] == [[0, 1], [0, 1]]
    # The basic scenario's 4 MiB allreduce went through the veth link (a ring moves half of it
    # each way at 2 ranks); Hydra's own traffic is a few KiB.
    assert received(hosts[1]) - before >= 2 * 2**20, "MPI's data did not cross the link"


def test_mpi_training_across_two_hosts_tests_the_threads_calls_with_pauses(
    hosts: tuple[Host, ...], tmp_path: Path
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
    hosts: tuple[Host, ...], tmp_path: Path, scenario: str, extra: dict[str, str]
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
    path = f"/sys/class/net/{_device(host)}/statistics/rx_bytes"
    done = subprocess.run(
        ["ip", "netns", "exec", host.namespace, "cat", path],
        capture_output=True, text=True, timeout=SETUP_TIMEOUT, check=True,
    )  # fmt: skip
    return int(done.stdout)


# -- dataparallel run -H: ranks on other hosts over ssh ---------------------------------------


@dataclass(frozen=True)
class Ssh:
    """What a job needs to reach the hosts' sshd: the options, and a PATH whose ssh knows no
    host keys (none is written to this machine's known_hosts)."""

    options: list[str]
    env: dict[str, str]
    mpi_env: dict[str, str]  # mpiexec's own ssh takes no options: its PATH's ssh adds them


@pytest.fixture
def ssh(hosts: tuple[Host, ...], tmp_path: Path) -> Iterator[Ssh]:
    """An sshd in each of the two hosts."""
    with sshd_in(hosts, tmp_path) as reach:
        yield reach


@pytest.fixture
def ssh3(three_hosts: tuple[Host, ...], tmp_path: Path) -> Iterator[Ssh]:
    """An sshd in each of the three hosts."""
    with sshd_in(three_hosts, tmp_path) as reach:
        yield reach


@contextlib.contextmanager
def sshd_in(hosts: tuple[Host, ...], tmp_path: Path) -> Iterator[Ssh]:
    """Start an sshd in each host, for root with a key made here; stop them afterwards."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(sshd) or shutil.which("ssh-keygen") is None:
        pytest.skip("sshd is not installed: apt-get install -y openssh-server")
    if shutil.which("unshare") is None:
        pytest.skip("`unshare` is missing: the hosts need hostnames of their own")
    keys = tmp_path / "keys"
    keys.mkdir()
    for name in ("client", "host"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)],
            check=True, timeout=SETUP_TIMEOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    shutil.copy(keys / "client.pub", keys / "authorized_keys")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation folder
    daemons = []
    try:
        for host in hosts:
            config = tmp_path / f"sshd-{host.namespace}.conf"
            config.write_text(
                f"Port {SSH_PORT}\nListenAddress {host.address}\nHostKey {keys / 'host'}\n"
                f"AuthorizedKeysFile {keys / 'authorized_keys'}\nPidFile none\n"
                "StrictModes no\nUsePAM no\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
                "LogLevel INFO\n"
            )
            daemon = subprocess.Popen(
                host.command([sshd, "-D", "-e", "-f", str(config)]),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True, start_new_session=True,
            )  # fmt: skip
            daemons.append((daemon, _wait_listening(daemon, host)))
        options = ["-p", str(SSH_PORT), "-i", str(keys / "client")]
        paths = []
        mpi = [*options, "-o", "StrictHostKeyChecking=no", "-o", "BatchMode=yes"]
        mpi += ["-o", "ServerAliveInterval=1", "-o", "ServerAliveCountMax=2"]  # as docs say
        for name, extra in (("bin", []), ("mpi-bin", mpi)):
            folder = tmp_path / name  # an ssh that neither reads nor writes known_hosts
            folder.mkdir()
            wrapper = folder / "ssh"
            wrapper.write_text(
                f"#!/bin/sh\nexec {shutil.which('ssh')} -o UserKnownHostsFile=/dev/null "
                f'-o LogLevel=ERROR {" ".join(extra)} "$@"\n'
            )
            wrapper.chmod(0o755)
            paths.append({"PATH": f"{folder}:{os.environ['PATH']}"})
        yield Ssh(options, *paths)
    finally:
        for daemon, reader in daemons:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
            reader.join(timeout=SETUP_TIMEOUT)
            assert daemon.stderr is not None
            daemon.stderr.close()


def _wait_listening(daemon: subprocess.Popen[str], host: Host) -> threading.Thread:
    """Wait until `daemon` says it listens (a condition: its own line), or skip with its words;
    return the thread that reads what it says."""
    said: list[str] = []
    listening = threading.Event()

    def read() -> None:
        assert daemon.stderr is not None
        for line in daemon.stderr:  # read to the end: sshd logs every connection
            said.append(line)
            if "Server listening on" in line:
                listening.set()
        listening.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    listening.wait(timeout=SETUP_TIMEOUT)
    if daemon.poll() is not None or not any("Server listening" in line for line in said):
        pytest.skip(f"sshd would not start in {host.namespace}: {''.join(said)[-500:]}")
    return reader


def hosts_job(
    hosts: tuple[Host, ...],
    ssh: Ssh,
    mode: str,
    *options: str,
    spec: str | None = None,
    backend: str = "gloo",
) -> list[str]:
    """Return the command line of `dataparallel run -H a:2,b:2 ... hosts_job.py MODE` (or
    `-H SPEC`), run in host a (so a's ranks start there, the other hosts' over ssh)."""
    a = hosts[0]
    spec = spec or ",".join(f"{host.address}:2" for host in hosts)
    run = [sys.executable, "-m", "dataparallel", "run", "-H", spec, "--backend", backend]
    script = str(SCRIPTS / "hosts_job.py")
    ssh_options = ssh.options if backend == "gloo" else []
    return a.command([*run, *ssh_options, *options, script, mode])


def leftovers(hosts: tuple[Host, ...], script: str = "hosts_job.py") -> list[int]:
    """Return the pids of `script`'s processes still running in one of `hosts` (its namespace:
    not another test's, test_hosts' say, running on this machine at the same time)."""
    ours = {os.stat(f"/run/netns/{host.namespace}").st_ino for host in hosts}
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/cmdline", "rb") as file:
                    words = file.read().split(b"\0")
                mine = os.stat(f"/proc/{entry}/ns/net").st_ino in ours
                if mine and any(word.endswith(script.encode()) for word in words):
                    found.append(int(entry))
    return found


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_run_hosts_starts_two_ranks_on_each_host_over_ssh(
    hosts: tuple[Host, ...], ssh: Ssh, backend: str
) -> None:
    b = hosts[1]
    before = received(b)
    env = {**ssh.env, "HOSTS_JOB_MARK": "sent along"}
    if backend == "mpi":  # mpiexec's own ssh; MPI's data through the link, not shared memory
        pytest.importorskip("mpi4py")
        require_mpiexec()
        env.update(ssh.mpi_env, UCX_TLS="tcp,self", MASTER_ADDR=hosts[0].address)
    job = hosts_job(hosts, ssh, "allreduce", backend=backend)
    done = run_job(job, launcher=None, env=env, cwd=SCRIPTS)
    assert done.returncode == 0, done.stdout + done.stderr
    results = {}
    for line in done.stdout.splitlines():  # every line prefixed with its rank and host
        found = re.fullmatch(r"\[rank (\d) on ([\d.]+)\] RESULT (.*)", line)
        assert found is not None, line
        result = json.loads(found[3])
        assert found[2] == hosts[int(found[1]) // 2].address, line
        assert result["rank"] == int(found[1]), line
        results[result["rank"]] = result
    assert sorted(results) == [0, 1, 2, 3], done.stdout
    for rank, result in results.items():
        assert result["hostname"] == hosts[rank // 2].hostname, result
        assert result["size"] == 4
        assert result["local"] == [rank % 2, 2]
        assert result["cwd"] == str(SCRIPTS)
        assert result["forwarded"] == "sent along"  # the environment goes along
    # Every rank's 4 MiB crossed the link between the hosts in the allreduce.
    assert received(b) - before >= 2**20, "the ranks' data did not cross the link"


def test_run_hosts_a_rank_failing_on_the_other_host_ends_the_job(
    hosts: tuple[Host, ...], ssh: Ssh
) -> None:
    b = hosts[1]
    done = run_job(hosts_job(hosts, ssh, "fail"), launcher=None, env=ssh.env, cwd=SCRIPTS)
    assert done.returncode == 1, done.stdout + done.stderr
    err = done.stderr
    prefix = f"[rank 3 on {b.address}] "
    assert err.count("Traceback (most recent call last):") == 1, err
    assert f"{prefix}Traceback (most recent call last):" in err, err
    assert f"{prefix}RuntimeError: rank 3 fails on purpose on {b.hostname}" in err, err
    assert f"rank 3 on {b.address} exited with status 1; stopping the other 3 rank(s)" in err
    assert leftovers(hosts) == [], "ranks outlived the job (rank 2 runs on the other host)"


def test_run_hosts_ctrl_c_reaches_the_ranks_of_the_other_host(
    hosts: tuple[Host, ...], ssh: Ssh
) -> None:
    b = hosts[1]
    with spawn(
        hosts_job(hosts, ssh, "sleep"), launcher=None, env=ssh.env, cwd=SCRIPTS, capture=True
    ) as job:
        assert job.stdout is not None
        ready = 0
        for line in job.stdout:  # a condition: every rank has said it waits
            ready += line.endswith("] ready\n")
            if ready == 4:
                break
        assert ready == 4, "the ranks did not all start"
        os.killpg(job.pid, signal.SIGINT)  # the terminal's Ctrl-C: the launcher's group
        _, stderr = job.communicate(timeout=60)
    assert job.returncode == 130, stderr
    for rank in (2, 3):
        assert f"[rank {rank} on {b.address}] KeyboardInterrupt" in stderr, stderr
    assert leftovers(hosts) == []


def test_run_hosts_timeout_reaches_the_ranks_of_the_other_host(
    hosts: tuple[Host, ...], ssh: Ssh
) -> None:
    done = run_job(  # --timeout: long enough for every rank to start, on a busy machine too
        hosts_job(hosts, ssh, "sleep", "--timeout", "5"),
        launcher=None,
        env=ssh.env,
        cwd=SCRIPTS,
    )
    assert done.returncode == 124, done.stderr
    assert done.stdout.count("] ready") == 4, done.stdout  # it had started on both hosts
    assert leftovers(hosts) == []


def test_run_hosts_a_host_that_cannot_be_reached_fails_at_once_named(
    hosts: tuple[Host, ...], ssh: Ssh
) -> None:
    a = hosts[0]
    nobody = f"{SUBNET}.3"  # no host has it: nothing answers there
    # ... and a route in host a says so at once, as a router would, instead of the 3 s of
    # unanswered ARP requests after which the kernel says the same (EHOSTUNREACH).
    unreachable = _ip("-n", a.namespace, "route", "add", "unreachable", f"{nobody}/32")
    assert unreachable.returncode == 0, unreachable.stderr
    spec = f"{a.address}:1,{nobody}:1"
    done = run_job(
        hosts_job(hosts, ssh, "sleep", spec=spec), launcher=None, env=ssh.env, cwd=SCRIPTS
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"cannot start ranks on host {nobody!r}: ssh failed with status 255" in done.stderr
    assert "ready" not in done.stdout, "a rank started before the hosts were checked"


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_run_three_hosts_on_a_bridge_then_a_host_cut_off_ends_the_job(
    three_hosts: tuple[Host, ...], ssh3: Ssh, backend: str
) -> None:
    """`-H a:1,b:1,c:1`: a rank on each of three hosts behind one bridge, the allreduce's data
    through b's and c's links. Then rank 2 (host c) stalls, ranks 0 and 1 wait for it in a
    barrier, and c's link goes down: nothing closes, yet the whole job ends, host c named, long
    before `--timeout` (status 255), and rank 2, hearing nothing from the launcher, leaves host c
    by itself. Under Gloo the launcher's ssh to c gives up after `--link-timeout`; under MPI
    neither mpiexec (its ssh to c gives up too, and it goes on) nor MPI notices, and the job
    waited for `--timeout`: the launcher's own line to each rank (`launch/beacon.py`) ends it."""
    a, b, c = three_hosts
    env = dict(ssh3.env)
    options = ["--timeout", "150", "--link-timeout", "1"]
    if backend == "mpi":
        pytest.importorskip("mpi4py")
        require_mpiexec()
        env.update(ssh3.mpi_env, UCX_TLS="tcp,self", MASTER_ADDR=a.address)
    spec = ",".join(f"{host.address}:1" for host in three_hosts)
    job = hosts_job(three_hosts, ssh3, "allreduce-then-wait", *options, spec=spec, backend=backend)
    before = {host: received(host) for host in (b, c)}
    try:
        with spawn(job, launcher=None, env=env, cwd=SCRIPTS, capture=True) as run:
            assert run.stdout is not None
            lines = []
            for line in run.stdout:  # until every rank waits (mpiexec may merge their lines)
                lines.append(line)
                if sum(x.count("] waits") + x.count("] stalls") for x in lines) == 3:
                    break
            crossed = {host: received(host) - before[host] for host in (b, c)}
            cut = time.monotonic()
            down = _ip("-n", c.namespace, "link", "set", _device(c), "down")
            assert down.returncode == 0, down.stderr
            rest, err = run.communicate(timeout=200)
            took = time.monotonic() - cut
        # The rank on c hears nothing from the launcher for its silence limit, and leaves.
        _wait_for(lambda: not leftovers((c,)), 30)
        stayed = leftovers((c,))
    finally:
        _kill_everything_in(c)  # sshd's session there waits on a client it cannot reach
    out = "".join(lines) + rest
    assert run.returncode == 255, f"{run.returncode} after {took:.1f} s\n{out}\n{err}"
    assert took < 60, f"the job ended {took:.1f} s after the cut, not by the link timeout"
    results = {}
    for found in re.finditer(r"\[rank (\d) on ([\d.]+)\] RESULT (.*)", out):
        result = json.loads(found[3])
        assert found[2] == three_hosts[int(found[1])].address, found[0]
        results[result["rank"]] = result
    assert sorted(results) == [0, 1, 2], out
    for rank, result in results.items():
        assert result["hostname"] == three_hosts[rank].hostname, result
        assert (result["size"], result["local"]) == (3, [0, 1]), result
    for host, count in crossed.items():  # a ring moves 2/3 of the 4 MiB into every rank
        assert count >= 2**20, f"the ranks' data did not cross {host.hostname}'s link"
    if backend == "gloo":
        said = f"rank 2 on {c.address} exited with status 255 (ssh's own failure, or the "
        assert said in err and "the host or its link may be gone); stopping the other" in err
    else:
        said = f"rank 2 on {c.hostname} ({c.address}) has not been heard for "
        assert said in err and "the host or its link is gone; stopping the job" in err, err
    assert stayed == [], "the rank on the cut host stayed in its collective"
    print(f"the job ended {took:.1f} s after the cut")
    _wait_for(lambda: not leftovers(three_hosts[:2]), 30)  # under MPI: their proxies end them
    assert leftovers(three_hosts[:2]) == [], "ranks outlived the job"


def _split_while_ranks_wait(
    job: list[str],
    env: dict[str, str],
    go: Path,
    ranks: int,
    hosts: tuple[Host, ...],
    cut: tuple[Host, Host],
) -> tuple[int, float, str, str, list[int]]:
    """Run `hosts_job.py allreduce-then-pause` until its `ranks` ranks wait or pause, then cut
    `cut[0]`'s route to `cut[1]` (a split: the launcher still reaches both), let the paused rank
    go on, and wait for the job's end: its status, the seconds from the cut to the end, its
    output and errors, and the ranks left on any host once the job ended."""
    here, there = cut
    try:
        with spawn(job, launcher=None, env=env, cwd=SCRIPTS, capture=True) as run:
            assert run.stdout is not None
            lines = []
            for line in run.stdout:  # until one rank pauses and the others wait in the allreduce
                lines.append(line)
                if sum(x.count("] waits") + x.count("] pauses") for x in lines) == ranks:
                    break
            split = _ip("-n", here.namespace, "route", "add", "prohibit", f"{there.address}/32")
            assert split.returncode == 0, split.stderr
            cut_at = time.monotonic()
            go.touch()
            rest, err = run.communicate(timeout=200)
            took = time.monotonic() - cut_at
        _wait_for(lambda: not leftovers(hosts), 30)
        stayed = leftovers(hosts)
    finally:
        for host in cut:
            _kill_everything_in(host)
    return run.returncode, took, "".join(lines) + rest, err, stayed


def test_run_three_hosts_split_ends_the_job_naming_the_hosts_cut_off(
    three_hosts: tuple[Host, ...], ssh3: Ssh, tmp_path: Path
) -> None:
    """`-H a:1,b:1,c:1` under Gloo, the launcher on a. After an allreduce, rank 2 (host c)
    pauses while ranks 0 and 1 wait for it in a second one; then c stops reaching b (`ip route
    add prohibit`, in c alone) while a still reaches both: a split. The launcher's lines to b
    and c beat on; only the ranks' own connection between b and c is dead. Rank 2 goes on into
    the allreduce, and the job ends, long before `--timeout` and Gloo's own timeout: TCP
    keep-alive on the ranks' connections (`backends/connections.py`) fails the one between b
    and c within the link timeout, the rank whose call waited on it raises `LinkLostError`
    naming the other host, and the launcher names the rank and its host."""
    _, b, c = three_hosts
    go = tmp_path / "go"
    spec = ",".join(f"{host.address}:1" for host in three_hosts)
    options = ["--timeout", "150", "--link-timeout", "1"]
    job = [*hosts_job(three_hosts, ssh3, "allreduce-then-pause", *options, spec=spec), str(go)]
    returncode, took, out, err, stayed = _split_while_ranks_wait(
        job, ssh3.env, go, 3, three_hosts, cut=(c, b)
    )
    assert returncode == 1, f"{returncode} after {took:.1f} s\n{out}\n{err}"
    assert took < 60, f"the job ended {took:.1f} s after the split, not by the link timeout"
    assert "allreduced again" not in out, out
    said = re.findall(r"\[rank \d on ([\d.]+)\] .*lost its link to ([\d.]+): that host", err)
    assert said, err  # a rank on one side names the other
    assert all({here, there} == {b.address, c.address} for here, there in said), err
    ended = re.search(r"rank (\d) on ([\d.]+) exited with status 1; stopping the other", err)
    assert ended is not None and ended[2] in (b.address, c.address), err
    assert stayed == [], "ranks outlived the job"
    print(f"the job ended {took:.1f} s after the split")


def test_run_mpi_split_between_the_ranks_hosts_ends_the_job_naming_both(
    three_hosts: tuple[Host, ...], ssh3: Ssh, tmp_path: Path
) -> None:
    """`-H a:1,b:1 --backend mpi`, the launcher on a third host, c. After an allreduce, rank 1
    (host b) pauses while rank 0 waits for it in a second one; then b stops reaching a (`ip
    route add prohibit`, in b alone) while c reaches both: a split. The launcher's lines to a
    and b beat on, mpiexec's ssh to both stays up, and the ranks wait inside MPI, in C, on
    connections that will never deliver: the job waited for `--timeout`. Each rank's watch of
    its connections to other hosts (`connections.watch_every`) finds the one between a and b
    silent for the link timeout and says so on its line to the launcher, which names the rank
    and both hosts and ends the job (status 1), long before `--timeout`."""
    pytest.importorskip("mpi4py")
    require_mpiexec()
    a, b, c = three_hosts
    go = tmp_path / "go"
    env = {**ssh3.env, **ssh3.mpi_env, "UCX_TLS": "tcp,self", "MASTER_ADDR": a.address}
    spec = f"{a.address}:1,{b.address}:1"
    run = [sys.executable, "-m", "dataparallel", "run", "-H", spec, "--backend", "mpi"]
    run += ["--timeout", "150", "--link-timeout", "1"]
    # Hydra's proxies call mpiexec back at its host's name, which resolves nowhere here when
    # that host is not among -H's (on a, the listed address is taken): c is named by its address.
    launcher = dataclasses.replace(c, hostname=c.address)
    job = launcher.command([*run, str(SCRIPTS / "hosts_job.py"), "allreduce-then-pause", str(go)])
    returncode, took, out, err, stayed = _split_while_ranks_wait(
        job, env, go, 2, three_hosts, cut=(b, a)
    )
    assert returncode == 1, f"{returncode} after {took:.1f} s\n{out}\n{err}"
    assert took < 60, f"the job ended {took:.1f} s after the split, not by the link timeout"
    assert "allreduced again" not in out, out
    said = re.search(
        r"rank (\d) on (\S+) \(([\d.]+)\) lost its link to ([\d.]+) \(rank (\d) on (\S+)\): "
        r"that host has not answered the rank for 1 s \(--link-timeout\), though the launcher "
        r"still hears both\. .*\(a split; .*; stopping the job\.",
        err,
    )
    assert said is not None, err
    here, there = three_hosts[int(said[1])], three_hosts[int(said[5])]
    assert {here, there} == {a, b}, said[0]
    assert (said[2], said[3], said[4], said[6]) == (
        here.hostname, here.address, there.address, there.hostname
    ), said[0]  # fmt: skip
    assert stayed == [], "ranks outlived the job"
    print(f"the job ended {took:.1f} s after the split: {said[0]}")


# --- elastic across hosts: workers started over ssh, a host lost, a host set aside and back ---


def elastic_hosts_job(
    hosts: tuple[Host, ...],
    ssh: Ssh,
    out: Path,
    options: list[str],
    args: list[str],
    spec: str | None = None,
) -> list[str]:
    """`dataparallel run -H a:2,b:2 --min-np 2 ... elastic_train.py ARGS` (or `-H SPEC`), run in
    host a: its workers w0 and w1 start there, w2 and w3 over ssh on b."""
    from test_elastic_runs import SAMPLES, TRAIN

    a = hosts[0]
    spec = spec or ",".join(f"{host.address}:2" for host in hosts)
    run = [sys.executable, "-m", "dataparallel", "run", "-H", spec]
    run += ["--backend", "gloo", "--min-np", "2", "--timeout", "240", *ssh.options, *options]
    train = [str(TRAIN), "--samples", str(SAMPLES), "--out", str(out), *args]
    return a.command([*run, *train])


def test_elastic_run_loses_a_whole_host_and_goes_on(
    hosts: tuple[Host, ...], ssh: Ssh, tmp_path: Path
) -> None:
    """Both workers of host b die in the same step (SIGKILL, seen through their ssh as 137):
    the host is dropped, the two of host a re-form and finish, every sample once an epoch and
    the weights the replay's."""
    from test_elastic_runs import check_run

    b = hosts[1]
    job = elastic_hosts_job(
        hosts, ssh, tmp_path / "out.json", [], ["--die", "w2:3", "--die", "w3:3"]
    )
    done = run_job(job, launcher=None, env=ssh.env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"worker 2 on {b.address} was lost (SIGKILL)" in done.stderr, done.stderr
    assert f"worker 3 on {b.address} was lost (SIGKILL)" in done.stderr, done.stderr
    assert f"host {b.address} has no worker left" in done.stderr, done.stderr
    assert f"[worker 3 on {b.address}] " in done.stdout + done.stderr  # lines name the host
    check_run(tmp_path, [4, 2])
    assert leftovers(hosts, "elastic_train.py") == []


def test_elastic_host_set_aside_for_a_cool_down_then_joins_again(
    hosts: tuple[Host, ...], ssh: Ssh, tmp_path: Path
) -> None:
    """Worker 3 dies on host b: with a cool-down the host is set aside (no worker starts there)
    for 1 s, then its slots count again and a new worker starts on b and joins: 4 -> 3 -> 4.
    Rank 0, after its 3rd commit (in the world of three), waits for that round to open."""
    from test_elastic_runs import check_run

    b = hosts[1]
    options = ["--blacklist-cooldown-range", "1", "1"]
    args = ["--die", "w3:2", "--slots", f"{tmp_path / 'unused'}:3:-"]
    job = elastic_hosts_job(hosts, ssh, tmp_path / "out.json", options, args)
    done = run_job(job, launcher=None, env=ssh.env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"worker 3 on {b.address} was lost (SIGKILL)" in done.stderr, done.stderr
    assert f"host {b.address} is set aside for 1.0 s" in done.stderr, done.stderr
    assert f"host {b.address}'s cool-down ended" in done.stderr, done.stderr
    check_run(tmp_path, [4, 3, 4])
    assert leftovers(hosts, "elastic_train.py") == []


def test_elastic_run_drops_a_host_whose_link_goes_down_while_ranks_wait_on_it(
    hosts: tuple[Host, ...], ssh: Ssh, tmp_path: Path
) -> None:
    """Worker 2 (host b) stops in the middle of a step after its 3rd commit, so that the others
    wait on it in the step's collective; then host b's end of the link goes down. Nothing
    closes: the launcher learns it from b's workers' heartbeats, which stop (`--link-timeout`),
    and the workers of host a from the round without b's workers, which marks them lost by
    their link (they cut their connections to b, and their collectives fail as if b's workers
    had died).
    The two of host a re-form and finish, every sample once an epoch and the weights the
    replay's, long before Gloo's own timeout (630 s here); b's workers, cut off from the
    launcher's store, leave by themselves."""
    from test_elastic_runs import check_run

    b = hosts[1]
    stalled = tmp_path / "stalled"
    options = ["--link-timeout", "2", "--timeout", "150"]
    args = ["--stall", f"w2:3:{stalled}"]
    job = elastic_hosts_job(hosts, ssh, tmp_path / "out.json", options, args)
    try:
        status, out, err = _cut_once(job, ssh.env, tmp_path, stalled, b, "worker 2 never stalled")
        assert status == 0, out + err
        for worker in (2, 3):
            lost = f"worker {worker} on {b.address} was lost (no heartbeat for"
            assert lost in err, err
        assert f"host {b.address} has no worker left" in err, err
        check_run(tmp_path, [4, 2])
        # b's workers, unreachable, leave once the launcher's store has been silent for their
        # silence limit (`config.silence_limit`).
        _wait_for(lambda: not leftovers(hosts, "elastic_train.py"), 60)
        assert leftovers(hosts, "elastic_train.py") == [], "b's workers stayed, cut off"
    finally:
        _kill_everything_in(b)  # sshd's sessions there wait on a client they cannot reach


def test_elastic_three_hosts_lose_one_by_a_death_then_its_link_while_a_round_forms(
    three_hosts: tuple[Host, ...], ssh3: Ssh, tmp_path: Path
) -> None:
    """`-H a:1,b:1,c:2 --min-np 2`: w0 on a, w1 on b, w2 and w3 on c. Worker 2 dies (SIGKILL)
    after its 3rd commit; round 1 opens with w0, w1, w3, and w3 stops before arriving there
    (its watch still beating), so w0 and w1 wait for it in a forming round. Then c's link goes
    down: the launcher hears no heartbeat from w3 for `--link-timeout` and opens round 2
    without it; the round that could not form is given up, and w0 and w1 (hosts a and b)
    form round 2 and finish, every sample once an epoch and the weights the replay's. w3, cut
    off from the store, leaves by itself."""
    from test_elastic_runs import check_run

    a, b, c = three_hosts
    stalled = tmp_path / "stalled"
    spec = f"{a.address}:1,{b.address}:1,{c.address}:2"
    options = ["--link-timeout", "2", "--timeout", "150"]
    args = ["--die", "w2:3", "--stall-forming", f"w3:1:{stalled}"]
    job = elastic_hosts_job(three_hosts, ssh3, tmp_path / "out.json", options, args, spec)
    try:
        never = "worker 3 never reached round 1"
        status, out, err = _cut_once(job, ssh3.env, tmp_path, stalled, c, never)
        assert status == 0, out + err
        assert f"worker 2 on {c.address} was lost (SIGKILL)" in err, err
        assert f"worker 3 on {c.address} was lost (no heartbeat for" in err, err
        assert f"host {c.address} has no worker left" in err, err
        assert f"host {b.address} has no worker left" not in err, err
        check_run(tmp_path, [4, 2])
        _wait_for(lambda: not leftovers(three_hosts, "elastic_train.py"), 60)
        assert leftovers(three_hosts, "elastic_train.py") == []
    finally:
        _kill_everything_in(c)


def test_elastic_split_drops_the_later_host_and_the_others_go_on(
    three_hosts: tuple[Host, ...], ssh3: Ssh, tmp_path: Path
) -> None:
    """`-H a:1,b:1,c:1 --min-np 2`: w0 on a, w1 on b, w2 on c. Worker 2 pauses in the middle of
    a step after its 3rd commit, the others waiting on it in the step's collective; then c
    stops reaching b (`ip route add prohibit`, in c alone), while the launcher on a reaches
    both, and worker 2 goes on. No worker dies and every heartbeat goes on: the workers whose
    connection between b and c failed (TCP keep-alive, `LinkLostError`) report it
    (`rounds.report_split`), and the launcher drops one side: of b and c, one worker each, c,
    whose worker joined later. w0 and w1 re-form and finish, every sample once an epoch and
    the weights the replay's."""
    _split_c_from_b_and_go_on(three_hosts, ssh3, tmp_path, "--pause", 3, "worker 2 never paused")


def test_elastic_split_inside_a_jitted_jax_step(
    three_hosts: tuple[Host, ...], ssh3: Ssh, tmp_path: Path
) -> None:
    """The split above, in a jitted optax step (`elastic_jax.py`, the FFI route): w0 and w1
    wait on worker 2 inside the step's reduction, within XLA, when c stops reaching b. JAX
    raises its own `JaxRuntimeError`, with the `LinkLostError`'s text only; the workers still
    report the split with the peer's address (`library_error`), or the launcher would wait for
    the run's timeout. c is dropped; w0 and w1 finish with one process's parameters."""
    pytest.importorskip("optax")
    sys.path.insert(0, str(SCRIPTS))
    from elastic_jax import replay

    a, b, c = three_hosts
    go, out = tmp_path / "go", tmp_path / "out.json"
    spec = f"{a.address}:1,{b.address}:1,{c.address}:1"
    run = [sys.executable, "-m", "dataparallel", "run", "-H", spec, "--backend", "gloo"]
    run += ["--min-np", "2", *ssh3.options, "--link-timeout", "1", "--timeout", "150"]
    train = [str(SCRIPTS / "elastic_jax.py"), "--out", str(out), "--route", "ffi"]
    job = a.command([*run, *train, "--pause", f"w2:3:{go}"])
    paused = Path(f"{go}.paused")

    def split() -> None:
        done = _ip("-n", c.namespace, "route", "add", "prohibit", f"{b.address}/32")
        assert done.returncode == 0, done.stderr
        go.touch()

    env = {**ssh3.env, "JAX_PLATFORMS": "cpu"}
    try:
        status, stdout, err = _cut_once(
            job, env, tmp_path, paused, c, "worker 2 never paused", cut=split
        )
        assert status == 0, stdout + err
        said = f"worker 2 on {c.address} was lost (its host and {b.address} cannot reach each "
        assert said in err, err
        assert "was lost" not in err.replace(said, ""), err  # w0 and w1 stay
        result = json.loads(out.read_text())
        assert (result["size"], result["step"], result["same"]) == (2, 8, True)
        np.testing.assert_allclose(result["params"], replay(8), rtol=1e-6, atol=1e-7)
        _wait_for(lambda: not leftovers(three_hosts, "elastic_jax.py"), 60)
        assert leftovers(three_hosts, "elastic_jax.py") == []
    finally:
        _kill_everything_in(c)


@pytest.mark.parametrize("when", ["arriving", "grouping"])
def test_elastic_a_link_down_while_round_0_forms(
    three_hosts: tuple[Host, ...], ssh3: Ssh, tmp_path: Path, when: str
) -> None:
    """`-H a:1,b:1,c:1 --min-np 2`: worker 2 (host c) stops in round 0 before any world exists
    (so before any heartbeat): about to arrive (`arriving`), or once the round formed, about to
    make its Gloo group, where the others wait for its address (`grouping`). Then c's link
    goes down. The launcher's ssh to c gives up within the link timeout (status 255), worker 2
    is lost, and the round opened without it lets w0 and w1 give round 0 up and form round 1,
    the run's first world, and finish. (A stop inside the rank's runner: `PYTHONPATH` brings a
    `sitecustomize` that sets it before the runner joins round 0.)"""
    from test_elastic_runs import check_run

    a, b, c = three_hosts
    stalled = tmp_path / "stalled"
    hook = tmp_path / "hook"
    hook.mkdir()
    stop = "stall_forming" if when == "arriving" else "stall_grouping"
    (hook / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if os.environ.get('DATAPARALLEL_ELASTIC_WORKER') == 'w2':\n"
        f"    sys.path.insert(0, {str(SCRIPTS)!r})\n"
        f"    from elastic_train import {stop}\n"
        f"    {stop}(0, {str(stalled)!r})\n"
    )
    env = {**ssh3.env, "PYTHONPATH": str(hook)}
    spec = f"{a.address}:1,{b.address}:1,{c.address}:1"
    options = ["--link-timeout", "1", "--timeout", "150"]
    job = elastic_hosts_job(three_hosts, ssh3, tmp_path / "out.json", options, [], spec)
    try:
        status, out, err = _cut_once(job, env, tmp_path, stalled, c, "worker 2 never stopped")
        assert status == 0, out + err
        assert f"worker 2 on {c.address} was lost (" in err, err
        assert f"host {c.address} has no worker left" in err, err
        check_run(tmp_path, [2])
        _wait_for(lambda: not leftovers(three_hosts, "elastic_train.py"), 60)
        assert leftovers(three_hosts, "elastic_train.py") == []
    finally:
        _kill_everything_in(c)


def test_elastic_split_from_the_start_while_round_0_connects(
    three_hosts: tuple[Host, ...], ssh3: Ssh, tmp_path: Path
) -> None:
    """`-H a:1,b:1,c:1 --min-np 2`: w0 on a, w1 on b, w2 on c, and c cannot reach b from the
    start (`ip route add prohibit`, in c alone), while the launcher on a reaches both. Every
    member arrives in round 0 and reads the others' addresses; then Gloo connects them, and
    the pair of b and c cannot connect: w2's connect fails at once, w1 waits for w2's until the
    group's connect limit (`config.connect_limit`). A worker whose group did not connect tries
    each member's address (`forming.unreached`) and reports the one it cannot reach as a split;
    the launcher drops c (its worker joined later), and w0 and w1 form round 1, the run's first
    world, and finish, every sample once an epoch and the weights the replay's. Before, nothing
    reported it: no round opened, and the workers ended with `NoWorldError`."""
    from test_elastic_runs import check_run

    a, b, c = three_hosts
    done = _ip("-n", c.namespace, "route", "add", "prohibit", f"{b.address}/32")
    assert done.returncode == 0, done.stderr
    spec = f"{a.address}:1,{b.address}:1,{c.address}:1"
    options = ["--link-timeout", "1", "--timeout", "150"]
    job = elastic_hosts_job(three_hosts, ssh3, tmp_path / "out.json", options, [], spec)
    try:
        ran = run_job(job, launcher=None, env=ssh3.env, cwd=tmp_path, timeout=200)
        err = ran.stderr
        assert ran.returncode == 0, ran.stdout + err
        said = f"worker 2 on {c.address} was lost (its host and {b.address} cannot reach each "
        assert said in err, err
        assert f"host {c.address} has no worker left" in err, err
        assert "was lost" not in err.replace(said, ""), err  # w0 and w1 stay
        check_run(tmp_path, [2])
        _wait_for(lambda: not leftovers(three_hosts, "elastic_train.py"), 60)
        assert leftovers(three_hosts, "elastic_train.py") == []
    finally:
        _kill_everything_in(c)


def _cut_once(
    job: list[str],
    env: dict[str, str],
    cwd: Path,
    ready: Path,
    host: Host,
    never: str,
    cut: Any = None,
) -> tuple[int, str, str]:
    """Run `job`; once the file `ready` exists (the job's sign that the moment has come), take
    `host`'s link down (or call `cut()`); return the job's status and what it printed (stdout,
    stderr). Fails with `never` if the job ends before `ready` appears, and if it does not end
    after the cut."""
    said: dict[str, str] = {}
    with spawn(job, launcher=None, env=env, cwd=cwd, capture=True) as run:

        def read() -> None:
            said["stdout"], said["stderr"] = run.communicate()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        _wait_for(lambda: ready.exists() or run.poll() is not None, 120)
        assert ready.exists(), never
        if cut is not None:
            cut()
        else:
            down = _ip("-n", host.namespace, "link", "set", _device(host), "down")
            assert down.returncode == 0, down.stderr
        reader.join(timeout=200)
        assert not reader.is_alive(), "the job did not end"
    return run.returncode, said["stdout"], said["stderr"]


def _device(host: Host) -> str:
    """`host`'s end of its veth pair to the bridge (named after the namespace)."""
    return f"{host.namespace[:-1]}v{host.namespace[-1]}"


def _port(host: Host) -> str:
    """The bridge's end of `host`'s veth pair."""
    return f"{host.namespace[:-1]}p{host.namespace[-1]}"


def _wait_for(condition: Any, seconds: float) -> None:
    """Poll `condition()` until it holds or `seconds` have passed (a guard, not a clock)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def _kill_everything_in(host: Host) -> None:
    """SIGKILL every process in `host`'s network namespace."""
    with contextlib.suppress(OSError):
        space = os.stat(f"/run/netns/{host.namespace}").st_ino
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if os.stat(f"/proc/{entry}/ns/net").st_ino == space:
                        os.kill(int(entry), signal.SIGKILL)


def test_elastic_split_while_a_group_over_the_world_connects(
    three_hosts: tuple[Host, ...], ssh3: Ssh, tmp_path: Path
) -> None:
    """`-H a:1,b:1,c:1 --min-np 2`: after 7 steps every worker makes a group of the world
    (`dp.new_group`); worker 2 (host c) stops as that group begins to form, the others waiting
    for its address, and c stops reaching b (`ip route add prohibit`, in c alone) while the
    launcher on a reaches both; then worker 2 goes on, and the pair of b and c cannot connect.
    The group connects within the round's connect limit as the round's own group does
    (`gloo.group.bound_connects`); a worker whose group did not connect reports each member it
    cannot reach as a split, the launcher drops c (its worker joined later), and w0 and w1
    re-form, make the group again and finish, every sample once an epoch and the weights the
    replay's. (A group whose connects had no limit would wait five times the group's timeout.)"""
    _split_c_from_b_and_go_on(
        three_hosts, ssh3, tmp_path, "--new-group", 7, "worker 2 never began the group"
    )


def _split_c_from_b_and_go_on(
    three_hosts: tuple[Host, ...], ssh3: Ssh, tmp_path: Path, stop: str, step: int, never: str
) -> None:
    """`-H a:1,b:1,c:1 --min-np 2` of `elastic_train.py`: worker 2 stops where `stop` says after
    commit `step`, then c stops reaching b while a reaches both, and worker 2 goes on. c must be
    dropped as a split (its worker joined later), w0 and w1 finish with every sample once an
    epoch and the replay's weights, and no worker is left on any host."""
    from test_elastic_runs import check_run

    a, b, c = three_hosts
    go = tmp_path / "go"
    spec = f"{a.address}:1,{b.address}:1,{c.address}:1"
    options = ["--link-timeout", "1", "--timeout", "150"]
    args = [stop, f"w2:{step}:{go}"]
    job = elastic_hosts_job(three_hosts, ssh3, tmp_path / "out.json", options, args, spec)
    paused = Path(f"{go}.paused")

    def split() -> None:
        done = _ip("-n", c.namespace, "route", "add", "prohibit", f"{b.address}/32")
        assert done.returncode == 0, done.stderr
        go.touch()

    try:
        status, out, err = _cut_once(job, ssh3.env, tmp_path, paused, c, never, cut=split)
        assert status == 0, out + err
        said = f"worker 2 on {c.address} was lost (its host and {b.address} cannot reach each "
        assert said in err, err
        assert f"host {c.address} has no worker left" in err, err
        assert "was lost" not in err.replace(said, ""), err  # w0 and w1 stay
        check_run(tmp_path, [3, 2])
        _wait_for(lambda: not leftovers(three_hosts, "elastic_train.py"), 60)
        assert leftovers(three_hosts, "elastic_train.py") == []
    finally:
        _kill_everything_in(c)
