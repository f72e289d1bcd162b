"""`dataparallel run`'s elastic options: declared, checked, and handed to `launch/elastic.py`."""

from __future__ import annotations

import argparse
import os

from dataparallel.launch.elastic import ElasticOptions, run_elastic

__all__ = ["add_elastic_options", "check_elastic_options", "elastic_options", "run_elastic"]


def add_elastic_options(run: argparse.ArgumentParser) -> None:
    """Add Horovod's elastic options (`horovodrun --min-np ...`) to `run`."""
    group = run.add_argument_group(
        "elastic (Gloo): lose workers and go on, add workers (docs/elastic.md)"
    )
    group.add_argument(
        "--min-np",
        type=int,
        metavar="M",
        help="run elastically: go on while at least M workers remain (the script uses "
        "dp.elastic.run)",
    )
    group.add_argument(
        "--max-np", type=int, metavar="K", help="never more than K workers (default: -n)"
    )
    group.add_argument(
        "--host-discovery-script",
        metavar="S",
        help="an executable printing HOST:SLOTS lines (Horovod's format), run every second; "
        "new slots on this machine get new workers",
    )
    group.add_argument(
        "--elastic-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="end the run after S seconds below --min-np (default: 600, Horovod's)",
    )
    group.add_argument(
        "--reset-limit", type=int, metavar="R", help="end the run once re-formed more than R times"
    )


def check_elastic_options(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Reject bad elastic options with argparse's usage error (exit status 2)."""
    others = [
        flag
        for flag, value in (
            ("--max-np", ns.max_np),
            ("--host-discovery-script", ns.host_discovery_script),
            ("--reset-limit", ns.reset_limit),
        )
        if value is not None
    ]
    if ns.min_np is None:
        if others or ns.elastic_timeout != 600.0:
            parser.error(f"{', '.join(others) or '--elastic-timeout'} needs --min-np M.")
        return
    if ns.backend != "gloo":
        parser.error(
            f"--min-np with --backend {ns.backend}: MPI cannot go on without a lost rank (the "
            "mpich wheel's MPI has no ULFM, so no communicator can shrink). Elastic runs use "
            "Gloo: add --backend gloo."
        )
    if ns.nnodes != 1:
        parser.error("--min-np runs on one machine (--nnodes 1); see docs/elastic.md.")
    max_np = ns.n if ns.max_np is None else ns.max_np
    if not 1 <= ns.min_np <= ns.n:
        parser.error(f"--min-np must be in 1..{ns.n} (-n), got {ns.min_np}.")
    if max_np < ns.n:
        parser.error(f"--max-np must be at least -n {ns.n}, got {max_np}.")
    if not ns.elastic_timeout > 0:
        parser.error(f"--elastic-timeout must be positive, got {ns.elastic_timeout:g}.")
    if ns.reset_limit is not None and ns.reset_limit < 0:
        parser.error(f"--reset-limit must be at least 0, got {ns.reset_limit}.")
    script = ns.host_discovery_script
    if script is not None and not (os.path.isfile(script) and os.access(script, os.X_OK)):
        parser.error(f"--host-discovery-script {script!r} is not an executable file.")


def elastic_options(ns: argparse.Namespace) -> ElasticOptions:
    """Return the checked elastic options of `ns`."""
    return ElasticOptions(
        n=ns.n,
        min_np=ns.min_np,
        max_np=ns.n if ns.max_np is None else ns.max_np,
        discovery=ns.host_discovery_script,
        elastic_timeout=ns.elastic_timeout,
        reset_limit=ns.reset_limit,
    )
