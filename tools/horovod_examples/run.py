"""Run one of Horovod's PyTorch examples on dataparallel, with only its import lines changed.

    python tools/horovod_examples/run.py EXAMPLE.py [-n 2] [--backend mpi|gloo] [-- ARGS...]

EXAMPLE.py is Horovod's own file (for instance `examples/pytorch/pytorch_synthetic_benchmark.py`
or `pytorch_mnist.py` from github.com/horovod/horovod; this project does not ship them, and this
script downloads nothing). A copy is made in a temporary folder in which `import horovod.torch as
hvd` becomes `import dataparallel.horovod.torch as hvd` (and `import horovod` becomes `import
dataparallel.horovod as horovod`); nothing else changes, and the changed lines are printed. The
copy runs under `dataparallel run -n N`, with a small stand-in for torchvision on the path
(`standins/`: synthetic MNIST, a small network for ResNet-50).
"""

from __future__ import annotations

import argparse
import os
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
            str(script),
            *extra,
        ]
        print(" ".join(command), flush=True)
        return subprocess.run(command, env=env, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
