"""tools/study_stability.py and the statistics it adds to tools/stats.py: the fourth study's endpoints, families, the
dose's prediction and pages, on hand-made runs whose answers are known."""

import json
import math

import pytest

from tools import stats
from tools import study_stability as SS


def run(acc, final=0.8, dose=0.0, sha="abc", low_neg=None):
    """A run record as tools/study.py writes it: step 0's evaluation, 200 steps of training accuracy acc(step), the
    dose dose(step) (a number: every step alike), final avg@8 `final`; low_neg: the beta1 part's gradient norm (the
    rest's is 1)."""
    steps = [{"step": 0, "eval_acc": 0.4}]
    for s in range(1, SS.STEPS + 1):
        row = {"step": s, "acc_mean": acc(s), "reward_mean": 2 * acc(s) - 1, "entropy": 0.2,
               "beta1_dose": dose(s) if callable(dose) else dose}
        if low_neg is not None:
            row.update(grad_norm_low_neg=low_neg, grad_norm_rest=1.0)
        steps.append(row)
    steps[-1]["eval_acc"] = final
    return {"steps_done": SS.STEPS, "steps": steps, "model_sha256": sha}


def collapsed(at=40, dose=0.004):
    return run(lambda s: 0.0 if s >= at else 0.6, final=0.02, dose=dose)


def test_sign_flips_slope_and_auc_by_hand():
    """The sign-flip p counts the flips at least as extreme (8 positive differences: only themselves and their mirror,
    2 / 256); the slope's interval on 2 degrees of freedom follows the closed-form t tail 1 - t / sqrt(2 + t^2); the
    AUC counts ordered pairs, ties half, and its bootstrap interval repeats exactly from its seed."""
    assert stats.sign_flip_p([1, 2, 3, 4, 5, 6, 7, 8]) == 2 / 256
    assert stats.sign_flip_p([1, -1]) == 1.0
    assert stats.sign_flip_p([2, 1, -1]) == pytest.approx(6 / 8)  # |sums| 4, 2, 2, 0 and their mirrors
    with pytest.raises(ValueError):
        stats.sign_flip_p([])
    xs, ys = [1, 2, 3, 4], [2.0, 4.1, 5.9, 8.2]  # slope 10.2 / 5; residuals 0.01, 0.07, -0.17, 0.09
    slope, (lo, hi), p = stats.slope_ci(xs, ys)
    se = math.sqrt(0.042 / 2 / 5)
    t = slope / se
    assert slope == pytest.approx(2.04) and p == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-6)
    half = 4.302652729911275 * se  # t_{0.975, 2}
    assert (lo, hi) == pytest.approx((2.04 - half, 2.04 + half), rel=1e-6)
    with pytest.raises(ValueError):
        stats.slope_ci([1, 1, 1], [1, 2, 3])
    assert stats.auc([3, 4, 5], [1, 2, 3]) == pytest.approx(8.5 / 9)
    assert stats.auc([1], [1]) == 0.5
    ci = stats.auc_bootstrap_ci([3, 4, 5], [1, 2, 3], resamples=2000)
    assert ci == stats.auc_bootstrap_ci([3, 4, 5], [1, 2, 3], resamples=2000) and ci[0] < 8.5 / 9 <= ci[1] <= 1


def test_the_endpoints_of_one_run():
    """P2 is the lowest 10-step mean from step 11 on; the dose is the mean over steps 1-19 that logged one."""
    r = run(lambda s: 0.0 if 50 <= s < 60 else (0.5 if s < 11 else 1.0))
    assert SS.lowest_accuracy(r) == 0.0 and SS.endpoint(r, "P1") == 0.8
    r = run(lambda s: 0.2 if s <= 10 else 0.9)
    assert SS.lowest_accuracy(r) == pytest.approx(0.9)  # steps 1-10 are not P2's
    r = run(lambda s: 0.6, dose=lambda s: 0.001 * s)
    assert SS.dose_1_19(r) == pytest.approx(0.001 * 10)  # the mean of 1..19 thousandths
    for row in r["steps"][1:6]:
        del row["beta1_dose"]  # steps that trained nothing log no dose
    assert SS.dose_1_19(r) == pytest.approx(0.001 * sum(range(6, 20)) / 14)


def test_families_pair_within_a_block_and_holm_counts_both_endpoints(tmp_path):
    """(1, 1) collapses in 8 of 8 seeds against a control that learns: both endpoints hold after Holm over the family's
    10 tests; a pair whose runs started from different warm starts is no pair; a contrast without two pairs counts as
    p 1 and reads "too few pairs"."""
    healthy = {str(s): run(lambda s: 0.6, final=0.80 + 0.01 * s) for s in range(8)}
    study = {"_warm_start": {"sha256": "abc"}, "ppo_clip_tm": healthy,
             "ce_gppo_1_1": {str(s): collapsed(30 + s) for s in range(8)},
             "ce_gppo_0.5_1": {"0": collapsed(), "1": {**collapsed(), "model_sha256": "other"}}}
    rows = {(r["arm"], r["endpoint"]): r for r in SS.family_rows(study, SS.FAMILIES[0][1])}
    p1 = rows[("ce_gppo_1_1", "P1")]
    diffs = [0.02 - (0.80 + 0.01 * s) for s in range(8)]
    assert p1["n"] == 8 and p1["mean"] == pytest.approx(sum(diffs) / 8) and p1["verdict"] == "holds"
    assert p1["p"] == pytest.approx(stats.t_test_p(diffs)) and p1["flip_p"] == 2 / 256
    assert p1["holm"] == pytest.approx(9 * p1["p"])  # the second smallest of 10 (P2 has no spread: p 0): times 9
    assert rows[("ce_gppo_1_1", "P2")]["mean"] == pytest.approx(-0.6) and rows[("ce_gppo_1_1", "P2")]["verdict"] == \
        "holds"
    assert rows[("ce_gppo_0.5_1", "P1")]["n"] == 1 and rows[("ce_gppo_0.5_1", "P1")]["verdict"] == "too few pairs"
    path = tmp_path / "study.json"
    path.write_text(json.dumps(study))
    SS.report(str(path), str(tmp_path / "pages"))
    verdicts = (tmp_path / "pages" / "verdicts.md").read_text()
    assert "| `ce_gppo_1_1` | `ppo_clip_tm` | P2 | 8 | -60.0 [-60.0, -60.0] |" in verdicts
    assert "| `ce_gppo_1_1` | 8 | 8 [63%, 100%] | 30, 31, 32, 33, 34, 35, 36, 37 |" in \
        (tmp_path / "pages" / "arms.md").read_text()
    assert (tmp_path / "pages" / "curves.png").stat().st_size > 10_000


def test_what_sets_it_reads_the_slope_and_the_steps_contrast():
    """Deficits that grow with lr at 8 steps (-10, -20, -40 points at 5e-5, 1e-4, 2e-4, seed noise +-1) and none at 2
    steps with the same summed step: both of family 4's tests hold, so the reading is "both do"; with the 8-step
    deficits flat, only the steps contrast holds and the 2-step cell's own deficit is not shown: "the number of
    off-policy steps per batch sets it"."""
    def cell(arm, control, deficit):
        return {arm: {str(s): run(lambda _: 0.6, final=0.8 - deficit + 0.01 * (s % 2)) for s in range(8)},
                control: {str(s): run(lambda _: 0.6, final=0.8 + 0.003 * s) for s in range(8)}}

    def study(deficits):
        out = {}
        for (_, arm, control, _), deficit in zip(SS.CELLS, deficits):
            out.update(cell(arm, control, deficit))
        return out

    growing = study([0.40, 0.20, 0.10, 0.0])
    sets = SS.what_sets_it(growing)
    assert sets["slope_points"] == 24 and sets["slope"] == pytest.approx(-0.15, abs=0.01) and sets["slope_holds"]
    assert sets["steps_mean"] == pytest.approx(0.40, abs=0.01) and sets["steps_holds"]
    assert SS.reading(growing, sets) == "both do"
    flat = study([0.40, 0.40, 0.40, 0.0])
    assert SS.reading(flat, SS.what_sets_it(flat)) == \
        "the number of off-policy steps per batch sets it; the summed step size alone does not"


def test_the_dose_prediction_out_of_sample():
    """Runs above 0.13% that collapse and below it that do not: AUC 1 and both intervals of the rule above 50%; the
    runs it gets wrong are named; the controls (no beta1 region) are left out of the test."""
    study = {"ce_gppo_1_1": {str(s): collapsed(dose=0.003 + 0.0001 * s) for s in range(8)},
             "ce_gppo_0.5_1_lr5e-5": {str(s): run(lambda _: 0.6, dose=0.0005) for s in range(8)},
             "ppo_clip_tm": {str(s): run(lambda _: 0.6) for s in range(8)}}
    study["ce_gppo_0.5_1_lr5e-5"]["7"] = collapsed(dose=0.001)  # below the threshold, and collapsed: a miss
    p = SS.prediction(study, [a for a in study if a in SS.BETA1])
    assert (p["runs"], p["collapsed"], p["survived"]) == (16, 9, 7)
    assert p["auc"] == 1.0 and p["ranks"] and p["beta1_auc"] == pytest.approx((8 * 7 + 0.5 * 7) / 63)
    assert p["sensitivity"][:2] == (8, 9) and p["specificity"][:2] == (7, 7)
    [(arm, seed, dose, was_collapsed)] = p["wrong"]
    assert (arm, seed, was_collapsed) == ("ce_gppo_0.5_1_lr5e-5", "7", True) and dose == pytest.approx(0.001)
    assert p["rule_holds"] == (p["sensitivity"][2][0] > 0.5 and p["specificity"][2][0] > 0.5)
    assert SS.prediction({"ce_gppo_1_1": study["ce_gppo_1_1"]}, ["ce_gppo_1_1"]) == \
        {"runs": 8, "collapsed": 8, "survived": 0}  # one outcome only: no AUC


def test_the_mechanism_table_splits_runs_by_outcome():
    study = {"ce_gppo_1_1": {"0": {**collapsed(), "steps": [{**r, "grad_norm_low_neg": 0.5, "grad_norm_rest": 2.0}
                                                           for r in collapsed()["steps"]]},
                             "1": run(lambda s: 0.6, low_neg=0.1)}}
    rows = {(r["status"], r["window"]): r for r in SS.mechanism_rows(study, ["ce_gppo_1_1"])}
    assert rows[("collapsed", "steps 1-10")]["low_neg_share_of_rest"] == pytest.approx(0.25)
    assert rows[("did not collapse", "before onset")]["low_neg_share_of_rest"] == pytest.approx(0.1)
    assert rows[("collapsed", "before onset")]["beta1_dose"] == pytest.approx(0.004)


def test_the_command_line_refuses_bad_input_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        SS.main(["--json", str(tmp_path / "missing.json")])
    assert e.value.code == 2 and "missing.json" in capsys.readouterr().err


def test_lack_of_fit_separates_a_threshold_from_a_slope():
    """Three lrs with means 0, 0 and -0.5 (a threshold) and a spread of 0.01 within each: the line's lack of fit is
    large (F far above 1, p tiny); the same means on a line (0, -0.25, -0.5) fit it (F near 0)."""
    def points(means):
        xs, ys = [], []
        for x, m in zip((-3, -2, -1), means):
            for d in (-0.01, 0.0, 0.01):
                xs.append(x)
                ys.append(m + d)
        return xs, ys
    step = SS.lack_of_fit(*points((0.0, 0.0, -0.5)))
    line = SS.lack_of_fit(*points((0.0, -0.25, -0.5)))
    # the line through the means (0, 0, -0.5) misses them by -1/12, 1/6, -1/12: lack of fit 3 x 6/144 = 0.125 on 1
    # degree of freedom; pure error 3 x 2e-4 = 6e-4 on 6
    assert step["lof_df"] == (1, 6) and step["lof_f"] == pytest.approx(0.125 / (6e-4 / 6), rel=1e-9)
    assert step["lof_p"] < 1e-6 and line["lof_f"] == pytest.approx(0.0, abs=1e-9) and line["lof_p"] == pytest.approx(1)
    assert step["cell_means"] == {-3: pytest.approx(0.0), -2: pytest.approx(0.0), -1: pytest.approx(-0.5)}


def test_failed_runs_no_eos_collapse_and_one_pair_claims(tmp_path):
    """A run whose segment exited 1 is listed as failed; a run whose responses stop ending is a no-EOS collapse in the
    arms page while its accuracy holds; with one collapsed and one surviving run the dose's AUC is not testable (a
    bootstrap interval from one run of a class says nothing), never "ranks collapse"."""
    study = {"ce_gppo_1_1": {"0": collapsed(dose=0.004),
                             "1": {**run(lambda s: 0.6, dose=0.001),
                                   "hardware": [{"from_step": 0, "to_step": 200, "exit_code": 1}]}},
             "ce_gppo_0.5_1_ratio": {"0": run(lambda s: 0.6)}}
    for row in study["ce_gppo_0.5_1_ratio"]["0"]["steps"][1:]:
        row["truncated_frac"] = 0.9 if row["step"] >= 96 else 0.0
    path = tmp_path / "study.json"
    path.write_text(json.dumps(study))
    SS.report(str(path), str(tmp_path / "pages"))
    arms = (tmp_path / "pages" / "arms.md").read_text()
    assert "`ce_gppo_1_1` seed 1, steps 0-200: exit code 1" in arms
    assert "| `ce_gppo_0.5_1_ratio` | 1 | 0 [0%, 98%] | - | n/a | 60.0 | 0.000% | 1 | 92 |" in arms  # [0, 0.975]
    dose = (tmp_path / "pages" / "dose.md").read_text()
    assert "not testable" in dose and "ranks collapse" not in dose


@pytest.mark.parametrize("change, message", [
    (lambda r: r["steps"][5].update(beta1_dose=float("nan")), "beta1_dose is not a number (nan)"),
    (lambda r: r["steps"][5].update(beta1_dose="0.001"), "beta1_dose is not a number ('0.001')"),
    (lambda r: r["steps"][-1].update(eval_acc=1.5), "eval_acc is 1.5, not a share in [0, 1]"),
    (lambda r: r["steps"][-1].update(eval_acc=float("nan")), "eval_acc is not a number (nan)"),
])
def test_values_the_pages_cannot_read_are_one_line(tmp_path, capsys, change, message):
    """A value no run logs (a NaN, text, an accuracy above 1) and an arm of 21 seeds (an exact sign-flip test lists
    2^n flips) end in one line and exit code 2 before a page is written, never a traceback."""
    study = {"ce_gppo_1_1": {str(s): run(lambda _: 0.6) for s in range(3)}}
    change(study["ce_gppo_1_1"]["1"])
    path = tmp_path / "study.json"
    path.write_text(json.dumps(study))
    with pytest.raises(SystemExit) as e:
        SS.main(["--json", str(path), "--figures", str(tmp_path / "pages")])
    assert e.value.code == 2 and message in capsys.readouterr().err and not (tmp_path / "pages").exists()
    path.write_text(json.dumps({"ce_gppo_1_1": {str(s): run(lambda _: 0.6) for s in range(21)}}))
    with pytest.raises(SystemExit) as e:
        SS.main(["--json", str(path), "--figures", str(tmp_path / "pages")])
    assert e.value.code == 2 and "has 21 seeds; the readers take at most 20" in capsys.readouterr().err
