"""A page's Python blocks, as a reader meets them: in order, in one Python session.

`blocks(text)` returns every ```python block with the line it starts on and the fewest ranks it
runs on: a block whose first line says `# on N ranks or more` needs N (the README writes the
launch command beside it); every other block runs at any world size, a world of one included.
`python tests/_readme.py README.md [PAGE ...]` (under any launcher) runs them, each in the
namespace the ones before it on its page left, and prints `README.md block K (line L): ok` (or
`... skipped`) on rank 0. Used for the README, `docs/quickstart.md`, `docs/migrate/mpi4jax.md`
and the ecosystem pages (`ECOSYSTEM_PAGES`, each with the modules it needs), all in the same jobs.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# docs/ecosystems/*.md, each a program that ends by asserting what its library promises, and the
# modules it needs: a page whose modules are missing is left out (and said so).
ECOSYSTEM_PAGES = {
    "lightning.md": ("torch", "pytorch_lightning"),
    "huggingface.md": ("torch", "transformers", "accelerate"),
    "torchmetrics.md": ("torch", "torchmetrics"),
    "checkpoint.md": ("torch",),
}
ECOSYSTEMS = ROOT / "docs" / "ecosystems"

_FENCE = re.compile(r"^```python\n(.*?)^```\n", re.MULTILINE | re.DOTALL)
_RANKS = re.compile(r"# on (\d+) ranks or more\b")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    source: str
    min_ranks: int


def blocks(text: str) -> list[Block]:
    """Return the ```python blocks of the Markdown `text`, in order."""
    found = []
    for match in _FENCE.finditer(text):
        source = match.group(1)
        first = source.splitlines()[0] if source.strip() else ""
        need = _RANKS.match(first)
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(line, source, int(need.group(1)) if need else 1))
    return found


def main(path: str) -> None:
    """Run the blocks of the page at `path` in one namespace, and report each on rank 0."""
    import dataparallel as dp

    namespace: dict[str, object] = {"__name__": "__main__"}
    for k, block in enumerate(blocks(Path(path).read_text(encoding="utf-8")), 1):
        where = f"{Path(path).name} block {k} (line {block.line})"
        size = dp.size() if dp.initialized() else 1
        if size < block.min_ranks:
            verdict = f"skipped (needs {block.min_ranks} ranks, the world has {size})"
        else:
            exec(compile(block.source, f"{path}:{where}", "exec"), namespace)
            verdict = "ok"
        if not dp.initialized() or dp.rank() == 0:
            # One write, newline included: under PYTHONUNBUFFERED (the launchers set it) print
            # writes the text and its newline apart, and another rank's line can land between.
            sys.stdout.write(f"{where}: {verdict}\n")
            sys.stdout.flush()


if __name__ == "__main__":
    for page in sys.argv[1:]:  # each page in a namespace of its own, one process for all
        main(page)
