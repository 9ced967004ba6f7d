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
           "--log-samples-every", "0", "--sampler", "hf"]  # HF generate: the study's bookkeeping, not the engine, is tested
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
    longer = [("3" if a == "2" and cmd[i - 1] == "--steps" else a) for i, a in enumerate(cmd)] + ["--plot-only"]
    redrawn = subprocess.run(longer, cwd=ROOT, capture_output=True, text=True, timeout=300)  # a 3-step study: unfinished
    assert redrawn.returncode == 0, redrawn.stderr[-2000:]
    table = (tmp_path / "fig" / "table1.md").read_text()
    assert "| grpo |" not in table and "Not finished (left out above): grpo seed 0 (2 steps), ppo_clip seed 0 (2 steps)." in table
    assert "fewer than 2 seeds" in (tmp_path / "fig" / "verdicts.md").read_text()
    bad = subprocess.run(cmd[:2] + ["--configs", "grpo,nope"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown config(s) ['nope']" in bad.stderr
    missing = subprocess.run(cmd + ["--plot-only", "--mechanism", str(tmp_path / "none.json")], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode == 2 and "--mechanism: no such file" in missing.stderr


def test_table1_pairs_by_seed():
    def runs(finals):
        return {str(s): {"final_acc": a, "best_acc": a, "start_acc": 0.2, "steps_done": 10, "entropy_first10": 0.5,
                         "entropy_last10": 0.4} for s, a in enumerate(finals)}
    table = study.table1({"grpo": runs([0.30, 0.40, 0.50]), "ce": runs([0.35, 0.46, 0.54])})
    mean, (lo, hi) = stats.mean_ci([0.05, 0.06, 0.04])
    assert f"| ce | 3 | 10 | 20.0 [20.0, 20.0] | 45.0 [" in table
    assert f"{100 * mean:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]" in table  # the paired difference, not the unpaired one
    assert "| grpo | 3 | 10 |" in table and table.count("| - |") == 1


def test_verdicts_read_the_intervals_as_the_protocol_says():
    def run(final, first, last, entropy=None, od=None):
        steps = [{"step": t, "entropy": entropy(t) if entropy else last, **({"od_state": od(t)} if od else {})}
                 for t in range(1, 201)]
        return {"final_acc": final, "entropy_first10": first, "entropy_last10": last, "steps_done": 200, "steps": steps}

    grpo = {"0": run(0.50, 0.2, 0.10), "1": run(0.60, 0.2, 0.12), "2": run(0.70, 0.2, 0.11)}
    rise_fall = lambda t: 0.2 + 0.1 * (t <= 100) * t / 100 - 0.15 * (t > 100) * (t - 100) / 100  # noqa: E731
    study_dict = {
        "grpo": grpo,
        "ce_gppo_0.5_1": {"0": run(0.61, 0.2, 0.20), "1": run(0.70, 0.2, 0.21), "2": run(0.79, 0.2, 0.22)},  # +0.11, +0.10, +0.09
        "entropy_0.003": {"0": run(0.5, 0.2, 0.35), "1": run(0.5, 0.2, 0.31)},  # 0.33 / 0.2 = 1.65 > 1.5: explodes
        "grpo_dyn_id": {s: run(r["final_acc"], 0.2, 0.1, rise_fall) for s, r in grpo.items()},
        "grpo_dyn_did": {s: run(r["final_acc"] - 0.2, 0.2, 0.1) for s, r in grpo.items()},  # flat entropy, accuracy lost
        "grpo_dyn_od": {s: run(r["final_acc"], 0.2, 0.1, od=lambda t: int(t // 50) % 2) for s, r in grpo.items()},
    }
    text = study.verdicts(study_dict)
    row = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| ")}
    assert row["(0.5, 1) - grpo, final avg@k"].endswith("**holds** |")
    assert "| 3 | +10.0 [+7.5, +12.5] |" in row["(0.5, 1) - grpo, final avg@k"]
    assert row["(0.5, 1) - dapo, final avg@k"].endswith("**fewer than 2 seeds** |")
    assert row["(0.5, 1): last-10 - first-10 entropy"].endswith("**holds** |")  # entropy rose: stable
    assert row["grpo_dyn_did - grpo, final avg@k"].endswith("**does not hold** |")
    assert row["grpo_dyn_id - grpo, final avg@k"].endswith("**holds** |")  # equal accuracy is not a loss
    assert row["grpo_dyn_id - grpo, last-10 entropy"].endswith("**not resolved** |")
    assert row["entropy_0.003: mean last-10 / first-10 entropy"].endswith("1.65 | > 1.5 | **holds** |")
    lines = text.splitlines()
    assert any("grpo_dyn_id follows" in x and x.endswith("**holds** |") and "3 of 3 runs" in x for x in lines)
    assert any("grpo_dyn_did follows" in x and x.endswith("**does not hold** |") for x in lines)
    assert any("grpo_dyn_od oscillates" in x and "[4, 4, 4]" in x and x.endswith("**holds** |") for x in lines)
    assert study.best_dynamic(study_dict) == "grpo_dyn_id"  # ID and OD tie on accuracy: ID
    assert study.judge((3, -0.1, [-0.2, -0.01]), "above") == "reversed"


def test_step_vs_run_sets_the_one_step_signs_beside_the_runs():
    def runs(lasts):
        return {str(s): {"entropy_last10": e, "steps_done": 200} for s, e in enumerate(lasts)}

    study_dict = {"ppo_clip": runs([0.10, 0.11, 0.12]),
                  "up": runs([0.12, 0.13, 0.14]),         # +0.02 on every seed: resolved above 0
                  "down": runs([0.09, 0.12, 0.10]),       # -0.01, +0.01, -0.02: not resolved, mean below 0
                  "no_step": runs([0.2, 0.2, 0.2])}       # not in the one-step experiment: left out
    mechanism = {"up": {"dH_vs_ppo_mean": 1e-4, "dH_vs_ppo_ci95": [5e-5, 1.5e-4], "n": 30},
                 "down": {"dH_vs_ppo_mean": 2e-5, "dH_vs_ppo_ci95": [-1e-5, 5e-5], "n": 30},
                 "ppo_clip": {"dH_vs_ppo_mean": 0.0, "dH_vs_ppo_ci95": [0.0, 0.0], "n": 30}}
    table = study.step_vs_run(study_dict, mechanism)
    row = {line.split(" | ")[0][2:]: line for line in table.splitlines()[2:]}
    assert set(row) == {"up", "down"}
    assert "+0.00010 [+0.00005, +0.00015] (30)" in row["up"] and "+0.02000 [+0.02000, +0.02000] (3)" in row["up"]
    assert row["up"].endswith("| agree | yes |")
    assert row["down"].endswith("| differ | no |")  # one step raises (mean), the run ends lower (mean)
    assert study.step_vs_run(study_dict, {}) == ""
    assert "Does the one-step mechanism predict the run?" in study.verdicts(study_dict, mechanism)
