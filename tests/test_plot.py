"""plot.py on hand-made metrics: the table's numbers and the figure file."""

import json
import math

import pytest

import plot


def fake_run(path, rewards, entropies, eval_acc):
    path.mkdir(parents=True)
    rows = []
    for i, (r, e) in enumerate(zip(rewards, entropies)):
        rows.append({"step": i + 1, "reward_mean": r, "entropy": e, "clip_frac_low_neg": 0.01, "clip_frac_high_pos": 0.0,
                     "clip_frac_low_pos": 0.0, "clip_frac_high_neg": 0.002, "response_length_mean": 20.0})
    rows[-1]["eval_acc"] = eval_acc
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_summary_and_figures(tmp_path):
    a = fake_run(tmp_path / "a-s0", [0.0] * 10 + [1.0] * 10, [0.5] * 20, 0.6)
    b = fake_run(tmp_path / "a-s1", [0.2] * 10 + [0.6] * 10, [0.3] * 20, 0.8)
    c = fake_run(tmp_path / "b-s0", [-1.0] * 20, [0.1] * 20, 0.1)
    written = plot.make_figures({"a": [a, b], "b": [c]}, str(tmp_path / "fig"))
    assert (tmp_path / "fig" / "curves.png").stat().st_size > 10_000
    table = json.loads((tmp_path / "fig" / "summary.json").read_text())
    assert table["a"]["eval_acc"] == pytest.approx([0.7, math.sqrt(0.02)])
    assert table["a"]["reward_first10"][0] == pytest.approx(0.1) and table["a"]["reward_last10"][0] == pytest.approx(0.8)
    assert table["a"]["entropy_last10"][0] == pytest.approx(0.4)
    assert table["b"]["seeds"] == 1 and table["b"]["eval_acc"] == [0.1, 0.0]
    assert "| a | 2 | 70.0 ± 14.1 |" in (tmp_path / "fig" / "summary.md").read_text()
    assert len(written) == 3


def test_missing_run_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere/metrics.jsonl not found"):
        plot.read_metrics(str(tmp_path / "nowhere"))
