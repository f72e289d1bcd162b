"""Several machines in one job: the host list, where each rank goes, and ranks started over ssh.

`dataparallel run -H a:2,b:2` (or `--hostfile FILE`) names the machines and their slots in
Horovod's formats: `host:slots` items (or lines), or `host slots=N` lines, `#` starting a comment.
Ranks fill the hosts in order (`place`): rank 0 and the next on the first host, and so on.

Under Gloo the launcher starts the ranks of this machine itself and those of the others over ssh,
as horovodrun does: `ssh HOST "cd CWD && env K=V ... PYTHON -m dataparallel.launch.runner ..."`,
so every host must have the same working directory and the same interpreter path. The
environment goes along, less what describes this machine or this shell (`forwarded`). The ssh
client's standard input is the launcher's line to the remote rank (`RemoteRank`): a signal's
name written there is raised in the rank (Ctrl-C, then the launcher's SIGTERM), and its end (the
launcher gone, or its ssh killed) kills the rank with its process group (the runner's
`--remote`). The launcher also beats on the line (an empty line, several times within
`--link-timeout`): a rank that hears nothing for much longer (`config.silence_limit`) is behind
a link that went down, where no end ever arrives (the host's sshd waits for the client for
hours), and leaves with its process group instead of waiting in its collectives until their
timeout.
Before any rank starts, each other host is asked over ssh whether it answers and has the
directory and the interpreter (`check_hosts`), so that a host that cannot be reached fails the
launch at once, named, instead of leaving the others waiting at the rendezvous.
"""

from __future__ import annotations

import math
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dataparallel.backends.rendezvous import is_here
from dataparallel.config import DEFAULT_LINK_TIMEOUT, RUN_DIR_VARIABLE, beat_interval
from dataparallel.errors import DataParallelError

__all__ = [
    "CONTROL_SIGNALS",
    "HostError",
    "HostSlots",
    "RemoteRank",
    "Slot",
    "Ssh",
    "check_hosts",
    "forwarded",
    "hosts_of",
    "is_local",
    "parse_hosts",
    "place",
    "read_hostfile",
    "remote_command",
]

# Seconds ssh may take to connect to a host before the launch fails naming it.
CONNECT_TIMEOUT = 10

# Variables that describe this machine or this shell, not the job: never sent to other hosts.
# Horovod drops BASH_FUNC_*, OLDPWD and *CUDA_VISIBLE_DEVICES; the run folder is this machine's.
_NOT_FORWARDED = re.compile(
    r"BASH_FUNC_.*|OLDPWD|PWD|HOSTNAME|SHLVL|_|.*CUDA_VISIBLE_DEVICES|SSH_.*|"
    + re.escape(RUN_DIR_VARIABLE)
)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# What the launcher may ask of a remote rank, by the name it writes on the rank's line.
CONTROL_SIGNALS = {"INT": signal.SIGINT, "TERM": signal.SIGTERM}


class HostError(DataParallelError):
    """A host list that cannot be used, or a host that cannot be reached or run the ranks."""


@dataclass(frozen=True)
class HostSlots:
    """One machine of the host list and the ranks it may hold."""

    host: str
    slots: int


@dataclass(frozen=True)
class Slot:
    """Where one rank runs: its host, and its place among that host's ranks."""

    rank: int
    host: str
    local_rank: int
    local_size: int


def _entry(text: str, where: str) -> HostSlots:
    """Parse `host`, `host:slots` or `host slots=N`; `where` names the source in errors."""
    fields = text.split()
    slots = "1"
    if len(fields) == 2 and fields[1].startswith("slots="):
        host, slots = fields[0], fields[1].removeprefix("slots=")
    elif len(fields) == 1:
        host, colon, count = fields[0].rpartition(":")
        if not colon or "]" in count:  # no slots given (an IPv6 address in brackets has colons)
            host = fields[0]
        else:
            slots = count
    else:
        host = ""
    if not host or not slots.isdigit() or int(slots) < 1:
        raise HostError(
            f"{where}: {text.strip()!r} is not HOST, HOST:SLOTS or HOST slots=N with a positive "
            "number of slots (Horovod's formats, e.g. node1:4 or node1 slots=4)."
        )
    return HostSlots(host.strip("[]"), int(slots))


def _checked(hosts: list[HostSlots], where: str) -> list[HostSlots]:
    if not hosts:
        raise HostError(f"{where} names no host.")
    seen = set()
    for entry in hosts:
        if entry.host in seen:
            raise HostError(
                f"{where} names host {entry.host!r} twice: give it once, all its slots."
            )
        seen.add(entry.host)
    return hosts


def parse_hosts(text: str) -> list[HostSlots]:
    """Parse `-H`'s value: `host:slots` items separated by commas (`a:2,b:2`; `a` is `a:1`).

    Raises:
        HostError: an item is not `host` or `host:slots` with a positive count, or a host
            comes twice.
    """
    items = [item.strip() for item in text.split(",")]
    return _checked([_entry(item, f"-H {text!r}") for item in items if item], f"-H {text!r}")


def read_hostfile(path: str) -> list[HostSlots]:
    """Read a host file: one `host:slots` or `host slots=N` a line, `#` starting a comment.

    Raises:
        HostError: the file cannot be read, a line is neither format, or a host comes twice.
    """
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise HostError(f"--hostfile {path!r} cannot be read: {exc}") from exc
    hosts = []
    for number, line in enumerate(lines, 1):
        text = line.partition("#")[0].strip()
        if text:
            hosts.append(_entry(text, f"--hostfile {path!r}, line {number}"))
    return _checked(hosts, f"--hostfile {path!r}")


def place(hosts: Sequence[HostSlots], n: int) -> list[Slot]:
    """Place `n` ranks on `hosts` in order, filling each host's slots before the next's.

    Raises:
        HostError: the hosts have fewer than `n` slots in all.
    """
    total = sum(entry.slots for entry in hosts)
    if n > total:
        raise HostError(
            f"-n {n} ranks do not fit in the {total} slot(s) of the hosts "
            f"({', '.join(f'{e.host}:{e.slots}' for e in hosts)}): give fewer ranks or more slots."
        )
    slots, rank = [], 0
    for entry in hosts:
        count = min(entry.slots, n - rank)
        slots += [Slot(rank + i, entry.host, i, count) for i in range(count)]
        rank += count
    return slots


def is_local(host: str) -> bool:
    """Return whether `host` is this machine (`backends.rendezvous.is_here`), for the launcher,
    which must place every rank: a host that resolves to no address is an error, named.

    Raises:
        HostError: `host` resolves to no address.
    """
    try:
        return is_here(host)
    except OSError as exc:
        raise HostError(f"host {host!r} cannot be resolved here: {exc}") from exc


@dataclass(frozen=True)
class Ssh:
    """How to reach the other hosts: horovodrun's `-p/--ssh-port` and `-i/--ssh-identity-file`.

    Never a password prompt (`BatchMode`); a host's key is accepted the first time and checked
    afterwards (`StrictHostKeyChecking=accept-new`). Anything else goes in `~/.ssh/config`.

    `link_timeout` (`dataparallel run --link-timeout`): ssh asks the host every second whether it
    is there once it has been silent, and gives up (status 255) after that many unanswered
    asks (at least one; an elastic run's heartbeats notice sooner, `dataparallel.elastic`).
    Without it a host whose link went down holds its ssh open for hours (TCP's keep-alive), and
    the launcher never learns that its ranks are out of reach.
    """

    port: int | None = None
    identity_file: str | None = None
    link_timeout: float | None = DEFAULT_LINK_TIMEOUT

    def command(self, host: str, remote: str) -> list[str]:
        """Return the ssh command line that runs the shell command `remote` on `host`."""
        options = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new"]
        options += ["-o", f"ConnectTimeout={CONNECT_TIMEOUT}"]
        if self.link_timeout is not None:
            options += ["-o", "ServerAliveInterval=1"]
            options += ["-o", f"ServerAliveCountMax={max(1, math.ceil(self.link_timeout))}"]
        if self.port is not None:
            options += ["-p", str(self.port)]
        if self.identity_file is not None:
            options += ["-i", self.identity_file]
        return ["ssh", *options, host, remote]


def forwarded(env: Mapping[str, str]) -> dict[str, str]:
    """Return the variables of `env` that a rank on another host gets, as horovodrun sends them."""
    return {
        name: value
        for name, value in env.items()
        if _NAME.fullmatch(name) and not _NOT_FORWARDED.fullmatch(name)
    }


def remote_command(cwd: str, env: Mapping[str, str], argv: Sequence[str]) -> str:
    """Return the shell command that runs `argv` in `cwd` with `env` on another host.

    The shell stays the rank's parent (`; exit $?`), so that a rank killed by signal N comes
    back as status 128 + N: ssh alone would turn it into 255, its own failure's status.
    """
    variables = " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items())
    return f"cd {shlex.quote(cwd)} && env {variables} {shlex.join(argv)}; exit $?"


def check_hosts(hosts: Sequence[str], ssh: Ssh, cwd: str, python: str) -> None:
    """Ask every host, at once, whether it answers over ssh and has `cwd` and `python`.

    Raises:
        HostError: naming each host that failed and why (ssh's own message when it could not
            connect).
    """
    probe = f"cd {shlex.quote(cwd)} || exit 3; test -x {shlex.quote(python)} || exit 4"
    problems: dict[str, str] = {}

    def ask(host: str) -> None:
        try:
            done = subprocess.run(
                ssh.command(host, probe),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=CONNECT_TIMEOUT + 20,
                check=False,
            )
        except FileNotFoundError:
            problems[host] = "no `ssh` client here (apt-get install openssh-client)"
            return
        except subprocess.TimeoutExpired:
            problems[host] = f"ssh did not answer within {CONNECT_TIMEOUT + 20} s"
            return
        said = done.stderr.strip().splitlines()
        if done.returncode == 3:
            problems[host] = f"it has no directory {cwd} (every host needs the same one)"
        elif done.returncode == 4:
            problems[host] = f"it has no interpreter {python} (every host needs the same path)"
        elif done.returncode != 0:
            problems[host] = f"ssh failed with status {done.returncode}" + (
                f": {said[-1]}" if said else ""
            )

    threads = [threading.Thread(target=ask, args=(host,), daemon=True) for host in hosts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if problems:
        raise HostError(
            "cannot start ranks on "
            + "; ".join(f"host {host!r}: {why}" for host, why in sorted(problems.items()))
        )


class RemoteRank(subprocess.Popen[bytes]):
    """The ssh client of a rank on another host, whose signals go to the rank over ssh.

    `send_signal` (and so `terminate`) writes the signal's name on the rank's standard input,
    where the runner (`--remote`) raises it; `kill` kills the ssh client, whose end the rank
    sees as the end of its input, and dies of it with its process group. The client runs in its
    own session, so a Ctrl-C at the terminal reaches the launcher, which passes it on, and not
    ssh, which would cut the rank off before it could report it.
    """

    def __init__(self, host: str, ssh: Ssh, remote: str) -> None:
        super().__init__(
            ssh.command(host, remote),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.host = host
        self._line = threading.Lock()  # the beats' thread and the launcher's signals share it
        if ssh.link_timeout is not None:
            interval = beat_interval(ssh.link_timeout)
            threading.Thread(
                target=self._beat, args=(interval,), name="dataparallel-beat", daemon=True
            ).start()

    def _write(self, line: bytes) -> bool:
        """Write `line` to the rank; return False once the line is closed."""
        if self.stdin is None:
            return False
        with self._line:
            try:
                self.stdin.write(line)
                self.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                return False
        return True

    def _beat(self, interval: float) -> None:
        """Write an empty line every `interval` seconds while the client runs: the rank's sign
        that the launcher and the link to it are there (a thread of its own, so that nothing
        the launcher does, a slow discovery script say, silences it)."""
        while self.returncode is None and self._write(b"\n"):
            time.sleep(interval)

    def send_signal(self, sig: int) -> None:
        """Pass `sig` on to the rank (SIGINT, SIGTERM); any other signal kills it."""
        name = next((k for k, v in CONTROL_SIGNALS.items() if v == sig), None)
        if name is not None and self.poll() is None and self._write(f"{name}\n".encode()):
            return
        super().send_signal(signal.SIGKILL)


def hosts_of(slots: Sequence[Slot]) -> list[str]:
    """Return the hosts of `slots`, each once, in rank order."""
    return list(dict.fromkeys(slot.host for slot in slots))
