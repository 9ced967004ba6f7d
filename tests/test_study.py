"""tools/study.py: a 2-step study end to end (two configurations, one seed), its JSON, Table-1 analog and figures;
and the table's paired intervals on hand-made runs."""

import json
import os
import sys

import pytest
import warm
from conftest import ROOT, few_problems

from tools import stats, study


@pytest.mark.slow
def test_a_two_step_study_runs_resumes_and_reports(tmp_path, tiny_model_path):
    cmd = [sys.executable, "-m", "tools.study", "--preset", "tiny", "--steps", "2", "--seeds", "0",
           "--configs", "grpo,ppo_clip",
           "--root", str(tmp_path / "runs"), "--json", str(tmp_path / "study.json"), "--figures", str(tmp_path / "fig"),
           "--eval-every", "2", "--no-eval-before-train", "--gen-prompts", "8", "--n", "4", "--mini-batch-prompts", "4",
           "--micro-batch-size", "8",
           # HF generate: the study's bookkeeping, not the engine, is tested
           "--log-samples-every", "0", "--sampler", "hf",
           "--eval-data", str(few_problems(tmp_path, 8))]  # and 8 held-out problems, not the task's 210
    done = warm.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "study.json").read_text())
    from cegppo_utils import models
    assert sorted(study.configurations(data)) == ["grpo", "ppo_clip"] and list(data["grpo"]) == ["0"]
    assert data[study.WARM_START] == {"sha256": models.weights_hash(tiny_model_path)}  # what every run started from
    run = data["grpo"]["0"]
    assert run["model_sha256"] == data[study.WARM_START]["sha256"]
    assert run["steps_done"] == 2 and run["final_step"] == 2 and 0 <= run["final_acc"] <= 1
    assert [r["step"] for r in run["steps"]] == [1, 2] and "entropy" in run["steps"][0]
    assert run["hardware"][0]["to_step"] == 2 and run["hardware"][0]["cpu"]
    assert len(run["hardware"]) == 1 and run["hardware"][0]["exit_code"] == 0 and run["hardware"][0]["from_step"] == 0
    assert [r["step"] for r in data["ppo_clip"]["0"]["steps"]] == [1, 2]  # one row per step
    assert "| grpo | 1 | 2 |" in (tmp_path / "fig" / "table1.md").read_text()
    assert (tmp_path / "fig" / "payoff.png").stat().st_size > 10_000
    again = warm.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)  # finished runs are skipped
    assert again.returncode == 0 and again.stdout.count("done already") == 2
    longer = [("3" if a == "2" and cmd[i - 1] == "--steps" else a) for i, a in enumerate(cmd)] + ["--plot-only"]
    # a 3-step study: unfinished
    redrawn = warm.run(longer, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert redrawn.returncode == 0, redrawn.stderr[-2000:]
    table = (tmp_path / "fig" / "table1.md").read_text()
    assert ("| grpo |" not in table
            and "Not finished (left out above): grpo seed 0 (2 steps), ppo_clip seed 0 (2 steps)." in table)
    assert "fewer than 2 seeds" in (tmp_path / "fig" / "verdicts.md").read_text()
    bad = warm.run(cmd[:3] + ["--configs", "grpo,nope"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown config(s) ['nope']" in bad.stderr
    missing = warm.run(cmd + ["--plot-only", "--mechanism", str(tmp_path / "none.json")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "--mechanism: no such file" in missing.stderr


def test_table1_pairs_by_seed():
    def runs(finals):
        return {str(s): {"final_acc": a, "best_acc": a, "start_acc": 0.2, "steps_done": 10, "entropy_first10": 0.5,
                         "entropy_last10": 0.4} for s, a in enumerate(finals)}
    table = study.table1({"grpo": runs([0.30, 0.40, 0.50]), "ce": runs([0.35, 0.46, 0.54])})
    mean, (lo, hi) = stats.mean_ci([0.05, 0.06, 0.04])
    assert "| ce | 3 | 10 | 20.0 [20.0, 20.0] | 45.0 [" in table
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
        # +0.11, +0.10, +0.09
        "ce_gppo_0.5_1": {"0": run(0.61, 0.2, 0.20), "1": run(0.70, 0.2, 0.21), "2": run(0.79, 0.2, 0.22)},
        "entropy_0.003": {"0": run(0.5, 0.2, 0.35), "1": run(0.5, 0.2, 0.31)},  # 0.33 / 0.2 = 1.65 > 1.5: explodes
        "grpo_dyn_id": {s: run(r["final_acc"], 0.2, 0.1, rise_fall) for s, r in grpo.items()},
        # flat entropy, accuracy lost
        "grpo_dyn_did": {s: run(r["final_acc"] - 0.2, 0.2, 0.1) for s, r in grpo.items()},
        "grpo_dyn_od": {s: run(r["final_acc"], 0.2, 0.1, od=lambda t: int(t // 50) % 2) for s, r in grpo.items()},
    }
    text = study.verdicts(study_dict)
    row = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| ")}
    assert row["(0.5, 1) - grpo, final avg@k"].endswith("**holds** |")
    assert "| 3 | +10.0 [+7.5, +12.5] |" in row["(0.5, 1) - grpo, final avg@k"]
    assert row["(0.5, 1) - dapo, final avg@k"].endswith("**fewer than 2 seeds** |")
    assert row["(0.5, 1): last-10 - first-10 entropy"].endswith("**holds** |")  # entropy rose: stable
    assert row["grpo_dyn_did - grpo, final avg@k"].endswith("**does not hold** |")
    assert row["grpo_dyn_id - grpo, final avg@k"].endswith("**no loss detected, none excluded** |")  # equal accuracy
    assert row["grpo_dyn_id - grpo, last-10 entropy"].endswith("**not resolved** |")
    assert row["entropy_0.003: mean last-10 / first-10 entropy"].endswith("1.65 | > 1.5 | **holds** |")
    lines = text.splitlines()
    assert any("grpo_dyn_id follows" in x and x.endswith("**holds** |") and "3 of 3 runs" in x for x in lines)
    assert any("grpo_dyn_did follows" in x and x.endswith("**shape not seen** |") for x in lines)
    assert any("grpo_dyn_od oscillates" in x and "[4, 4, 4]" in x and x.endswith("**holds** |") for x in lines)
    assert study.best_dynamic(study_dict) == "grpo_dyn_id"  # ID and OD tie on accuracy: ID
    flat = dict(study_dict, grpo_dyn_od={s: run(0.5, 0.2, 0.1, od=lambda t: 0) for s in "012"},
                **{"entropy_0.003": {"0": run(0.5, 0.2, 0.15)}})
    lines = study.verdicts(flat).splitlines()
    assert any("grpo_dyn_od oscillates" in x and x.endswith("**not exercised (it never switched)** |") for x in lines)
    assert any("bonus of 0.003 explodes" in x and "not a test of" in x and x.endswith("**not seen** |") for x in lines)
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


# --- intervals, power, and the multiple-comparison arithmetic -------------------------------------------------------

def test_accuracy_intervals_stay_within_0_and_1_and_the_power_arithmetic_matches_scipy():
    skewed = [0.96, 0.95, 0.87]  # finals near a ceiling are left-skewed: the plain t-interval passes 1
    assert stats.mean_ci(skewed)[1][1] > 1
    mean, (lo, hi) = stats.logit_mean_ci(skewed)
    assert mean == pytest.approx(sum(skewed) / 3) and 0 < lo < mean < hi < 1
    assert stats.logit_mean_ci([0.2, 0.2])[1] == pytest.approx([0.2, 0.2])
    assert stats.logit_mean_ci([1.0, 1.0, 0.99])[1][1] < 1
    # reference values computed once with scipy.stats (nct, t), hard-coded so the check does not repeat stats.py
    assert stats.t_cdf(2.776, 4) == pytest.approx(0.974989, abs=1e-5)
    assert stats.t_test_p([1.0, 2.0, 3.0]) == pytest.approx(0.074180, abs=1e-5)
    assert stats.paired_power(2.0, 2.2, 5) == pytest.approx(0.344839, abs=1e-5)
    assert stats.paired_power(3.0, 2.2, 2) == pytest.approx(0.121554, abs=1e-5)
    assert stats.paired_power(0.0, 2.2, 5) == pytest.approx(0.05, abs=1e-6)
    assert stats.min_detectable(2.227, 5) == pytest.approx(3.746, abs=0.01)
    assert stats.holm([0.01, 0.04, 0.03]) == [True, False, False]
    assert study.chance_of_at_least(2, 14) == pytest.approx(0.1530, abs=1e-4)


def test_table1_names_its_seeds_and_reads_its_intervals():
    def runs(finals):
        return {str(s): {"final_acc": a, "best_acc": a, "start_acc": 0.5, "steps_done": 10, "entropy_first10": 0.5,
                         "entropy_last10": 0.4} for s, a in enumerate(finals)}
    grpo, cispo = runs([0.95, 0.96, 0.94]), runs([0.99, 0.995, 0.80])
    cispo["1"]["final_acc"] = None  # a run without its final evaluation: its cells average seeds 0 and 2
    table = study.table1({"grpo": grpo, "cispo": cispo, "dapo": runs([0.90, 0.92, 0.91])})
    row = next(line for line in table.splitlines() if line.startswith("| cispo |"))
    assert row.endswith("| 0-2 |") and "(seeds 0, 2)" in row.split(" | ")[4] and "(seeds 0, 2)" in row.split(" | ")[6]
    assert "(seeds" not in row.split(" | ")[5]  # the best column has all three
    hi = float(row.split(" | ")[4].split(", ")[1].split("]")[0])
    assert hi <= 100.0  # the logit interval of 99.0 and 80.0 stays below 100%
    prose = " ".join(table.split())  # the notes are wrapped at 120 characters
    assert "logit scale" in prose and "the paired column holds 2 comparisons with grpo" in prose
    assert "at least 2 would with probability 0.00" in prose and "Excluding 0: dapo (p = " in prose


# --- bookkeeping: duplicated rows, hardware segments, refused runs, missing evaluations --------------------------

def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_step_logged_twice_is_read_once_keeping_the_last_and_the_json_is_not_rewritten(tmp_path):
    rows = [{"step": 0, "eval_acc": 0.4}, {"step": 1, "reward_mean": 0.1}, {"step": 0, "eval_acc": 0.5}]
    assert study.dedupe_steps(rows) == [{"step": 0, "eval_acc": 0.5}, {"step": 1, "reward_mean": 0.1}]
    path = tmp_path / "study.json"
    path.write_text(json.dumps({"grpo": {"0": {"steps_done": 1, "steps": rows}}}))
    before = path.read_bytes()
    data = study.collect(str(path), str(tmp_path / "runs"), ["grpo"], [0])  # no run folder: nothing to record
    assert [r["step"] for r in data["grpo"]["0"]["steps"]] == [0, 1] and path.read_bytes() == before


def test_a_study_stored_gzipd_reads_as_its_plain_json_and_collect_keeps_it_packed(tmp_path):
    """The committed studies are .json.gz: load_study reads one as the plain JSON reads (here the second study's
    block B, unpacked by the gzip module), the writer packs the same JSON to the same bytes (mtime 0, no file name),
    and collect rewrites a packed study packed, found under either name (study_json.stored)."""
    import gzip

    from cegppo_utils import runfolder
    from tools import study_json
    packed = os.path.join(ROOT, "docs", "figures", "study-merge-active-b.json.gz")
    plain = tmp_path / "study-merge-active-b.json"
    plain.write_bytes(gzip.decompress(open(packed, "rb").read()))
    committed = study_json.load_study(packed)
    assert committed == study_json.load_study(str(plain)) and len(committed["grpo"]) >= 4
    path = tmp_path / "study.json.gz"
    text = json.dumps({"grpo": {"0": {"steps_done": 1, "steps": [{"step": 1, "eval_acc": 0.5}]}}})
    runfolder.write_text_atomically(str(path), text)
    first = path.read_bytes()
    runfolder.write_text_atomically(str(path), text)
    assert path.read_bytes() == first and gzip.decompress(first) == text.encode()
    assert first[:10] == b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"  # no flags (no file name), mtime 0
    assert study_json.stored(str(tmp_path / "study.json")) == str(path)  # an older command's plain name finds it
    write_jsonl(tmp_path / "runs" / "grpo-s1" / "metrics.jsonl", [{"step": 1, "reward_mean": 0.25}])
    study.collect(str(path), str(tmp_path / "runs"), ["grpo"], [0, 1])
    assert json.loads(gzip.decompress(path.read_bytes()))["grpo"]["1"]["steps_done"] == 1
    assert not (tmp_path / "study.json").exists()


def test_a_resume_without_a_checkpoint_sets_the_old_rows_aside_so_step_0_is_logged_once(tmp_path):
    out = tmp_path / "run"
    write_jsonl(out / "metrics.jsonl",
                [{"step": 0, "eval_acc": 0.5}] + [{"step": s, "reward_mean": 0.0} for s in range(1, 17)])
    assert study.prepare_resume(str(out), log=lambda line: None) == (0, 16)
    assert ((out / "metrics.jsonl").read_text() == ""
            and len((out / "metrics.discarded.jsonl").read_text().splitlines()) == 17)
    other = tmp_path / "other"  # with a checkpoint, train.py --resume keeps the rows up to it: nothing is moved here
    write_jsonl(other / "metrics.jsonl", [{"step": s, "reward_mean": 0.0} for s in range(1, 38)])
    (other / "checkpoints" / "step_25").mkdir(parents=True)
    assert study.prepare_resume(str(other)) == (25, 37)
    assert len((other / "metrics.jsonl").read_text().splitlines()) == 37


def test_every_hardware_segment_is_kept_an_interrupted_one_included(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"flags": {}}))  # a run folder, as train.py leaves it
    (out / ".ce-gppo-run").write_text("{}")
    study.open_segment(str(out), 2, 0, None)  # a study killed while this segment ran: never closed
    assert [(s["from_step"], s["to_step"], s["interrupted"])
            for s in study.hardware_segments(str(out), [{"step": 16}])] == [(0, 16, True)]
    study.open_segment(str(out), 2, 25, 37)   # the resume, from the checkpoint at 25, after 37 steps were logged
    study.close_segment(str(out), 200, 12.34, 0)
    segments = study.hardware_segments(str(out), [{"step": 200}])
    assert ([(s["from_step"], s["to_step"], s.get("interrupted", False)) for s in segments]
            == [(0, 37, True), (25, 200, False)])
    assert segments[1]["exit_code"] == 0 and segments[1]["seconds"] == 12.3 and segments[0]["cpu"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # the note beside the folder is gone
    fresh = tmp_path / "fresh"  # train.py failed before making the folder a run: nothing is written into it
    study.open_segment(str(fresh), 2, 0, None)
    study.close_segment(str(fresh), 0, 1.0, 2)
    assert not fresh.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_segment_is_never_appended_through_a_link_planted_in_the_run(tmp_path, monkeypatch, capsys):
    """Issue 59: train.py refuses a run folder whose hardware.jsonl is a link (exit 2), and close_segment still
    appended to the link's target. The append refuses it as train.py does, and the study refuses the folder before any
    run starts."""
    from cegppo_utils.data import UserError
    out = tmp_path / "runs" / "tiny" / "grpo-s0"
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"flags": {"max_steps": 4}}))
    (out / ".ce-gppo-run").write_text("{}")
    mine = tmp_path / "mine.txt"
    mine.write_text("a user's file\n")
    os.symlink(mine, out / "hardware.jsonl")
    study.open_segment(str(out), 1, 0, None)
    with pytest.raises(UserError, match="hardware.jsonl is a symbolic link; refusing to follow it"):
        study.close_segment(str(out), 2, 1.0, 2)
    assert mine.read_text() == "a user's file\n"
    monkeypatch.setattr(study, "run_one", lambda *a, **k: pytest.fail("a run started"))
    monkeypatch.setattr(sys, "argv", ["study.py", "--preset", "tiny", "--configs", "grpo", "--seeds", "0", "--steps",
                                      "4", "--root", str(tmp_path / "runs"), "--json", str(tmp_path / "study.json")])
    with pytest.raises(SystemExit) as stop:
        study.main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith(
        f"study.py: error: grpo seed 0: refused ({out}): --output-dir {out}: {out}/hardware.jsonl is a symbolic link")
    assert mine.read_text() == "a user's file\n"


def test_a_run_whose_log_is_shorter_than_its_checkpoints_is_refused_and_the_record_kept(tmp_path):
    root, path = tmp_path / "runs", tmp_path / "study.json"
    good = {"steps_done": 200, "final_acc": 0.95, "steps": [{"step": 200, "eval_acc": 0.95}]}
    path.write_text(json.dumps({"grpo": {"0": good}}))
    short = root / "grpo-s0"
    write_jsonl(short / "metrics.jsonl", [{"step": s, "reward_mean": 0.0, "entropy": 0.2} for s in range(1, 11)])
    (short / "checkpoints" / "step_25").mkdir(parents=True)
    missing = root / "grpo-s1"
    (missing / "checkpoints" / "step_50").mkdir(parents=True)
    lines = []
    data = study.collect(str(path), str(root), ["grpo"], [0, 1], log=lines.append)
    assert data["grpo"] == {"0": good} and json.loads(path.read_text())["grpo"] == {"0": good}
    assert lines == [f"[study] grpo seed 0: not recorded ({short}): metrics.jsonl ends at step 10, but the run reached "
                     "step 25",
                     f"[study] grpo seed 1: not recorded ({missing}): metrics.jsonl is missing or empty, but the run "
                     "reached step 50"]
    assert study.refusal(str(short), resuming=True)  # 10 < 25 - 1: not the row runfolder.restore_row puts back
    write_jsonl(short / "metrics.jsonl", [{"step": s, "reward_mean": 0.0} for s in range(1, 25)])
    assert study.refusal(str(short), resuming=True) is None and study.refusal(str(short))
    write_jsonl(short / "metrics.jsonl", [{"step": s, "reward_mean": 0.0} for s in range(1, 31) if s != 7])
    assert "lacks 1 step(s) between 1 and 30 (the first: 7)" in study.refusal(str(short))


def test_planned_evaluations_that_are_missing_are_named():
    assert study.planned_evaluations(200, 25, True) == [0, 25, 50, 75, 100, 125, 150, 175, 200]
    assert study.planned_evaluations(60, 25, False) == [25, 50, 60]
    evals = lambda steps: [{"step": s, "eval_acc": 0.5} for s in steps]  # noqa: E731
    data = {"entropy_0.001": {"0": {"steps_done": 200, "steps": evals(range(0, 201, 25))},
                              "1": {"steps_done": 200, "steps": evals([0, 50, 75, 100, 125, 150, 175, 200])}}}
    assert study.missing_evaluations(data, 25, True) == ["entropy_0.001 seed 1: step 25"]


# --- the command line: study.py's own flags and bad input, one line before any run ----------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0,1", "--seed", "7"], "--seed is set by study.py for every run (use --seeds)"),
    (["--max_steps=5"], "--max-steps is set by study.py for every run (use --steps)"),
    (["--output-dir", "elsewhere"], "--output-dir is set by study.py"),
    (["--save-every", "5"], "--save-every is set by study.py for every run; it cannot be passed through"),
    (["--seeds", "a,b"], "--seeds 'a,b': expected comma-separated integers"),
    (["--configs", "grpo,nope"], "unknown config(s) ['nope']"),
    (["--steps", "0"], "--steps 0: must be >= 1"),
    (["--steps", "x"], "argument --steps: invalid int value"),
    (["--parallel", "100000"], "--parallel 100000 needs as many cores; this process may use"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_run(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["study.py", "--preset", "tiny", "--root", str(tmp_path / "runs"),
                                      "--json", str(tmp_path / "study.json"), *argv])
    with pytest.raises(SystemExit) as stop:
        study.main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "study.json").exists()


def test_bad_paths_and_a_deleted_log_are_one_line_and_exit_2_before_any_run(tmp_path, monkeypatch, capsys):
    """Issue 48: --json naming a folder or holding garbage, --figures naming a file, --root naming a file, and a resume
    whose run lost its metrics.jsonl: each one line, exit 2, before any run (run_one is never called)."""
    monkeypatch.setattr(study, "run_one", lambda *a, **k: pytest.fail("a run started"))
    (tmp_path / "folder.json").mkdir()
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "a_file").write_text("x")
    lost = tmp_path / "runs" / "tiny" / "grpo-s0"  # a run with a checkpoint whose metrics.jsonl was deleted
    (lost / "checkpoints" / "step_000002").mkdir(parents=True)
    (lost / "config.json").write_text(json.dumps({"flags": {"max_steps": 4}}))
    (lost / ".ce-gppo-run").write_text("{}")
    base = ["study.py", "--preset", "tiny", "--configs", "grpo", "--seeds", "0", "--steps", "4"]
    runs, good_json = ["--root", str(tmp_path / "runs")], ["--json", str(tmp_path / "study.json")]
    cases = [
        (runs + ["--json", str(tmp_path / "folder.json")], f"--json {tmp_path}/folder.json is a folder"),
        (runs + ["--json", str(tmp_path / "garbage.json")], f"--json {tmp_path}/garbage.json: not a study's JSON"),
        (runs + ["--json", str(tmp_path / "list.json")], f"--json {tmp_path}/list.json: not a study's JSON"),
        (runs + good_json + ["--plot-only", "--figures", str(tmp_path / "a_file")],
         f"--figures {tmp_path}/a_file is a file"),
        (good_json + ["--root", str(tmp_path / "a_file")], f"--root {tmp_path}/a_file is a file"),
        (runs + good_json, f"grpo seed 0: refused ({lost}): metrics.jsonl is missing or empty, but the run reached "
                           "step 2"),
    ]
    for argv, message in cases:
        monkeypatch.setattr(sys, "argv", base + argv)
        with pytest.raises(SystemExit) as stop:
            study.main()
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert not (tmp_path / "study.json").exists() and sorted(p.name for p in tmp_path.iterdir()) == \
        ["a_file", "folder.json", "garbage.json", "list.json", "runs"]


# --- what the study could detect ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_detectability_pools_the_paired_sd_and_carries_the_papers_gains(tmp_path):
    def runs(finals):
        steps = [{"step": s, **{k: 0.001 for k in study.REGIONS}} for s in range(1, 21)]
        return {str(s): {"final_acc": a, "steps_done": 20, "steps": steps} for s, a in enumerate(finals)}
    data = {"grpo": runs([0.95, 0.94, 0.96, 0.95, 0.94]), "dapo": runs([0.94, 0.95, 0.94, 0.93, 0.95]),
            "cispo": runs([0.93, 0.92, 0.95])}
    text, numbers = study.detectability(data)
    d5, d3 = [-1.0, 1.0, -2.0, -2.0, 1.0], [-2.0, -2.0, -1.0]
    var = lambda v: sum((x - sum(v) / len(v)) ** 2 for x in v)  # noqa: E731
    pooled = ((var(d5) + var(d3)) / 6) ** 0.5
    assert numbers["main_sd"] == pytest.approx(pooled)
    assert f"| all 2 of the protocol's | {pooled:.2f} | 6 |" in text
    assert f"| 5 | {stats.min_detectable((var(d5) / 4) ** 0.5, 5):.1f} |" in text
    # 11.3% of grpo's 5.2-point error
    assert "| grpo | +5.74 | cut of the average error | 11.3% | 5.2 | +0.59 |" in text
    assert "| dapo | 0.100 | 0.100 | 0.400 | 0.100 / 0.100 |" in text  # per-step shares, in %
    assert "A null result here was expected" in " ".join(text.split())
    assert all(len(line) <= 120 for line in text.splitlines() if not line.startswith("|"))
    assert study.draw_detectability(numbers, str(tmp_path / "d.png")) and (tmp_path / "d.png").stat().st_size > 10_000
    assert study.detectability({"grpo": data["grpo"]}) == ("", {})


def test_verdicts_mark_the_rules_the_protocol_did_not_state():
    text = study.verdicts({})
    row = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| ")}
    assert "added: the protocol states no rule" in row["entropy_0.001: last-10 - first-10 entropy"]
    assert "changes both betas at once" in row["(1, 0.5) - (0.5, 1)"]
    assert "added" in row["(1, 0.5) - (0.5, 1), final avg@k"] and "added" not in row["(0.5, 1) - grpo, final avg@k"]


def test_a_warm_start_with_another_hash_stops_the_study(tmp_path, tiny_model_path):
    """The study's JSON records the weights its runs started from; a cached warm start with another hash (rebuilt
    on a machine with another instruction set, say) stops the study in one line before any run."""
    from cegppo_utils import models
    from tools import study
    have = models.weights_hash(tiny_model_path)
    assert study.check_warm_start({}, tiny_model_path, "s.json") == have  # a new study: recorded at collect
    assert study.check_warm_start({study.WARM_START: {"sha256": have}}, tiny_model_path, "s.json") == have
    with pytest.raises(SystemExit) as stopped:
        study.check_warm_start({study.WARM_START: {"sha256": "0" * 16, "machine": "AMD EPYC, AVX2"}}, tiny_model_path,
                               "s.json")
    assert str(stopped.value).startswith(f"study.py: error: the warm start {tiny_model_path} has weights hash {have}, "
                                         "but the runs of s.json started from 0000000000000000 (AMD EPYC, AVX2)")
    runs = {"grpo": {"0": {"steps_done": 2}}, study.WARM_START: {"sha256": have}, study.SUPERSEDED: {"grpo": {}}}
    assert list(study.configurations(runs)) == ["grpo"]  # neither key is tabulated as a configuration


def test_parallel_runs_get_disjoint_cores(monkeypatch):
    """--parallel N pins each run at once to its own share of the cores this process may use (never two runs on one
    core), and refuses more runs at once than cores."""
    monkeypatch.setattr(study.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    assert study.core_groups(1) == [[0, 1, 2, 3, 5]]
    assert study.core_groups(2) == [[0, 1], [2, 3]]
    assert study.core_groups(5) == [[0], [1], [2], [3], [5]]
    from cegppo_utils.data import UserError
    with pytest.raises(UserError, match="^--parallel 6 needs as many cores; this process may use 5$"):
        study.core_groups(6)


def test_the_figures_are_never_written_through_a_link(tmp_path):
    """Issue 59: savefig follows a link planted at a figure's name; each figure replaces the link, its target kept."""
    steps = [{"step": t, "reward_mean": 0.0, "entropy": 0.2, "eval_acc": 0.5} for t in range(1, 5)]
    runs = {"grpo": {"0": {"steps_done": 4, "steps": steps}, "1": {"steps_done": 4, "steps": steps}}}
    mine = tmp_path / "mine.txt"
    mine.write_text("a user's file\n")
    os.symlink(mine, tmp_path / "payoff.png")
    written = study.draw_figures(runs, str(tmp_path))
    assert str(tmp_path / "payoff.png") in written and mine.read_text() == "a user's file\n"
    assert (tmp_path / "payoff.png").read_bytes()[:4] == b"\x89PNG"


def a_study(tmp_path) -> str:
    """A study's JSON of one finished run, with every key run_record writes."""
    steps = [{"step": t, "reward_mean": 0.0, "entropy": 0.2, "eval_acc": 0.5} for t in range(1, 5)]
    run = {"steps_done": 4, "start_acc": 0.4, "final_acc": 0.5, "best_acc": 0.5, "entropy_first10": 0.2,
           "entropy_last10": 0.2, "steps": steps}
    path = tmp_path / "study.json"
    path.write_text(json.dumps({"grpo": {"0": run}}))
    return str(path)


def refused(argv, monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", ["study.py", *argv])
    with pytest.raises(SystemExit) as stop:
        study.main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_the_one_step_experiments_json_is_checked_before_the_report_where_it_exists(tmp_path, monkeypatch, capsys):
    """The default --mechanism (docs/figures/mechanism-<preset>-warm.json) was read unchecked after table1.md was
    written: a damaged one is refused first, as a damaged --mechanism is, and nothing is written."""
    monkeypatch.setattr(study, "ROOT", str(tmp_path))
    default = tmp_path / "docs" / "figures" / "mechanism-tiny-warm.json"
    default.parent.mkdir(parents=True)
    default.write_text('{"grpo": ')
    base = ["--preset", "tiny", "--steps", "4", "--configs", "grpo", "--seeds", "0", "--plot-only", "--root",
            str(tmp_path / "runs"), "--json", a_study(tmp_path), "--figures", str(tmp_path / "fig")]
    assert refused(base, monkeypatch, capsys) == (f"study.py: error: --mechanism {default}: not a JSON object "
                                                  "(JSONDecodeError: Expecting value: line 1 column 10 (char 9))")
    (tmp_path / "list.json").write_text("[1]")
    assert refused(base + ["--mechanism", str(tmp_path / "list.json")], monkeypatch, capsys) == (
        f"study.py: error: --mechanism {tmp_path}/list.json: not a JSON object (it holds a list)")
    assert not (tmp_path / "fig").exists()
    default.write_text(json.dumps({"grpo": {}}))  # a good one is read: the report is written
    monkeypatch.setattr(study, "draw_figures", lambda finished, figures: [])
    monkeypatch.setattr(sys, "argv", ["study.py", *base])
    study.main()
    assert "| grpo | 1 | 4 |" in (tmp_path / "fig" / "table1.md").read_text()


@pytest.mark.parametrize("preset, name", [("tiny", "table1.md"), ("tiny", "payoff.png"),
                                          ("merge-active", "regime.md")])
def test_a_folder_at_a_reports_file_name_is_refused_before_any_run(tmp_path, monkeypatch, capsys, preset, name):
    """Each file the report writes replaces its name whole (os.replace): a folder there would stop the study after
    its runs. study_active's report writes the merge-active study's files."""
    (tmp_path / "fig" / name).mkdir(parents=True)
    argv = ["--preset", preset, "--steps", "4", "--configs", "grpo", "--seeds", "0", "--plot-only", "--root",
            str(tmp_path / "runs"), "--json", a_study(tmp_path), "--figures", str(tmp_path / "fig")]
    assert refused(argv, monkeypatch, capsys) == (f"study.py: error: --figures {tmp_path}/fig: {name} in it is a "
                                                  "folder; move it aside")
    assert os.listdir(tmp_path / "fig") == [name]


def test_a_study_is_stored_at_float32s_digits_and_storing_it_again_changes_nothing():
    """compact keeps 9 significant digits, which give back every float32 exactly (the runs' metrics are float32),
    and 4 of the wall-clock readings; the committed studies are already stored so (compact(study) == study)."""
    import numpy as np

    from tools import study_json
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(1000) * 10.0 ** rng.integers(-6, 4, 1000)).astype(np.float32)
    for value in values:
        assert np.float32(study_json.compact(float(value))) == value
    record = {"final_acc": 0.1234567891234, "steps": [{"time_update_s": 12.345678, "kl": 1e-12 / 3, "eos": None}]}
    assert study_json.compact(record) == {"final_acc": 0.123456789,
                                          "steps": [{"time_update_s": 12.35, "kl": 3.33333333e-13, "eos": None}]}
    assert study_json.compact(float("nan")) != study_json.compact(float("nan"))  # NaN kept as NaN
    committed = study_json.load_study(os.path.join(ROOT, "docs", "figures", "study-merge-active.json.gz"))
    assert study_json.compact(committed) == committed
