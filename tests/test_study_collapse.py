"""tools/study_collapse.py: the third study's endpoint, tests and pages, on hand-made runs whose answers are known."""

import json

import pytest

from tools import study_collapse as SC
from tools.stats import exact_trend, fisher_exact


def run(acc, final=0.8, entropy=0.2, evidence=None, trained=None):
    """A run record as tools/study.py writes it: step 0's evaluation, 200 steps of training accuracy `acc(step)`,
    final avg@8 `final`; entropy logged only on steps that trained (trained(step), default all)."""
    steps = [{"step": 0, "eval_acc": 0.4}]
    for s in range(1, SC.STEPS + 1):
        row = {"step": s, "acc_mean": acc(s), "reward_mean": 2 * acc(s) - 1}
        if trained is None or trained(s):
            row.update(entropy=entropy, **(evidence or {}))
        steps.append(row)
    steps[-1]["eval_acc"] = final
    return {"steps_done": SC.STEPS, "steps": steps, "model_sha256": "abc"}


def test_onset_is_the_first_10_step_window_below_5_percent_from_step_11():
    """Accuracy 1.0 outside the dips, so a window that takes in one such step averages at least 10%."""
    assert SC.onset(run(lambda s: 1.0)) is None
    assert SC.onset(run(lambda s: 0.0 if s >= 40 else 1.0)) == 40
    # a dip of 9 steps is no window of 10; one of 10 is
    assert SC.onset(run(lambda s: 0.0 if 50 <= s < 59 else 1.0)) is None
    assert SC.onset(run(lambda s: 0.0 if 50 <= s < 60 else 1.0)) == 50
    # before step 11 it does not count (the warm start's first steps), and a window must lie inside the run
    assert SC.onset(run(lambda s: 0.0 if s <= 12 else 1.0)) is None
    assert SC.onset(run(lambda s: 0.0 if s > 191 else 1.0)) is None
    # the mean decides: 0.04 for 10 steps collapses, 0.06 does not; a window reaching back over one step of 0.3
    # still averages below 5% (0.03): the onset is the window's first step
    assert SC.onset(run(lambda s: 0.04 if s >= 100 else 1.0)) == 100
    assert SC.onset(run(lambda s: 0.06 if s >= 100 else 1.0)) is None
    assert SC.onset(run(lambda s: 0.0 if s >= 40 else 0.3)) == 39
    # by the final avg@8 alone: onset 200
    assert SC.onset(run(lambda s: 1.0, final=0.09)) == SC.STEPS


def test_family_tests_and_verdicts(tmp_path):
    """5 of 5 collapsed against 0 of 5: Fisher p 0.0079, holds after Holm over a family of three; 4 of 5 against 0 of 5:
    p 0.048, holds uncorrected only; unfinished runs are left out."""
    collapsed, healthy = run(lambda s: 0.0 if s >= 30 else 1.0, final=0.02), run(lambda s: 0.4)
    study = {"_warm_start": {"sha256": "abc"},
             "ppo_clip_tm": {str(s): healthy for s in range(5)},
             "ce_gppo_1_1": {str(s): collapsed for s in range(5)},
             "ce_gppo_0.5_1": {**{str(s): collapsed for s in range(4)}, "4": healthy},
             "ce_gppo_0_1": {**{str(s): healthy for s in range(5)}, "5": {**collapsed, "steps_done": 120}}}
    rows = {r["arm"]: r for r in SC.family_rows(study, SC.FAMILIES[0][1])}
    assert (rows["ce_gppo_1_1"]["a"], rows["ce_gppo_1_1"]["n1"]) == (5, 5)
    assert rows["ce_gppo_1_1"]["p"] == pytest.approx(fisher_exact(5, 5, 0, 5)) == pytest.approx(1 / 126)
    assert rows["ce_gppo_1_1"]["verdict"] == "holds" and rows["ce_gppo_1_1"]["holm"] == pytest.approx(3 / 126)
    assert rows["ce_gppo_0.5_1"]["p"] == pytest.approx(10 / 210) and rows["ce_gppo_0.5_1"]["verdict"] == \
        "holds uncorrected only"
    assert rows["ce_gppo_0_1"]["n1"] == 5 and rows["ce_gppo_0_1"]["verdict"] == "not shown"  # the unfinished one out
    dose = SC.dose(study)
    assert dose["arms"] == [(0.0, 5, 0), (0.5, 5, 4), (1.0, 5, 5)]
    assert dose["trend_p"] == pytest.approx(exact_trend(dose["arms"])) and dose["smallest_collapsing_beta1"] == 0.5
    assert dose["onset_rho"] < -0.5  # a larger beta1, an earlier onset (runs that did not collapse ranked last)
    path = tmp_path / "study.json"
    path.write_text(json.dumps(study))
    SC.report(str(path), str(tmp_path / "pages"))
    verdicts = (tmp_path / "pages" / "verdicts.md").read_text()
    assert ("| `ce_gppo_1_1` | 5 of 5 | `ppo_clip_tm` | 0 of 5 | +100.0% [+38.6%, +100.0%] | 0.00794 | 0.0238 | holds |"
            in verdicts)  # the difference with Newcombe's interval, Fisher's p, Holm's
    assert (tmp_path / "pages" / "curves.png").stat().st_size > 10_000
    arms = (tmp_path / "pages" / "arms.md").read_text()
    assert "| `ce_gppo_0.5_1` | 5 | 4 [28%, 99%] | 30, 30, 30, 30, - |" in arms


def test_trend_and_fisher_by_hand():
    """The exact tests against values counted by hand: Fisher's 1 of 5 against 0 of 7 (the second study's (0, 1)
    against GRPO) is p = 5/12; a trend over two arms is Fisher's test of them."""
    assert fisher_exact(1, 5, 0, 7) == pytest.approx(5 / 12)
    assert exact_trend([(0, 5, 0), (1, 5, 5)]) == pytest.approx(fisher_exact(5, 5, 0, 5))
    assert exact_trend([(0, 5, 1), (1, 5, 1)]) == pytest.approx(1.0)


def test_entropy_before_the_pairs_collapse_and_the_token_table():
    """The secondary endpoint reads each run's entropy before the pair's earlier onset; the token table splits runs by
    collapse and averages the evidence over the steps before each run's onset."""
    late = run(lambda s: 0.0 if s >= 100 else 0.3, final=0.0, entropy=0.3,
               evidence={"low_neg_eos_share": 0.5, "clip_frac_low_neg": 0.01})
    healthy = run(lambda s: 0.4, entropy=0.1, evidence={"low_neg_eos_share": 0.0, "clip_frac_low_neg": 0.002})
    study = {"a": {"1": late, "2": late}, "b": {"1": healthy, "2": healthy}}
    e = SC.entropy_contrast(study, "a", "b")
    assert e["n"] == 2 and e["mean"] == pytest.approx(0.2)
    rows = SC.composition(study, ["a", "b"])
    got = {(r["arm"], r["status"], r["window"]): r for r in rows}
    assert got[("a", "collapsed", "before onset")]["low_neg_eos_share"] == pytest.approx(0.5)
    assert got[("b", "did not collapse", "steps 1-10")]["low_neg_share"] == pytest.approx(0.002)
    idle = run(lambda s: 0.0 if s >= 100 else 0.3, final=0.0, trained=lambda s: s < 150)
    assert SC.mean_entropy(idle) == pytest.approx(0.2)  # over the steps that logged it


def bad(study: dict, change) -> str:
    """A good study's JSON with change(study) applied, as text."""
    change(study)
    return json.dumps(study)


def good() -> dict:
    return {"grpo": {"10": run(lambda s: 0.4)}}


@pytest.mark.parametrize("content, says", [
    (None, "no such file"),
    ("{", "not a study's JSON (JSONDecodeError"),
    ('{"grpo": {"10": {"steps_done": 200}}}', "configuration grpo seed 10: its steps are not a list of objects"),
    (bad(good(), lambda s: s["grpo"]["10"].update(steps_done="200")),
     "configuration grpo seed 10 is not a run's record (an object with a whole steps_done)"),
    (bad(good(), lambda s: s["grpo"]["10"]["steps"].append("step 201")),
     "configuration grpo seed 10: its steps are not a list of objects"),
    (bad(good(), lambda s: s["grpo"]["10"].update(model_sha256=["abc"])),
     "configuration grpo seed 10: its model_sha256 is not text"),
    (bad(good(), lambda s: s["grpo"]["10"]["steps"][5].update(acc_mean="0.4")),
     "configuration grpo seed 10 step 5: its acc_mean is not a number"),
    (bad(good(), lambda s: s["grpo"]["10"]["steps"][-1].update(eval_acc=[0.8])),
     "configuration grpo seed 10 step 200: its eval_acc is not a number"),
    (bad(good(), lambda s: s["grpo"].update(ten=s["grpo"]["10"])), "configuration grpo seed ten: the seed is not a "
                                                                     "whole number"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, content, says):
    """Each JSON the pages cannot read: one line naming what is wrong, exit 2, and no page written (the folder for
    them is not even made)."""
    path = tmp_path / "study.json"
    if content is not None:
        path.write_text(content)
    out = collapse(path, tmp_path / "pages")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and says in out.stderr, out.stderr
    assert out.stderr.startswith("study_collapse.py: error: --json ") and not (tmp_path / "pages").exists()


def collapse(path, figures):
    import subprocess
    import sys

    from conftest import ROOT
    return subprocess.run([sys.executable, "-m", "tools.study_collapse", "--json", str(path), "--figures",
                           str(figures)], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_folder_at_a_pages_name_is_refused_before_the_work(tmp_path):
    path = tmp_path / "study.json"
    path.write_text(json.dumps(good()))
    (tmp_path / "pages" / "verdicts.md").mkdir(parents=True)
    out = collapse(path, tmp_path / "pages")
    assert out.returncode == 2 and out.stderr == (f"study_collapse.py: error: --figures {tmp_path}/pages: verdicts.md "
                                                  "in it is a folder; move it aside\n")
    assert sorted(p.name for p in (tmp_path / "pages").iterdir()) == ["verdicts.md"]


def test_runs_a_page_cannot_fully_read_still_give_their_pages(tmp_path):
    """A step row without a step is left out (one row per step); an arm whose finished runs lack the final evaluation
    says n/a for it; seeds are in numeric order (9 before 10)."""
    no_final = run(lambda s: 0.4)
    no_final["steps"][-1].pop("eval_acc")
    no_final["steps"].insert(3, {"acc_mean": 0.0})
    study = {"ppo_clip_tm": {"10": no_final, "9": no_final},
             "ce_gppo_1_1": {"10": run(lambda s: 0.0 if s >= 30 else 1.0), "9": run(lambda s: 1.0)}}
    path = tmp_path / "study.json"
    path.write_text(json.dumps(study))
    out = collapse(path, tmp_path / "pages")
    assert out.returncode == 0, out.stderr
    arms = (tmp_path / "pages" / "arms.md").read_text()
    assert "| `ppo_clip_tm` | 2 | 0 [0%, 84%] | -, - | n/a | 0.0 |" in arms
    assert "| `ce_gppo_1_1` | 2 | 1 [1%, 99%] | -, 30 | 80.0 [80.0, 80.0] | 0.0 |" in arms  # seed 9, then seed 10


def test_holm_counts_every_test_of_the_family_and_rejects_at_or_below_5_percent(monkeypatch):
    """A test without runs yet counts as p = 1 (the family keeps its size: 5 of 5 against 0 of 5 is Holm-adjusted
    3 x 1/126 in a family of 3, not 2 x); a raw p of exactly 0.05 rejects at 5%, as Holm's rule does."""
    collapsed, healthy = run(lambda s: 0.0 if s >= 30 else 1.0, final=0.02), run(lambda s: 0.4)
    study = {"ppo_clip_tm": {str(s): healthy for s in range(5)}, "ce_gppo_1_1": {str(s): collapsed for s in range(5)}}
    rows = {r["arm"]: r for r in SC.family_rows(study, SC.FAMILIES[0][1])}
    assert rows["ce_gppo_1_1"]["holm"] == pytest.approx(3 / 126) and rows["ce_gppo_1_1"]["verdict"] == "holds"
    assert rows["ce_gppo_0_1"]["verdict"] == "no runs yet" and rows["ce_gppo_0_1"]["holm"] is None
    monkeypatch.setattr(SC, "fisher_exact", lambda *a: 0.05)
    study = {arm: {"0": healthy} for tests in SC.FAMILIES for pair in tests[1] for arm in pair}
    (one,) = SC.family_rows(study, [("ppo_clip_tm", "grpo")])
    assert one["holm"] == 0.05 and one["verdict"] == "holds"
    two = SC.family_rows(study, SC.FAMILIES[2][1])  # Holm-adjusted 0.1 each: the raw test alone rejects
    assert [r["verdict"] for r in two] == ["holds uncorrected only"] * 2
    page = SC.verdicts_page(study)
    assert "**holds** (Holm-adjusted p <= 0.05), **holds uncorrected only** (raw p <= 0.05)" in page
    heads = [line for line in page.splitlines() if line.startswith("## ")]
    assert [h[3] for h in heads] == ["1", "2", "3", "4", "5"]  # the protocol's order


def test_the_figure_draws_accuracy_entropy_and_response_length_against_step(tmp_path, monkeypatch):
    """The protocol promises response length against step beside accuracy and entropy: one panel each, an arm's
    curve the mean of its finished runs."""
    from cegppo_utils import runfolder
    drawn = {}
    monkeypatch.setattr(runfolder, "save_figure", lambda fig, path, **k: drawn.update(fig=fig, path=path))
    a, b = run(lambda s: 0.4), run(lambda s: 0.4)
    for r, length in ((a, 80.0), (b, 100.0)):
        for row in r["steps"][1:]:
            row["response_length_mean"] = length + row["step"]
    SC.figures({"grpo": {"10": a, "11": b}}, ["grpo"], str(tmp_path))
    axes = drawn["fig"].axes
    assert [ax.get_title() for ax in axes] == ["accuracy", "entropy (steps that trained)", "response length"]
    (line,) = axes[2].get_lines()
    assert list(line.get_xdata()) == list(range(1, SC.STEPS + 1))
    assert list(line.get_ydata()) == [90.0 + s for s in range(1, SC.STEPS + 1)]


def test_a_permutation_p_at_its_floor_is_said_as_a_bound_and_onset_is_ranked_among_collapsed_runs_too():
    """No shuffle of 20,000 as extreme gives p = 1 / 20,001: the page says "< 1e-4", not 5e-05. Beside the rank
    correlation over every run (the censored ones ranked last) stands the one over the collapsed runs alone, which the
    censoring cannot drive: here later onsets at the larger beta1, so its rho is positive while the first is
    negative."""
    assert SC.permutation_p(1 / 20001) == "< 1e-4" and SC.permutation_p(0.346) == "0.346"
    study = {"ce_gppo_0.25_1": {**{str(s): run(lambda s: 0.0 if s >= 30 else 1.0, final=0.02) for s in range(2)},
                                **{str(s): run(lambda s: 0.4) for s in range(2, 5)}},
             "ce_gppo_1_1": {str(s): run(lambda s, k=s: 0.0 if s >= 60 + k else 1.0, final=0.02) for s in range(5)}}
    d = SC.dose(study)
    assert d["onset_rho"] < 0 < d["collapsed_rho"]
    assert "among the collapsed runs only rho +" in "\n".join(SC.dose_section(study))


def test_the_third_studys_pages_carry_its_corrections():
    """Read against the JSON (issue of 2026-11-28): what the pages no longer say, and what they now say."""
    page = (SC.ROOT + "/docs/study-collapse.md")
    with open(page) as f:
        text = " ".join(f.read().split())
    for retracted in ("its weight, beta1, does", "19:31", "permutation p 5e-5", "the larger beta1, the earlier",
                      "entropy was not clearly higher"):
        assert retracted not in text, retracted
    for said in ("among the 11 runs that collapsed, rho is -0.32", "+0.020 [+0.0002, +0.0399]",
                 "the two are not separated here", "Intervals on the logit scale, added after the runs",
                 "recovered: its final avg@8 is 64%", "p < 0.05 to p <= 0.05 at 52 of the 65 runs"):
        assert said in text, said


def test_one_run_or_one_pair_shows_its_value_and_no_interval():
    """An interval needs two values (stats refuses one): the final cell of a single run is its value, the entropy
    contrast of a single pair its difference, said to be one pair."""
    assert SC.final_cell([0.5]) == "50.0" and SC.final_cell([]) == "n/a"
    assert SC.final_cell([0.5, 0.7]).startswith("60.0 [")
    study = {"ppo_clip_tm": {"0": run(lambda s: 0.4, entropy=0.3)}, "ce_gppo_1_1": {"0": run(lambda s: 0.4)}}
    assert SC.entropy_contrast(study, "ce_gppo_1_1", "ppo_clip_tm") == pytest.approx(
        {"n": 1, "mean": -0.1, "lo": None, "hi": None})
    table = "\n".join(SC.family_section(study, "a family", [("ce_gppo_1_1", "ppo_clip_tm")]))
    assert "| -0.1000 (1 pair) |" in table
