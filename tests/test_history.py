"""The history reads as a list: every commit from the one that added this test on has a subject of
at most 72 characters (`git log --oneline` fits a terminal); the why, the figures and the checks
go in the body. Earlier subjects stay as they were: history is not rewritten.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 72


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def test_commit_subjects_fit_one_line() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    added = _git("log", "--diff-filter=A", "--format=%H", "--", "tests/test_history.py")
    first = added.stdout.split()[-1:] if added.returncode == 0 else []
    if not first:
        pytest.skip("the commit that added this test is not in this clone (shallow or uncommitted)")
    log = _git("log", "--format=%h %s", f"{first[0]}^..HEAD")
    assert log.returncode == 0, log.stderr
    long = [line for line in log.stdout.splitlines() if len(line.partition(" ")[2]) > LIMIT]
    assert long == [], f"subjects over {LIMIT} characters (say why in the body): {long}"
