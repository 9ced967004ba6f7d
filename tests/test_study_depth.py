"""tools/study_depth.py, the fifth study's reader, on hand-made runs whose answers are known: the truncation endpoint,
each family's reading, and the pages (committed and passing before the study's first run)."""

import json
import os

import pytest

from tools import study_depth as SD
from tools.configs import DEPTH_CELLS


def run(acc=0.6, final=0.8, entropy=0.2, truncated=0.0, sha="abc", hardware=None):
    """A run record as tools/study.py writes it: step 0's evaluation, 200 training steps whose accuracy, entropy and
    truncated share are the given numbers or functions of the step, final avg@8 `final`."""
    def at(x, s):
        return x(s) if callable(x) else x
    steps = [{"step": 0, "eval_acc": 0.4}]
    for s in range(1, SD.STEPS + 1):
        steps.append({"step": s, "acc_mean": at(acc, s), "reward_mean": 2 * at(acc, s) - 1,
                      "entropy": at(entropy, s), "truncated_frac": at(truncated, s), "optimizer_steps": 8})
    steps[-1]["eval_acc"] = final
    return {"steps_done": SD.STEPS, "steps": steps, "model_sha256": sha,
            "hardware": hardware or [{"from_step": 0, "to_step": 200, "seconds": 600.0, "exit_code": 0}]}


def collapsed(at=40):
    return run(acc=lambda s: 0.0 if s >= at else 0.6, final=0.02)


def arm(final_of_seed, seeds=range(8), **kw):
    return {str(s): run(final=final_of_seed(s), **kw) for s in seeds}


def test_the_truncation_endpoint_of_one_run():
    """The share at the length cap per 10-step window, and a no-EOS collapse at the first 10-step mean above 50%."""
    r = run(truncated=lambda s: 1.0 if s >= 96 else 0.1)
    windows = SD.truncation_windows(r)
    assert len(windows) == 20 and windows[0] == pytest.approx(0.1) and windows[9] == pytest.approx(0.55)
    assert SD.no_eos_onset(r) == 91  # steps 91-100: five at 1.0 and five at 0.1, a mean of 0.55 (90-99: 0.46)
    assert SD.no_eos_onset(run(truncated=0.5)) is None  # 50% is not above 50%
    assert SD.onset(r) is None  # the accuracy rule misses it: the reason for the endpoint


def test_family_1_reads_the_cells_as_the_protocol_fixed():
    """D and B lose 50 points against their controls, C nothing: only the summed movement per batch is doubled in B and
    not in C, so that is the reading. With B stable too it is the step size; with D stable there is no reading."""
    ok = arm(lambda s: 0.85 + 0.005 * s)
    (_, _, a), (_, _, b), (_, _, c), (_, _, d) = (DEPTH_CELLS[k] for k in "ABCD")
    study = {d[0]: ok, d[1]: {str(s): collapsed(30 + s) for s in range(8)},
             b[0]: ok, b[1]: arm(lambda s: 0.30 + 0.01 * (s % 3)),
             c[0]: ok, c[1]: arm(lambda s: 0.85 + 0.005 * s + 0.01 * (s % 2 - 0.5))}
    text = SD.verdicts_page(study)
    assert "The protocol's reading: **the summed movement per batch sets it**." in text
    assert "D: unstable" in text and "B: unstable" in text and "C: stable" in text
    table = SD.summary_table(study)  # README's table: the same reading, each cell's P1 row with its collapses
    assert "Family 1's reading, as the protocol fixed it: **the summed movement per batch sets it**." in table
    assert "| 1 | CE-GPPO (0.5, 1) - PPO-clip (0, 0) | D | P1, final avg@8 (points) | 8 |" in table
    assert table.count("\n| 1 | ") == 3 and "| unstable | 8 of 8 / 0 of 8 |" in table
    assert "| stable | 0 of 8 / 0 of 8 |" in table
    study[b[1]] = study[c[1]]
    assert "**the size of each step sets it**" in SD.verdicts_page(study)
    study[d[1]] = study[c[1]]
    assert "did not replicate the instability" in SD.verdicts_page(study)
    study[b[1]] = arm(lambda s: 0.80 + 0.2 * (s % 2))  # a wide interval: neither stable nor unstable
    assert SD.reading({"D": "unstable", "B": "not resolved", "C": "stable"}).startswith("not separated")
    assert SD.reading({"D": "too few pairs", "B": "unstable", "C": "stable"}).startswith("not yet testable")
    one_seed = {arm: {"0": runs["0"]} for arm, runs in study.items()}  # a study of one seed: no reading yet
    assert "**not yet testable (a cell has fewer than two pairs)**" in SD.verdicts_page(one_seed)


def test_family_2_better_equivalent_worse_not_resolved():
    """Against one control: +10 points with little spread holds and is better; +0.5 +- 3 is inside the 5-point
    margin and does not hold: equivalent; -10 is worse; a spread of 20 points resolves nothing. A pair whose runs
    started from different warm starts is no pair."""
    (_, _, a), (_, _, b) = DEPTH_CELLS["A"], DEPTH_CELLS["B"]
    base = lambda s: 0.80 + 0.003 * s  # noqa: E731
    study = {a[0]: arm(base, range(12)), a[2]: arm(lambda s: base(s) + 0.10 + 0.004 * (s % 3), range(12)),
             a[3]: arm(lambda s: base(s) + 0.005 + 0.06 * (s % 2 - 0.5), range(12)),
             a[4]: arm(lambda s: base(s) - 0.10 - 0.004 * (s % 3), range(12)),
             b[0]: arm(base), b[1]: arm(lambda s: base(s) + (0.2 if s % 2 else -0.2))}
    study[a[4]]["11"]["model_sha256"] = "another block"
    rows = {(r["arm"], r["endpoint"]): r for r in SD.endpoint_rows(study, SD.FAMILY2)}
    assert SD.benefit(rows[(a[2], "P1")]) == "better" and rows[(a[2], "P1")]["n"] == 12
    assert SD.benefit(rows[(a[3], "P1")]) == "equivalent within the margin"
    assert SD.benefit(rows[(a[4], "P1")]) == "worse" and rows[(a[4], "P1")]["n"] == 11
    assert SD.benefit(rows[(b[1], "P1")]) == "not resolved"
    assert SD.benefit(rows[(b[2], "P1")]) == "not resolved (too few pairs)"
    assert rows[(b[2], "P1")]["verdict"] == "too few pairs" and rows[(a[2], "P1")]["flip_p"] == 2 / 4096
    assert rows[(a[2], "P1")]["holm"] == pytest.approx(min(1, 10 * rows[(a[2], "P1")]["p"]))  # the smallest of 10


def test_family_3_reads_each_beta_against_the_papers_sign():
    """beta2 (0 -> 1) raises entropy by 0.01 nats in every pair: as the paper says; beta1 (0 -> 0.5) raises it by
    another 0.01: against the paper (it predicts lower). Both windows are judged together (Holm over 4)."""
    _, _, a = DEPTH_CELLS["A"]
    study = {a[0]: {str(s): run(entropy=0.20 + 0.001 * s) for s in range(12)},
             a[1]: {str(s): run(entropy=0.21 + 0.001 * s + 0.0001 * (s % 2)) for s in range(12)},
             a[2]: {str(s): run(entropy=lambda t, s=s: 0.22 + 0.001 * s + 0.0002 * (s % 3)) for s in range(12)}}
    rows = SD.entropy_rows(study)
    assert [(r["what"][:5], r["window"], r["reading"]) for r in rows] == [
        ("beta2", "steps 1-200", "as the paper says"), ("beta2", "steps 151-200", "as the paper says"),
        ("beta1", "steps 1-200", "against the paper"), ("beta1", "steps 151-200", "against the paper")]
    assert rows[0]["mean"] == pytest.approx(0.01 + 0.00005, abs=1e-4)


def test_readme_carries_the_finished_study_and_nothing_before():
    """Once every registered run has finished, README's table of the fifth study is summary_table() of the committed
    JSON, number for number; until then README carries no part of it (an interim look is not a result)."""
    study = SD.load_study(SD.JSON, "--json")
    readme = open(os.path.join(SD.ROOT, "README.md")).read()
    if SD.interim(study):
        assert "| family | contrast | cell |" not in readme
    else:
        assert SD.summary_table(study) in readme


def test_training_minutes_by_step_clocks():
    """200 times the median step clock: a step paused for an hour moves it little; a run without clocks has none."""
    r = run()
    for i, row in enumerate(SD.step_rows(r)):
        row.update(time_rollout_s=1.0, time_reward_s=0.2, time_update_s=3600.0 if i == 5 else 1.8)
    assert SD.step_clock_minutes(r) == pytest.approx(200 * 3.0 / 60)
    assert SD.step_clock_minutes(run()) is None


def test_the_pages_from_a_json_and_a_bad_one(tmp_path, capsys):
    """report writes the arms page (failed segments named, the truncation per window), the verdicts and the figure;
    a JSON with a non-number where a number belongs is one line and exit code 2."""
    _, _, d = DEPTH_CELLS["D"]
    failed = [{"from_step": 0, "to_step": 200, "seconds": 500.0, "exit_code": 1}]
    study = {"_warm_start": {"sha256": "abc"}, d[0]: arm(lambda s: 0.8),
             d[1]: {**{str(s): collapsed() for s in range(7)}, "7": run(truncated=0.9, hardware=failed)}}
    study[d[0]]["3"]["hardware"] = [{"from_step": 0, "to_step": 180, "seconds": 400.0, "exit_code": None},
                                    {"from_step": 175, "to_step": 200, "seconds": 60.0, "exit_code": 0}]
    path = tmp_path / "study.json"
    path.write_text(json.dumps(study))
    SD.main(["--json", str(path), "--figures", str(tmp_path / "pages")])
    arms = (tmp_path / "pages" / "arms.md").read_text()
    assert "`ce_gppo_0.5_1` seed 7: steps 0-200: exit code 1" in arms
    assert "`ppo_clip_tm` seed 3: steps 0-180, resumed from 175" in arms  # stopped from outside: not a failure
    assert "`ppo_clip_tm` seed 3: steps 0-180: exit" not in arms
    assert "| D (8 steps, lr 2e-4) | `ce_gppo_0.5_1` | 8 | 7 [47%, 100%] |" in arms
    assert "| `ce_gppo_0.5_1` | 11 | 11 | 11 |" in arms  # per window: 7 runs at 0%, one at 90%, a mean of 11%
    assert (tmp_path / "pages" / "curves.png").stat().st_size > 10_000
    assert "D: unstable" in (tmp_path / "pages" / "verdicts.md").read_text()
    for page in ("arms.md", "verdicts.md", "summary.md"):  # seeds 0-7, none of the registered 30-41: all interim
        assert "**Interim: 0 of the 116 registered runs have finished." in (tmp_path / "pages" / page).read_text()
    complete = {arm: {str(seed): run() for seed in range(30, 42)} for arm in SD.DEPTH_ARMS}
    assert not SD.interim(complete) and len(SD.planned_runs()) == 116
    assert "Interim" not in SD.arms_page(complete)
    study[d[0]]["0"]["steps"][3]["truncated_frac"] = "many"
    path.write_text(json.dumps(study))
    with pytest.raises(SystemExit) as e:
        SD.main(["--json", str(path), "--figures", str(tmp_path / "pages")])
    assert e.value.code == 2 and "truncated_frac is not a number" in capsys.readouterr().err
