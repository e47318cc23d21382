"""run/plot.py: the SVG parses, holds one set of curves per run, skips nulls, and its axes follow the
data."""

import json
import xml.etree.ElementTree as ET

import pytest

from run import plot

SVG = "{http://www.w3.org/2000/svg}"


def write_run(path, rows: list[dict]) -> str:
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def record(step: int, reward, std=0.1, entropy=1.0, **more) -> dict:
    return dict(step=step, reward=reward, reward_std=std, entropy=entropy, loss=0.0, **more)


def curve(root, run: str, name: str) -> list[tuple[float, float]]:
    group = [g for g in root.iter(f"{SVG}g") if g.get("data-run") == run]
    assert len(group) == 1, f"expected one group for run {run}"
    (line,) = [p for p in group[0] if p.get("class") == name]
    return [tuple(map(float, xy.split(","))) for xy in line.get("points").split()]


def panels(root) -> dict[str, dict[str, float]]:
    return {g.get("data-name").split()[0]: {k: float(g.get(f"data-{k}"))
                                            for k in ("xmin", "xmax", "ymin", "ymax")}
            for g in root.iter(f"{SVG}g") if g.get("class") == "panel"}


def test_one_curve_per_run_with_nulls_skipped_and_eval_where_recorded(tmp_path):
    a = write_run(tmp_path / "task" / "seed0", [
        record(1, 0.1, eval_reward=0.2), record(2, None, std=None, entropy=None),
        record(3, 0.5), record(4, 0.9, eval_reward=0.8)])
    b = write_run(tmp_path / "task" / "seed1", [record(s, 0.2) for s in range(1, 6)])
    out = tmp_path / "p.svg"
    plot.write_svg([a, b], str(out), title="two <runs>")
    root = ET.parse(out).getroot()  # parses as XML: the title's "<" is escaped
    runs = [g.get("data-run") for g in root.iter(f"{SVG}g") if g.get("class") == "run"]
    assert runs == ["seed0", "seed1"]  # one group each, named by what differs in their paths
    assert len(curve(root, "seed0", "reward")) == 3  # step 2's null is skipped
    assert len(curve(root, "seed0", "entropy")) == 3
    assert len(curve(root, "seed0", "eval_reward")) == 2  # only the records that have it
    assert len(curve(root, "seed1", "reward")) == 5
    assert len(curve(root, "seed1", "eval_reward")) == 0
    xs = [x for x, _ in curve(root, "seed0", "reward")]
    assert xs == sorted(xs) and len(set(xs)) == 3  # in step order, distinct positions
    title = [t.text for t in root.iter(f"{SVG}text")]
    assert "two <runs>" in title


def test_the_axes_ranges_follow_the_data(tmp_path):
    rows = [record(10, 0.2, std=0.05, entropy=2.5), record(20, 0.6, std=0.1, entropy=0.5),
            record(30, None, std=None, entropy=None, eval_reward=0.95)]
    run = write_run(tmp_path / "r", rows)
    out = tmp_path / "p.svg"
    plot.write_svg([run], str(out))
    got = panels(ET.parse(out).getroot())
    # x: the first to the last step; reward: band low (0.2 - 0.05) to the eval's 0.95.
    assert got["reward"] == pytest.approx(dict(xmin=10, xmax=30, ymin=0.15, ymax=0.95), rel=1e-9)
    assert got["entropy"] == pytest.approx(dict(xmin=10, xmax=30, ymin=0.5, ymax=2.5), rel=1e-9)
    # The lowest entropy sits on the bottom edge of its panel (the second one, no title above).
    root = ET.parse(out).getroot()
    lowest = max(y for _, y in curve(root, run, "entropy"))  # a lone run is named by its path
    bottom_edge = 25 + plot.PANEL + plot.GAP + plot.PANEL
    assert lowest == pytest.approx(bottom_edge, abs=0.05)  # 0.05: points have one decimal


def test_a_cut_short_last_line_is_skipped_and_a_bad_middle_line_is_named(tmp_path):
    run = tmp_path / "r"
    write_run(run, [record(1, 0.1), record(2, 0.2)])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')  # the run is writing this line right now
    assert [r["step"] for r in plot.read_metrics(str(run))] == [1, 2]
    with open(run / "metrics.jsonl", "a") as f:
        f.write("\n" + json.dumps(record(4, 0.4)) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl:3 is not a JSON object"):
        plot.read_metrics(str(run))
    with pytest.raises(FileNotFoundError, match="is .* a run's --out"):
        plot.write_svg([str(tmp_path / "missing")], str(tmp_path / "p.svg"))


def test_command_line_writes_the_picture_and_refuses_bad_arguments(tmp_path, capsys):
    run = write_run(tmp_path / "r", [record(1, 0.1), record(2, 0.3)])
    out = tmp_path / "p.svg"
    assert plot.main([run, "-o", str(out), "--title", "t"]) == 0
    ET.parse(out)
    assert plot.main([run]) == 2  # no -o
    assert plot.main([run, "-o"]) == 2
    assert "-o needs a value" in capsys.readouterr().err
    assert plot.main([run, "--colour", "red", "-o", str(out)]) == 2


def test_help_prints_the_usage_and_exits_0(capsys):
    assert plot.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python run/plot.py")


def test_runs_with_a_tool_show_calls_per_row_below_and_a_mix_shows_entropy(tmp_path):
    tool = [write_run(tmp_path / f"lookup{i}", [record(s, 0.1 * s, tool_calls=0.2 * s)
                                                for s in range(1, 5)]) for i in range(2)]
    plain = write_run(tmp_path / "reverse", [record(s, 0.1 * s) for s in range(1, 5)])
    out = tmp_path / "p.svg"
    plot.write_svg(tool, str(out))
    root = ET.parse(out).getroot()
    assert "tool" in panels(root) and "entropy" not in panels(root)
    assert [y for _, y in curve(root, "lookup0", "tool_calls")] == sorted(
        [y for _, y in curve(root, "lookup0", "tool_calls")], reverse=True)  # rising: y goes up
    plot.write_svg(tool + [plain], str(out))
    assert "entropy" in panels(ET.parse(out).getroot())
