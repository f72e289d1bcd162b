"""Draw docs/figures/train_step.svg from the training-step table of docs/performance.md.

    python tools/plot_figures.py            # write the figure
    python tools/plot_figures.py --check    # exit 1 if the figure is not what the table gives

The figures are the page's own: the rows of "Today's figures" whose run is in `RUNS` (the code of
today), each cell `opt / model (opt_ddp / model_ddp)`, ratios of dataparallel's overhead per step
to Horovod's and to DDP's. Each bar spans the runs' ratios, its dot is their median. Plain SVG,
written by hand, so that the docs need no plotting library.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "performance.md"
FIGURE = ROOT / "docs" / "figures" / "train_step.svg"
HEADING = "### Today's figures"
RUNS = ("5", "7", "8")
MODELS = ("MLP 3.42 M", "transformer 1.05 M", "transformer 3.67 M", "transformer 13.6 M")
MODES = ("DistributedOptimizer", "DataParallelModel")
COLORS = ("#3f51b5", "#ef6c00")
_CELL = re.compile(r"([\d.]+) / ([\d.]+) \(([\d.]+) / ([\d.]+)\)")

# ratios[reference][mode][model] = the runs' ratios
Ratios = dict[str, dict[str, dict[str, list[float]]]]


def read_ratios(text: str) -> Ratios:
    """Parse the runs' rows of the table under HEADING."""
    section = text[text.index(HEADING) :]
    ratios: Ratios = {
        ref: {mode: {model: [] for model in MODELS} for mode in MODES} for ref in ("Horovod", "DDP")
    }
    rows = 0
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 2 + len(MODELS) or cells[0] not in RUNS:
            continue
        rows += 1
        for model, cell in zip(MODELS, cells[2:], strict=True):
            match = _CELL.fullmatch(cell)
            if match is None:
                raise ValueError(f"{PAGE.name}, run {cells[0]}, {model}: cannot read {cell!r}")
            opt, mod, opt_ddp, mod_ddp = (float(g) for g in match.groups())
            ratios["Horovod"]["DistributedOptimizer"][model].append(opt)
            ratios["Horovod"]["DataParallelModel"][model].append(mod)
            ratios["DDP"]["DistributedOptimizer"][model].append(opt_ddp)
            ratios["DDP"]["DataParallelModel"][model].append(mod_ddp)
        if rows == len(RUNS):
            return ratios
    raise ValueError(f"{PAGE.name}: expected the rows of runs {', '.join(RUNS)} under {HEADING!r}")


def svg(ratios: Ratios) -> str:
    """Return the figure: one panel per reference, a group of bars per model."""
    width, height, top, bottom, left = 760, 350, 50, 90, 60
    panel_w = (width - left - 20) / 2
    plot_h = height - top - bottom
    y_max = 1.2

    def y(value: float) -> float:
        return top + plot_h * (1 - value / y_max)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">Overhead of a '
        "training step's communication, relative to the reference (2 ranks, runs "
        f"{', '.join(RUNS)})</text>",
    ]
    for p, ref in enumerate(("Horovod", "DDP")):
        x0 = left + p * panel_w
        out.append(
            f'<text x="{x0 + panel_w / 2:.1f}" y="{top - 12}" text-anchor="middle">'
            f"dataparallel / {ref} {'0.28.1 (MPI)' if ref == 'Horovod' else '(Gloo)'}</text>"
        )
        for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
            style = 'stroke="#444" stroke-dasharray="5,3"' if tick == 1.0 else 'stroke="#ddd"'
            out.append(
                f'<line x1="{x0:.1f}" x2="{x0 + panel_w - 20:.1f}" y1="{y(tick):.1f}" '
                f'y2="{y(tick):.1f}" {style}/>'
            )
            out.append(
                f'<text x="{x0 - 6:.1f}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:g}</text>'
            )
        group_w = (panel_w - 20) / len(MODELS)
        for m, model in enumerate(MODELS):
            gx = x0 + m * group_w
            for k, mode in enumerate(MODES):
                values = ratios[ref][mode][model]
                bx = gx + 12 + k * 26
                lo, hi, mid = min(values), max(values), statistics.median(values)
                out.append(
                    f'<rect x="{bx:.1f}" y="{y(hi):.1f}" width="20" '
                    f'height="{max(y(lo) - y(hi), 1.5):.1f}" fill="{COLORS[k]}" opacity="0.45"/>'
                )
                out.append(
                    f'<rect x="{bx:.1f}" y="{y(mid):.1f}" width="20" height="{y(0) - y(mid):.1f}"'
                    f' fill="{COLORS[k]}" opacity="0.15"/>'
                )
                out.append(
                    f'<circle cx="{bx + 10:.1f}" cy="{y(mid):.1f}" r="3.5" fill="{COLORS[k]}"/>'
                )
            name, _, size = model.rpartition(" M")[0].rpartition(" ")
            out.append(
                f'<text x="{gx + 31:.1f}" y="{top + plot_h + 16}" text-anchor="middle">'
                f"{name}</text>"
                f'<text x="{gx + 31:.1f}" y="{top + plot_h + 30}" text-anchor="middle">'
                f"{size} M</text>"
            )
    for k, mode in enumerate(MODES):
        lx = left + k * 230
        out.append(
            f'<rect x="{lx}" y="{height - 40}" width="14" height="10" fill="{COLORS[k]}" '
            f'opacity="0.6"/><text x="{lx + 20}" y="{height - 31}">dp.{mode}</text>'
        )
    out.append(
        f'<text x="{left}" y="{height - 10}" fill="#555">Dark band: the runs\' range; dot and '
        "light bar: their median. Below the dashed line at 1: less overhead than the reference."
        "</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    figure = svg(read_ratios(PAGE.read_text(encoding="utf-8")))
    if args.check:
        if not FIGURE.exists() or FIGURE.read_text(encoding="utf-8") != figure:
            print(f"{FIGURE} is not what {PAGE} gives: run python {Path(__file__).name}")
            return 1
        return 0
    FIGURE.write_text(figure, encoding="utf-8")
    print(f"wrote {FIGURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
