"""The ecosystem pages are programs: each has Python blocks, and each checks what it promises.

`docs/ecosystems/*.md` (Lightning, Hugging Face's Trainer and accelerate, torchmetrics,
torch.distributed.checkpoint): each page is one program split into blocks, and each ends by
asserting what its library promises (the same weights on every rank, the metric over every
rank's items, the checkpoint's state back). They run as written, at 1 and 3 ranks, in the jobs
that run the README's blocks (`test_readme.py`: one start-up per world size for every page).
"""

from __future__ import annotations

from _readme import ECOSYSTEM_PAGES, ECOSYSTEMS, blocks


def test_every_page_has_a_program() -> None:
    assert sorted(p.name for p in ECOSYSTEMS.glob("*.md")) == sorted(ECOSYSTEM_PAGES)
    for name in ECOSYSTEM_PAGES:
        found = blocks((ECOSYSTEMS / name).read_text(encoding="utf-8"))
        assert found and all(b.source.strip() and b.min_ranks == 1 for b in found), name
        assert any("assert " in b.source for b in found), f"{name} checks nothing"
