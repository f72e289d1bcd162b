"""Run one of Horovod's PyTorch examples on dataparallel, with only its import lines changed.

    python tools/horovod_examples/run.py EXAMPLE.py [-n 2] [--backend mpi|gloo] [-- ARGS...]

EXAMPLE.py is Horovod's own file (for instance `examples/pytorch/pytorch_synthetic_benchmark.py`
or `pytorch_mnist.py` from github.com/horovod/horovod; this project does not ship them, and this
script downloads nothing). A copy is made in a temporary folder in which `import horovod.torch as
hvd` becomes `import dataparallel.horovod.torch as hvd` (and `import horovod` becomes `import
dataparallel.horovod as horovod`); nothing else changes, and the changed lines are printed. The
copy runs under `dataparallel run -n N`, with a small stand-in for torchvision on the path
(`standins/`: synthetic MNIST, a small network for ResNet-50).

Elastic examples (`examples/elastic/pytorch/*_elastic.py`): `--min-np M` runs them elastically
(`dataparallel run --min-np M --backend gloo`), and `--kill W --after TEXT --count K` SIGKILLs
worker W (`w1`...) once K lines of the job's output contain TEXT: a rank killed mid-run, on a
condition rather than a clock.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
IMPORTS = {
    "import horovod.torch as hvd": "import dataparallel.horovod.torch as hvd",
    "import horovod": "import dataparallel.horovod as horovod",
}


def ported(source: str) -> tuple[str, list[str]]:
    """Return `source` with Horovod's import lines changed, and the lines changed."""
    out, changed = [], []
    for line in source.splitlines(keepends=True):
        new = IMPORTS.get(line.strip())
        if new is not None:
            changed.append(f"- {line.strip()}\n+ {new}")
            line = line.replace(line.strip(), new)
        out.append(line)
    return "".join(out), changed


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    mine = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("example", type=Path)
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("--backend", default="mpi", choices=["mpi", "gloo"])
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--min-np", type=int)
    parser.add_argument("--kill", metavar="W")
    parser.add_argument("--after", metavar="TEXT", default="")
    parser.add_argument("--count", type=int, default=1)
    args = parser.parse_args(mine)
    source, changed = ported(args.example.read_text())
    if not changed:
        raise SystemExit(f"{args.example} has no `import horovod.torch as hvd` line to change.")
    print(f"{args.example.name}: the only lines changed:\n" + "\n".join(changed), flush=True)
    with tempfile.TemporaryDirectory(prefix="horovod-example-") as tmp:
        script = Path(tmp) / args.example.name
        script.write_text(source)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env["PYTHONPATH"] = os.pathsep.join(
            [str(HERE / "standins"), *filter(None, [env.get("PYTHONPATH")])]
        )
        command = [
            sys.executable,
            "-m",
            "dataparallel",
            "run",
            "-n",
            str(args.n),
            "--backend",
            args.backend,
            "--timeout",
            str(args.timeout),
            *(["--min-np", str(args.min_np)] if args.min_np else []),
            str(script),
            *extra,
        ]
        print(" ".join(command), flush=True)
        if args.kill is None:
            return subprocess.run(command, env=env, cwd=tmp).returncode
        return _run_and_kill(command, env, tmp, args.kill, args.after, args.count)


def _run_and_kill(
    command: list[str], env: dict[str, str], cwd: str, worker: str, after: str, count: int
) -> int:
    """Run `command`, echoing its output; SIGKILL `worker` at the `count`-th line with `after`."""
    job = subprocess.Popen(
        command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert job.stdout is not None
    seen = 0
    for line in job.stdout:
        print(line, end="", flush=True)
        if after in line:
            seen += 1
            if seen == count:
                pid = _worker_pid(job.pid, worker)
                print(f"run.py: killing worker {worker} (pid {pid}) with SIGKILL", flush=True)
                os.kill(pid, signal.SIGKILL)
    return job.wait()


def _worker_pid(launcher: int, worker: str) -> int:
    """The pid of elastic worker `worker` among the launcher's children (Linux /proc)."""
    wanted = f"DATAPARALLEL_ELASTIC_WORKER={worker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                ppid = int(file.read().rpartition(b")")[2].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as file:
                environ = file.read().split(b"\0")
        except OSError:
            continue
        if ppid == launcher and wanted in environ:
            return int(entry)
    raise SystemExit(f"run.py: no worker {worker} under the launcher (pid {launcher})")


if __name__ == "__main__":
    sys.exit(main())
