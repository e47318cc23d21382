"""
run/plot.py: runs' metrics.jsonl as one SVG picture, written by hand (no plotting library).

Two panels share the step axis. The top one holds each run's mean reward as a line with a band of
+- its std over the step's completions, and the held-out eval_reward (greedy) as a dashed line with
dots where a record has one; the bottom one holds the entropy of the sampled tokens, or, when every
run has a tool (tools/), its calls per row. Each run gets
one colour, named in the legend by the part of its path that differs from the others' (seeds of
one task read as seed0, seed1, ...). A null value (a step with nothing scored) is skipped. Each
panel's axes follow the data: x from the first to the last step plotted, y from the lowest to the
highest value plotted (band included).

    python run/plot.py runs/a runs/b ... -o picture.svg [--title TEXT]

train.py calls write_svg(run_dirs, path, title) at each checkpoint and at the end;
tests/bench_learning.py draws one picture per task with its seeds. Tested by tests/test_plot.py.
"""

import json
import math
import os
import sys
from dataclasses import dataclass
from xml.sax.saxutils import escape

# -----------------------------------------------------------------------------
# Reading runs

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")  # matplotlib's tab10: distinct for up to 10 runs


def read_metrics(run_dir: str) -> list[dict]:
    """The run's records. A last line cut short (the run is writing it now) is left out; a bad
    line elsewhere is an error that names it."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"run/plot.py: {path} does not exist (is {run_dir} a run's --out?)")
    with open(path) as f:
        lines = f.read().splitlines()
    records = []
    for i, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines):
                raise ValueError(f"run/plot.py: {path}:{i} is not a JSON object") from None
    return records


def points(records: list[dict], key: str) -> list[tuple[float, float]]:
    """(step, value) of the records where key holds a finite number."""
    out = []
    for r in records:
        value = r.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and "step" in r:
            out.append((float(r["step"]), float(value)))
    return out


def band(records: list[dict]) -> list[tuple[float, float, float]]:
    """(step, mean - std, mean + std) where both reward and reward_std are numbers."""
    std = dict(points(records, "reward_std"))
    return [(s, m - std[s], m + std[s]) for s, m in points(records, "reward") if s in std]


def labels(run_dirs: list[str]) -> list[str]:
    """Each run's path less the folders every path shares (the whole path for a single run)."""
    parts = [os.path.normpath(d).split(os.sep) for d in run_dirs]
    shared = 0
    while (len(parts) > 1 and all(len(p) > shared + 1 for p in parts)
           and len({p[shared] for p in parts}) == 1):
        shared += 1
    return ["/".join(p[shared:]) for p in parts]

# -----------------------------------------------------------------------------
# Drawing

WIDTH = 720
LEFT = 60      # room for the y tick labels
RIGHT = 150    # room for the legend
PANEL = 200    # panel height
GAP = 50       # between panels: the x tick labels and the next panel's title


@dataclass
class Panel:
    """A rectangle of the picture and the data range it maps onto it."""
    top: float
    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float

    def x(self, step: float) -> float:
        return LEFT + (step - self.x_lo) / (self.x_hi - self.x_lo) * (WIDTH - LEFT - RIGHT)

    def y(self, value: float) -> float:
        return self.top + PANEL - (value - self.y_lo) / (self.y_hi - self.y_lo) * PANEL

    def path(self, xy: list[tuple[float, float]]) -> str:
        return " ".join(f"{self.x(s):.1f},{self.y(v):.1f}" for s, v in xy)


def data_range(values: list[float]) -> tuple[float, float]:
    """min and max, widened around a single value so that the axis has a length."""
    lo = min(values, default=0.0)
    hi = max(values, default=1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    return lo, hi


def axes(panel: Panel, name: str) -> list[str]:
    """Frame, 5 ticks on each axis with their values, and the panel's name above it."""
    right = WIDTH - RIGHT
    bottom = panel.top + PANEL
    out = [f'<g class="panel" data-name="{name}" data-xmin="{panel.x_lo:g}" '
           f'data-xmax="{panel.x_hi:g}" data-ymin="{panel.y_lo:g}" data-ymax="{panel.y_hi:g}">',
           f'<rect x="{LEFT}" y="{panel.top}" width="{right - LEFT}" height="{PANEL}" '
           'fill="none" stroke="#444"/>',
           f'<text x="{LEFT}" y="{panel.top - 6}" font-size="13">{escape(name)}</text>']
    for i in range(5):
        value = panel.y_lo + (panel.y_hi - panel.y_lo) * i / 4
        y = panel.y(value)
        out.append(f'<line x1="{LEFT}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 4}" y="{y + 4:.1f}" font-size="11" '
                   f'text-anchor="end">{value:.3g}</text>')
        step = panel.x_lo + (panel.x_hi - panel.x_lo) * i / 4
        out.append(f'<text x="{panel.x(step):.1f}" y="{bottom + 14}" font-size="11" '
                   f'text-anchor="middle">{step:.0f}</text>')
    return out


def run_curves(panels: tuple[Panel, Panel], records: list[dict], colour: str,
               run: str, lower: str = "entropy") -> list[str]:
    """One run's band, reward line, eval line with dots, and its `lower` metric's line."""
    top, bottom = panels
    spread = band(records)
    outline = [(s, hi) for s, _, hi in spread] + [(s, lo) for s, lo, _ in reversed(spread)]
    evals = points(records, "eval_reward")
    out = [f'<g class="run" data-run="{escape(run)}">',
           f'<polygon class="band" points="{top.path(outline)}" fill="{colour}" '
           'fill-opacity="0.15" stroke="none"/>',
           f'<polyline class="reward" points="{top.path(points(records, "reward"))}" '
           f'fill="none" stroke="{colour}" stroke-width="1.2"/>',
           f'<polyline class="eval_reward" points="{top.path(evals)}" fill="none" '
           f'stroke="{colour}" stroke-dasharray="5,3"/>']
    out += [f'<circle cx="{top.x(s):.1f}" cy="{top.y(v):.1f}" r="2.5" fill="{colour}"/>'
            for s, v in evals]
    out.append(f'<polyline class="{lower}" points="{bottom.path(points(records, lower))}" '
               f'fill="none" stroke="{colour}" stroke-width="1.2"/>')
    return out + ["</g>"]


def write_svg(run_dirs: list[str], path: str, title: str = "") -> None:
    """One picture of the runs' metrics.jsonl at path, written to a temporary name and renamed
    (a viewer never reads half a file)."""
    if not run_dirs:
        raise ValueError("run/plot.py: no run directories to plot")
    runs = [read_metrics(d) for d in run_dirs]
    steps = [s for records in runs for s, _ in points(records, "step")]
    x_lo, x_hi = data_range(steps)
    top_values = [v for r in runs for key in ("reward", "eval_reward") for _, v in points(r, key)]
    top_values += [v for r in runs for _, lo, hi in band(r) for v in (lo, hi)]
    lower = "tool_calls" if all(any("tool_calls" in x for x in r) for r in runs) else "entropy"
    entropies = [v for r in runs for _, v in points(r, lower)]
    first = 40 if title else 25
    panels = (Panel(first, x_lo, x_hi, *data_range(top_values)),
              Panel(first + PANEL + GAP, x_lo, x_hi, *data_range(entropies)))
    height = first + 2 * PANEL + GAP + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'font-family="sans-serif">', f'<rect width="{WIDTH}" height="{height}" fill="white"/>']
    if title:
        out.append(f'<text x="{WIDTH / 2}" y="18" font-size="14" '
                   f'text-anchor="middle">{escape(title)}</text>')
    out += axes(panels[0], "reward (mean, band +-std; dashed: eval_reward, greedy)") + ["</g>"]
    out += axes(panels[1], "tool calls per row" if lower == "tool_calls" else "entropy")
    out += ["</g>"]
    out.append(f'<text x="{(WIDTH - RIGHT + LEFT) / 2}" y="{height - 4}" font-size="12" '
               'text-anchor="middle">step</text>')
    for i, (records, name) in enumerate(zip(runs, labels(run_dirs))):
        colour = COLOURS[i % len(COLOURS)]
        out += run_curves(panels, records, colour, name, lower)
        y = first + 14 * i
        out.append(f'<text x="{WIDTH - RIGHT + 10}" y="{y + 10}" font-size="11" '
                   f'fill="{colour}">{escape(name)}</text>')
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(out + ["</svg>"]) + "\n")
    os.replace(tmp, path)

# -----------------------------------------------------------------------------
# Command line


def main(argv: list[str]) -> int:
    usage = "usage: python run/plot.py RUN_DIR [RUN_DIR ...] -o PICTURE.svg [--title TEXT]"
    options = {"-o": "", "--title": ""}
    run_dirs = []
    if "-h" in argv or "--help" in argv:
        print(f"{usage}\n  the curves of each run's metrics.jsonl, one picture (SVG)")
        return 0
    i = 0
    while i < len(argv):
        if argv[i] in options:
            if i + 1 == len(argv):
                print(f"run/plot.py: {argv[i]} needs a value\n{usage}", file=sys.stderr)
                return 2
            options[argv[i]] = argv[i + 1]
            i += 2
        elif argv[i].startswith("-"):
            print(f"run/plot.py: unknown option {argv[i]!r}\n{usage}", file=sys.stderr)
            return 2
        else:
            run_dirs.append(argv[i])
            i += 1
    if not run_dirs or not options["-o"]:
        print(usage, file=sys.stderr)
        return 2
    try:
        write_svg(run_dirs, options["-o"], options["--title"])
    except (ValueError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
