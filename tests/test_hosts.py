"""Host lists, rank placement, and what a rank on another host is sent (`launch/hosts.py`).

The jobs across emulated hosts, with a real sshd, are in tests/test_multihost.py; here the
parts that need no other host: the formats, the placement, the environment and command line
sent over ssh (run by a real `sh`), and the runner's `--remote` line to the launcher.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _jobs import outer_world_size

from dataparallel.config import LINK_TIMEOUT_VARIABLE
from dataparallel.launch.hosts import (
    HostError,
    HostSlots,
    Slot,
    Ssh,
    forwarded,
    is_local,
    parse_hosts,
    place,
    read_hostfile,
    remote_command,
)
from dataparallel.launch.mpi import _hostfile_text

SCRIPTS = Path(__file__).parent / "scripts"

# No rank takes part (host lists, command lines, the beacon's own sockets): each rank of a
# multi-rank pass would check the same thing alone, the beacon's waits included.
pytestmark = pytest.mark.skipif(
    outer_world_size() > 1, reason="no rank takes part: runs in the world of one"
)


def test_parse_hosts_reads_horovods_h() -> None:
    assert parse_hosts("a:2, b:4,c") == [HostSlots("a", 2), HostSlots("b", 4), HostSlots("c", 1)]
    assert parse_hosts("10.0.0.1:3") == [HostSlots("10.0.0.1", 3)]
    assert parse_hosts("[fe80::1]:2") == [HostSlots("fe80::1", 2)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a:0", "'a:0' is not HOST, HOST:SLOTS or HOST slots=N with a positive"),
        ("a:x,b:2", "'a:x' is not HOST"),
        ("a:2,a:1", "names host 'a' twice"),
        (",", "names no host"),
    ],
)
def test_parse_hosts_rejects_bad_lists(text: str, message: str) -> None:
    with pytest.raises(HostError, match=message.replace("(", r"\(")) as error:
        parse_hosts(text)
    assert f"-H {text!r}" in str(error.value)


def test_read_hostfile_takes_both_formats_and_comments(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("# the cluster\nnode0 slots=4\n\nnode1:2  # the small one\nnode2\n")
    assert read_hostfile(str(path)) == [
        HostSlots("node0", 4),
        HostSlots("node1", 2),
        HostSlots("node2", 1),
    ]
    path.write_text("node0 slots=4\nnode1 slots=two\n")
    with pytest.raises(HostError, match=r"line 2: 'node1 slots=two' is not HOST"):
        read_hostfile(str(path))


def test_place_fills_each_host_in_order() -> None:
    hosts = [HostSlots("a", 2), HostSlots("b", 2)]
    assert place(hosts, 3) == [Slot(0, "a", 0, 2), Slot(1, "a", 1, 2), Slot(2, "b", 0, 1)]
    assert [slot.host for slot in place(hosts, 4)] == ["a", "a", "b", "b"]
    with pytest.raises(HostError, match=r"-n 5 ranks do not fit in the 4 slot\(s\) .*a:2, b:2"):
        place(hosts, 5)


def test_is_local_knows_this_machine_and_names_what_does_not_resolve() -> None:
    assert is_local("localhost") and is_local("127.0.0.1")
    assert not is_local("192.0.2.1")  # TEST-NET-1: never an address of this machine
    with pytest.raises(HostError, match=r"host 'no-such-host\.invalid' cannot be resolved"):
        is_local("no-such-host.invalid")


def test_one_answer_to_is_this_host_here_and_each_caller_says_what_unresolved_means() -> None:
    """`is_here` is the one test (the launcher's `is_local`, the MPI launcher's beacon, an
    elastic worker's watch all ask it); a name that resolves to nothing is an error for the
    launcher, another machine for the MPI launcher (mpiexec names it) and for the watch."""
    import socket

    from dataparallel.backends.rendezvous import is_here
    from dataparallel.elastic.liveness import _far
    from dataparallel.launch.mpi import _elsewhere

    assert is_here(socket.gethostname()) and is_here("localhost") and is_here("127.0.0.1")
    assert not is_here("192.0.2.1")
    with pytest.raises(OSError):
        is_here("no-such-host.invalid")
    assert not _far("127.0.0.1") and not _elsewhere("127.0.0.1")
    assert _far("192.0.2.1") and _elsewhere("192.0.2.1")
    assert _far("no-such-host.invalid") and _elsewhere("no-such-host.invalid")


def test_mpi_host_files_are_written_in_the_mpiexecs_format() -> None:
    hosts = [HostSlots("a", 2), HostSlots("b", 1)]
    assert _hostfile_text(hosts, "-f") == "a:2\nb:1\n"  # Hydra
    assert _hostfile_text(hosts, "--hostfile") == "a slots=2\nb slots=1\n"  # Open MPI


def test_the_environment_goes_along_less_this_machines() -> None:
    env = {
        "PATH": "/bin",
        "NCCL_DEBUG": "INFO",
        "OLDPWD": "/x",
        "PWD": "/y",
        "HOSTNAME": "here",
        "CUDA_VISIBLE_DEVICES": "0",
        "BASH_FUNC_f%%": "() { :; }",
        "SSH_CONNECTION": "1 2 3 4",
        "DATAPARALLEL_RUN_DIR": "/tmp/run",
        "DATAPARALLEL_PREFIXED": "1",
    }
    assert forwarded(env) == {"PATH": "/bin", "NCCL_DEBUG": "INFO", "DATAPARALLEL_PREFIXED": "1"}


def test_ssh_takes_horovodruns_port_and_identity() -> None:
    command = Ssh(port=2222, identity_file="/k").command("node1", "true")
    assert command[0] == "ssh" and command[-2:] == ["node1", "true"]
    assert command[command.index("-p") + 1] == "2222"
    assert command[command.index("-i") + 1] == "/k"
    assert "BatchMode=yes" in command  # never a password prompt
    assert "-p" not in Ssh().command("node1", "true")


def test_ssh_gives_up_on_a_host_silent_for_the_link_timeout() -> None:
    # ssh asks a silent host every second, and ends with 255 after that many unanswered asks:
    # the launcher learns that a host whose link went down is gone (docs/elastic.md).
    command = Ssh(link_timeout=3).command("node1", "true")
    assert "ServerAliveInterval=1" in command and "ServerAliveCountMax=3" in command
    assert not any("ServerAlive" in word for word in Ssh(link_timeout=None).command("n", "true"))
    # ssh counts whole asks: a fraction of a second is one (the heartbeats notice it sooner).
    assert "ServerAliveCountMax=1" in Ssh(link_timeout=0.5).command("node1", "true")


def test_the_remote_command_runs_in_the_directory_with_the_environment(tmp_path: Path) -> None:
    # What the other host's shell runs, run here by a real sh: quoting, directory, status.
    code = "import os, sys; print(os.getcwd(), os.environ['MARK'], sys.argv[1:])"
    argv = [sys.executable, "-c", code, "it's", "a b"]
    command = remote_command(str(tmp_path), {"MARK": "x 'y' $HOME"}, argv)
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{tmp_path} x 'y' $HOME {argv[3:]}\n"


def test_a_remote_rank_killed_by_a_signal_keeps_its_status(tmp_path: Path) -> None:
    # ssh would report 255 for a command killed by a signal: the shell turns it into 128 + N.
    argv = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]
    command = remote_command(str(tmp_path), {}, argv)
    done = subprocess.run(["sh", "-c", command], capture_output=True, check=False)
    assert done.returncode == 128 + signal.SIGTERM


def _remote_rank(
    script: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """Start the runner as a rank on another host would be: `--remote`, its stdin the line."""
    runner = [sys.executable, "-m", "dataparallel.launch.runner", "--remote"]
    # sshd starts a rank with SIGINT at its default; a test run in the background has it ignored,
    # which the child would keep. A handler of this process's own is reset to the default by
    # exec (a preexec_fn would fork through Python: JAX, if a test imported it, warns then).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(
            [*runner, str(SCRIPTS / script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "RANK": "0", "WORLD_SIZE": "1", **(env or {})},
            start_new_session=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)


def _end(rank: subprocess.Popen[str]) -> None:
    """Kill the rank's process group (its child too, which holds its pipes); close the pipes."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(rank.pid, signal.SIGKILL)
    rank.wait()
    for pipe in (rank.stdin, rank.stdout, rank.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return file.read().rpartition(b")")[2].split()[0] in (b"Z", b"X")
    except FileNotFoundError:
        return True


@pytest.mark.spawns
def test_the_remote_runner_raises_the_signal_the_launcher_writes(tmp_path: Path) -> None:
    rank = _remote_rank("hosts_job.py", "sleep")
    try:
        assert rank.stdout is not None and rank.stdin is not None
        assert rank.stdout.readline() == "ready\n"
        rank.stdin.write("INT\n")
        rank.stdin.flush()
        rank.wait(timeout=30)  # stdin stays open: its end would kill the rank
        assert rank.stderr is not None
        err = rank.stderr.read()
    finally:
        _end(rank)
    assert rank.returncode == 130, err
    assert err.endswith("[rank 0] KeyboardInterrupt\n"), err


@pytest.mark.spawns
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc to see the child")
@pytest.mark.parametrize("line", ["ends", "falls silent"])
def test_the_remote_runner_dies_with_its_children_when_its_line_ends(
    tmp_path: Path, line: str
) -> None:
    # "falls silent": the launcher beats on the line (`RemoteRank`), and a rank that hears
    # nothing for the link timeout is behind a link that went down, where no end comes.
    env = {LINK_TIMEOUT_VARIABLE: "0.5"} if line == "falls silent" else None
    rank = _remote_rank("hosts_child.py", str(tmp_path), env=env)
    try:
        assert rank.stdout is not None and rank.stdin is not None
        assert rank.stdout.readline() == "ready\n"
        child = int((tmp_path / "pids").read_text())
        if line == "ends":
            rank.stdin.close()  # the launcher, or the link to it, is gone
        else:  # a beat late by twice the link timeout (a busy machine's) does not end a rank
            time.sleep(1.0)
            assert rank.poll() is None, "a rank left while its launcher still beat"
            rank.stdin.write("\n")
            rank.stdin.flush()
        rank.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not _dead(child) and time.monotonic() < deadline:
            time.sleep(0.05)  # the kernel delivers the group's SIGKILL: wait for it to land
        assert rank.stderr is not None
        err = rank.stderr.read()
    finally:
        _end(rank)
    assert rank.returncode == -signal.SIGKILL, err
    assert _dead(child), "the rank's child outlived it"
    if line == "falls silent":
        assert "rank 0 on " in err and " has heard nothing from the launcher for " in err, err
    else:
        assert err == "", err


def test_discovery_lines_give_slots_by_host_in_order(tmp_path: Path) -> None:
    from dataparallel.launch.spawn import discover

    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\nprintf 'node1:2\\nlocalhost\\n\\nnode0:4\\nnode1:1\\n'\n")
    script.chmod(0o755)
    assert list(discover(str(script)).items()) == [("node1", 3), ("localhost", 1), ("node0", 4)]


def test_a_host_set_aside_again_cools_down_twice_as_long_within_the_limits() -> None:
    from dataparallel.launch.spawn import cooldown_seconds

    for times, (low, high) in enumerate([(2, 3), (4, 5), (8, 9), (16, 17)], 1):
        assert low <= cooldown_seconds((1.0, 100.0), times) <= high
    assert cooldown_seconds((1.0, 10.0), 5) == 10.0  # the upper limit holds
    assert cooldown_seconds((1.0, 1.0), 1) == 1.0
    assert cooldown_seconds((1.0, 10.0), 10**6) == 10.0  # no overflow however many times


def test_the_beacon_names_a_rank_silent_for_the_link_timeout_and_not_one_that_beats() -> None:
    """The launcher's own line to the ranks that mpiexec starts on other hosts
    (`launch/beacon.py`), over loopback: its beats reach every rank; a rank that beats back is
    never lost, one that closes its line (finished) is not either, and one that falls silent is
    named, with its host and address, after the link timeout."""
    import socket

    from dataparallel.launch.beacon import Beacon, parse_address

    with Beacon(0.5, toward="127.0.0.1") as beacon:
        assert beacon.address is not None
        secret, host, port = parse_address(beacon.address)
        ranks = [socket.create_connection((host, port), timeout=30) for _ in range(3)]
        try:
            for rank, line in enumerate(ranks):
                line.sendall(f"{secret} {rank} node{rank}\n".encode())
            ranks[2].close()  # finished
            guard = time.monotonic() + 60  # a hang guard: rank 1 is said lost soon
            while beacon.lost() is None:
                assert time.monotonic() < guard, "rank 1 was never said lost"
                ranks[0].sendall(b"\n")
                time.sleep(0.05)
            lost = beacon.lost()
            assert lost is not None and (lost.rank, lost.host) == (1, "node1"), lost
            assert lost.silent >= 0.5
            assert str(lost).startswith("rank 1 on node1 (127.0.0.1) has not been heard for ")
            assert ranks[0].recv(1) == b"\n" and ranks[1].recv(1) == b"\n"  # the beats
        finally:
            for line in ranks:
                line.close()


def test_the_beacon_refuses_a_line_without_the_jobs_secret_and_still_ends_on_a_silence() -> None:
    """Anything that reaches the beacon's port and says a rank without the job's secret (an old
    job's rank, a port scanner) is closed at once, one that says nothing is closed after the
    link timeout, and neither is ever named lost; the rank with the secret that falls silent
    is. The port is bound to the address toward the job's hosts, not to every interface."""
    import socket

    from dataparallel.backends.rendezvous import address_toward
    from dataparallel.launch.beacon import Beacon, hello, parse_address

    with Beacon(0.5, toward="127.0.0.1") as beacon:
        assert beacon.address is not None
        secret, host, port = parse_address(beacon.address)
        assert host == "127.0.0.1" and len(secret) >= 32
        other = address_toward("192.0.2.1", 9)  # this machine's way out, if it has one
        if other is not None and other != host:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((other, port), timeout=30).close()
        lines = [socket.create_connection((host, port), timeout=30) for _ in range(4)]
        wrong, bare, mute, rank = lines
        try:
            wrong.sendall(hello("0" * len(secret), 0))  # another secret, same length
            bare.sendall(b"0 node0\n")  # a rank number and no secret at all
            rank.sendall(hello(secret, 1))  # then silent
            for refused in (wrong, bare):  # closed by the beacon: the end of its stream
                assert refused.recv(1) == b"", "a line without the secret was not closed"
            assert mute.recv(1) == b"", "a line that said nothing stayed open"
            guard = time.monotonic() + 60  # a hang guard: the rank is said lost soon
            while beacon.lost() is None:
                assert time.monotonic() < guard, "the silent rank was never said lost"
                time.sleep(0.05)
            lost = beacon.lost()
            assert lost is not None and lost.rank == 1, lost
            assert lost.host == socket.gethostname() and lost.silent >= 0.5
            assert sorted(beacon.refused) == ["127.0.0.1"] * 3
        finally:
            for line in lines:
                line.close()


def test_the_beacon_names_a_rank_that_reports_its_link_lost_and_the_ranks_at_its_peer() -> None:
    """A rank whose own connection to another host stopped answering (a split under MPI:
    `connections.watch_every` in the rank) says so on its line among its beats
    (`beacon.report`); the launcher names it, its host, the peer's address and the ranks whose
    lines come from there, and no rank is lost (every line still beats). A report of an address
    that is no host of the job is not taken."""
    import socket

    from dataparallel.launch.beacon import Beacon, hello, parse_address, report

    with Beacon(5.0, toward="127.0.0.1") as beacon:
        assert beacon.address is not None
        secret, host, port = parse_address(beacon.address)
        ranks = [socket.create_connection((host, port), timeout=30) for _ in range(2)]
        try:
            ranks[1].sendall(hello(secret, 1))
            # First an address no rank is at, and not this machine's (TEST-NET-1): the
            # program's own connection elsewhere, no link of the job's; it ends nothing.
            ranks[0].sendall(
                hello(secret, 0) + report("192.0.2.1") + b"\n" + report("127.0.0.1")[:5]
            )
            assert ranks[0].recv(1) == b"\n"  # beaten: both lines are the launcher's ranks'
            ranks[0].sendall(report("127.0.0.1")[5:] + b"\n")  # a report in two pieces
            guard = time.monotonic() + 60  # a hang guard: the report is read soon
            while beacon.cut() is None:
                assert time.monotonic() < guard, "the rank's report was never read"
                time.sleep(0.05)
            cut = beacon.cut()
            assert cut is not None and (cut.rank, cut.peer) == (0, "127.0.0.1"), cut
            said = f"rank 0 on {socket.gethostname()} (127.0.0.1) lost its link to 127.0.0.1 ("
            assert str(cut).startswith(said), cut
            assert sorted(cut.there) == [f"rank {r} on {socket.gethostname()}" for r in (0, 1)]
            assert "(a split; under Gloo the rank's call raises dp.LinkLostError)" in str(cut)
            assert beacon.lost() is None
        finally:
            for line in ranks:
                line.close()


def test_a_split_drops_the_host_cut_off_from_most_then_the_smaller_then_the_newer() -> None:
    """Which side of a split goes on (`launch/spawn.split_losers`, docs/elastic.md)."""
    from dataparallel.launch.spawn import split_losers

    one_each = {0: "a", 1: "b", 2: "c"}
    assert split_losers(set(), one_each) == []
    assert split_losers({("b", "c")}, one_each) == [("c", "b")]  # a tie: the newer goes
    assert split_losers({("a", "b")}, one_each) == [("b", "a")]  # rank 0's host stays
    assert split_losers({("a", "b")}, {0: "a", 1: "b", 2: "b"}) == [("a", "b")]  # the smaller
    # b cut off from a and from c goes alone, though it holds more workers than either.
    assert split_losers({("a", "b"), ("b", "c")}, {0: "a", 1: "b", 2: "b", 3: "c"}) == [("b", "a")]
    # Two pairs apart: one host of each, the newest first.
    cut = {("a", "b"), ("c", "d")}
    assert split_losers(cut, {0: "a", 1: "b", 2: "c", 3: "d", 4: "d"}) == [("c", "d"), ("b", "a")]
