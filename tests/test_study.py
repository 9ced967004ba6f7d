"""tools/study.py: a 2-step study end to end (two configurations, one seed), its JSON, Table-1 analog and figures;
and the table's paired intervals on hand-made runs."""

import json
import os
import subprocess
import sys

import pytest

import stats
import study
from conftest import ROOT


def test_a_two_step_study_runs_resumes_and_reports(tmp_path, tiny_model_path):
    cmd = [sys.executable, "tools/study.py", "--preset", "tiny", "--steps", "2", "--seeds", "0", "--configs", "grpo,ppo_clip",
           "--root", str(tmp_path / "runs"), "--json", str(tmp_path / "study.json"), "--figures", str(tmp_path / "fig"),
           "--eval-every", "2", "--gen-prompts", "8", "--n", "4", "--mini-batch-prompts", "4", "--micro-batch-size", "8",
           "--log-samples-every", "0"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "study.json").read_text())
    assert sorted(data) == ["grpo", "ppo_clip"] and list(data["grpo"]) == ["0"]
    run = data["grpo"]["0"]
    assert run["steps_done"] == 2 and run["final_step"] == 2 and 0 <= run["final_acc"] <= 1
    assert [r["step"] for r in run["steps"]] == [1, 2] and "entropy" in run["steps"][0]
    assert run["hardware"][0]["to_step"] == 2 and run["hardware"][0]["cpu"]
    assert "| grpo | 1 | 2 |" in (tmp_path / "fig" / "table1.md").read_text()
    assert (tmp_path / "fig" / "payoff.png").stat().st_size > 10_000
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)  # finished runs are skipped
    assert again.returncode == 0 and again.stdout.count("done already") == 2
    bad = subprocess.run(cmd[:2] + ["--configs", "grpo,nope"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown config(s) ['nope']" in bad.stderr


def test_table1_pairs_by_seed():
    def runs(finals):
        return {str(s): {"final_acc": a, "best_acc": a, "start_acc": 0.2, "steps_done": 10, "entropy_first10": 0.5,
                         "entropy_last10": 0.4} for s, a in enumerate(finals)}
    table = study.table1({"grpo": runs([0.30, 0.40, 0.50]), "ce": runs([0.35, 0.46, 0.54])})
    mean, (lo, hi) = stats.mean_ci([0.05, 0.06, 0.04])
    assert f"| ce | 3 | 10 | 20.0 [20.0, 20.0] | 45.0 [" in table
    assert f"{100 * mean:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]" in table  # the paired difference, not the unpaired one
    assert "| grpo | 3 | 10 |" in table and table.count("| - |") == 1
