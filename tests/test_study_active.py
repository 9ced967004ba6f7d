"""tools/study_active.py: the second study's rule, sizing and verdicts (docs/study-protocol-active.md) on hand-built
runs whose answers are known."""

import math

import pytest

from tools import stats
from tools import study_active as A
from tools.configs import REGIME_GRID


def run(steps=100, share=0.02, entropy=lambda t: 0.2, evals=None, od=None, seconds=600.0):
    """A run record as study.py stores it: per step the clip regions (their sum `share`), entropy, reward, od_state."""
    rows = [{"step": 0, "eval_acc": (evals or {}).get(0, 0.5)}]
    for t in range(1, steps + 1):
        row = {"step": t, "reward_mean": 0.0, "entropy": entropy(t), "clip_frac_low_neg": share / 2,
               "clip_frac_high_pos": share / 4, "clip_frac_low_pos": share / 8, "clip_frac_high_neg": share / 8,
               "approx_kl": 1e-3}
        if od is not None:
            row["od_state"] = od(t)
        if evals and t in evals:
            row["eval_acc"] = evals[t]
        rows.append(row)
    return {"steps_done": steps, "steps": rows, "hardware": [{"seconds": seconds, "threads": 1}]}


GOOD = {25: 0.6, 50: 0.7, 75: 0.75, 100: 0.8}


def test_the_rule_takes_the_first_passing_point_in_the_protocols_order():
    grid = {name: {"100": run(evals=GOOD)} for name in REGIME_GRID}
    grid["grid_lr1e-4_u8"] = {"100": run(share=0.005, evals=GOOD)}  # the clip binds too little
    grid["grid_lr2e-4_u8"] = {"100": run(evals={25: 0.6, 50: 0.62, 75: 0.63, 100: 0.64})}  # +14 points: does not learn
    grid["grid_lr3e-4_u8"] = {"100": run(evals={25: 0.9, 50: 0.9, 75: 0.9, 100: 0.79})}  # 11 below its best: unstable
    rows, chosen, missing = A.choose_regime(grid)
    assert not missing and [r["passes"] for r in rows[:4]] == [False, False, False, True]
    assert (rows[0]["binds"], rows[1]["learns"], rows[2]["stable"]) == (False, False, False)
    assert chosen["name"] == "grid_lr1e-4_u16" and chosen["updates"] == 16 and chosen["lr"] == 1e-4
    assert rows[3]["share"] == pytest.approx(0.02) and rows[3]["beta1_region"] == pytest.approx(0.01)
    collapsed = dict(grid, **{"grid_lr1e-4_u16": {"100": run(entropy=lambda t: 0.2 if t <= 10 else 0.04, evals=GOOD)}})
    assert A.choose_regime(collapsed)[1]["name"] == "grid_lr2e-4_u16"  # entropy fell below a quarter of its start
    # a point earlier in the order that has not finished blocks the choice: it could still pass
    partial = {name: runs for name, runs in grid.items() if name != "grid_lr2e-4_u8"}
    rows, chosen, missing = A.choose_regime(partial)
    assert chosen is None and missing == ["grid_lr2e-4_u8"]
    assert "No choice yet" in A.regime_report(partial) and "Chosen: **grid_lr1e-4_u16**" in A.regime_report(grid)


def test_the_sizing_follows_the_protocols_formula():
    chosen = {"name": "grid_lr2e-4_u8", "lr": 2e-4, "updates": 8}
    study = {"grpo": {s: run(steps=200, share=0.0162, entropy=lambda t, h=h: h, seconds=900.0)
                      for s, h in (("0", 0.10), ("1", 0.11), ("2", 0.13))}}
    assert A.sizing(study, None) is None and A.sizing({"grpo": {"0": study["grpo"]["0"]}}, chosen) is None
    size = A.sizing(study, chosen)
    # 5e-6 x 2 (lr) x 2 (U) x 20 (share 1.62% / 0.081%) per step, times 200 / 2
    assert size["effect_per_step"] == pytest.approx(4e-4) and size["delta"] == pytest.approx(0.04)
    sd = math.sqrt(((0.10 - 0.34 / 3) ** 2 + (0.11 - 0.34 / 3) ** 2 + (0.13 - 0.34 / 3) ** 2) / 2)
    assert size["sigma"] == pytest.approx(math.sqrt(2) * sd)
    assert size["seeds"] == 5  # the floor: power at 5 seeds is already above 0.8
    assert size["power_at_delta"] == pytest.approx(stats.paired_power(0.04, size["sigma"], 5))
    assert size["mde"] == pytest.approx(stats.min_detectable(size["sigma"], 5))
    # 10 arms x 5 seeds - 3 done = 47 runs of 15 core-minutes: 11.75 core-hours, within the 24
    assert size["arms"] == A.ARMS and size["core_hours_planned"] == pytest.approx(47 * 900 / 3600)
    # slow runs: whole arms are dropped in the protocol's order, never seeds
    slow = {"grpo": {s: dict(r, hardware=[{"seconds": 2400.0, "threads": 1}]) for s, r in study["grpo"].items()}}
    size = A.sizing(slow, chosen)
    dropped = ("dapo", "grpo_dyn_od", "grpo_dyn_did")
    assert size["seeds"] == 5 and size["arms"] == [a for a in A.ARMS if a not in dropped]
    # a tiny spread never sizes below the merge study's paired SD
    flat = {"grpo": {s: run(steps=200, share=0.0162, entropy=lambda t: 0.1) for s in ("0", "1", "2")}}
    assert A.sizing(flat, chosen)["sigma"] == A.SIGMA_FLOOR


def test_the_verdicts_read_each_claim_as_the_protocol_says():
    def arm(offsets, entropy=lambda t: 0.2, **kw):
        return {s: run(steps=200, entropy=lambda t, o=o: entropy(t) + o, **kw) for s, o in zip("01234", offsets)}

    study = {"grpo": arm([0.0, 0.01, -0.01, 0.02, 0.0]),
             "ce_gppo_0_1": arm([0.05, 0.06, 0.04, 0.07, 0.05]),
             "ce_gppo_1_1": arm([0.01, 0.03, -0.01, 0.03, 0.01]),  # below (0, 1): beta1 lowers entropy
             "ce_gppo_1_0.5": arm([0.012, 0.028, -0.012, 0.031, 0.01]),  # (1, 1) - (1, 0.5) straddles 0
             "ce_gppo_0.5_1": arm([0.03, 0.04, 0.02, 0.05, 0.03])}
    result = A.claims(study)
    by_label = {c["label"]: c for c in result["betas"]}
    beta1 = by_label["1: larger beta1 lowers entropy: (1, 1) - (0, 1)"]
    assert beta1["n"] == 5 and beta1["mean"] == pytest.approx(-0.04) and A.read(beta1) == "holds"
    assert A.read(by_label["2: larger beta2 raises entropy: (1, 1) - (1, 0.5)"]) == "not resolved"
    assert A.read(by_label["4: (0.5, 1) stays highest: (0.5, 1) - ce_gppo_0_1"]) == "reversed"
    text = A.verdicts_report(study)
    assert "| 1: larger beta1 lowers entropy: (1, 1) - (0, 1) | 5 | -0.0400 [" in text and "(survives) |" in text
    assert "| grpo_dyn_id keeps entropy higher: D(1-200) | 0 | n/a | | | | fewer than 2 seeds |" in text

    # ID: above GRPO over the first half, below over the second; OD: switches at step 60 and recovers after
    bump = lambda t: 0.2 + (0.02 if t <= 100 else -0.02)  # noqa: E731
    study["grpo_dyn_id"] = arm([0.0, 0.01, -0.01, 0.02, 0.0], entropy=bump)
    study["grpo_dyn_od_h0.5"] = arm([0.0, 0.01, -0.01, 0.02, 0.0], entropy=lambda t: 0.2 + 0.03 * (t > 60),
                                    od=lambda t: int(t >= 60))
    study["grpo_dyn_od"] = arm([0.0, 0.01, -0.01, 0.02, 0.0], od=lambda t: 0)
    dynamic = {c["label"]: c for c in A.claims(study)["dynamic"]}
    assert A.read(dynamic["grpo_dyn_id rises: D(1-100)"]) == "holds"
    assert A.read(dynamic["grpo_dyn_id then falls: D(101-200)"]) == "holds"
    recovery = dynamic["grpo_dyn_od_h0.5 recovers after its first switch: D(10 after) - D(10 before)"]
    assert recovery["mean"] == pytest.approx(0.03) and A.read(recovery) == "holds"
    assert A.claims(study)["od_never_switched"]["grpo_dyn_od"] == ["0", "1", "2", "3", "4"]
    assert "grpo_dyn_od seeds 0, 1, 2, 3, 4" in A.verdicts_report(study)


def test_accuracy_reads_the_midpoint_to_end_evaluations():
    evals = lambda a: {0: 0.5, 100: a, 125: a, 150: a, 175: a, 200: a}  # noqa: E731
    study = {"grpo": {s: run(steps=200, evals=evals(a)) for s, a in (("0", 0.8), ("1", 0.85), ("2", 0.9))},
             "grpo_dyn_id": {s: run(steps=200, evals=evals(a)) for s, a in (("0", 0.78), ("1", 0.86), ("2", 0.88))}}
    assert A.accuracy_endpoint(study["grpo"]["0"]) == pytest.approx(0.8)
    assert A.accuracy_endpoint(run(steps=200, evals={0: 0.5, 100: 0.8})) is None  # a planned evaluation missing
    kept = A.claims(study)["keeps_accuracy"][0]
    assert kept["mean"] == pytest.approx(-0.01)
    assert A.read(kept).startswith("no loss detected (a loss of up to ") and "not excluded" in A.read(kept)


def test_claims_read_finished_runs_only():
    study = {"grpo": {"0": run(steps=200), "1": run(steps=120)}, "grid_lr2e-4_u8": {"100": run(steps=100)},
             "_warm_start": {"sha256": "be4a413e32125925"}}
    assert A.finished(study) == {"grpo": {"0": study["grpo"]["0"]}}


def test_the_arms_table_counts_idle_steps_and_collapsed_runs():
    def collapsed(t):
        return None if t > 150 else 0.3  # accuracy at 0 from step 151: nothing trained, no entropy logged

    evals = {0: 0.5, 100: 0.4, 125: 0.2, 150: 0.1, 175: 0.0, 200: 0.05}
    study = {"grpo": {s: run(steps=200, entropy=lambda t: 0.1, evals={0: 0.5, 100: 0.8, 125: 0.8, 150: 0.8,
                                                                        175: 0.8, 200: 0.8}) for s in "01"},
             "ce_gppo_0.5_1": {"0": run(steps=200, entropy=collapsed, evals=evals)}}
    row = {line.split(" | ")[0][2:]: line for line in A.arms_report(study).splitlines() if line.startswith("| ")}
    assert A.mean_entropy(study["ce_gppo_0.5_1"]["0"]) == pytest.approx(0.3)  # over the 150 steps that logged it
    assert "| 50.0 | 15.0 | 5.0 | 1 of 1 |" in row["ce_gppo_0.5_1"]
    assert ("| 0.1000 [0.1000, 0.1000] | 1.00 / 0.50 | 0.0 | 80.0 [80.0, 80.0] | 80.0 [80.0, 80.0] | 0 of 2 |"
            in row["grpo"])


def test_the_report_is_written_whole_and_never_through_a_link(tmp_path):
    """report() writes its tables from the JSON alone; a link planted at a table's or the figure's name is replaced,
    its target kept (savefig would follow it: issue 59)."""
    import json
    import os
    study = {"grpo": {s: run(steps=200, evals=GOOD) for s in "012"}, "_warm_start": {"sha256": "be4a413e32125925"}}
    path, figures = tmp_path / "study.json", tmp_path / "figures"
    path.write_text(json.dumps(study))
    figures.mkdir()
    outside = tmp_path / "mine.md"
    outside.write_text("a user's file\n")
    os.symlink(outside, figures / "verdicts.md")
    os.symlink(outside, figures / "entropy.png")
    A.report(str(path), str(figures))
    assert outside.read_text() == "a user's file\n"
    assert not (figures / "verdicts.md").is_symlink() and "**The betas" in (figures / "verdicts.md").read_text()
    assert not (figures / "entropy.png").is_symlink() and (figures / "entropy.png").read_bytes()[:4] == b"\x89PNG"
    assert {"regime.md", "sizing.md", "arms.md", "readings.json", "entropy.png"} <= set(os.listdir(figures))
    assert json.loads((figures / "readings.json").read_text())["chosen"] is None  # no grid run: no regime chosen


def test_runs_pair_within_a_block_and_the_blocks_pool(tmp_path):
    """Block B (another warm start) reuses seed numbers: its runs pair with block B's runs of the same seed only, and
    the pairs of both blocks form one sample, with each block's mean beside it."""
    def arm(levels):
        return {s: run(steps=200, entropy=lambda t, h=h: h) for s, h in levels.items()}

    a = {"_warm_start": {"sha256": "be4a413e32125925"}, "grpo": arm({"0": 0.10, "1": 0.11}),
         "ce_gppo_1_0.5": arm({"0": 0.12})}
    b = {"_warm_start": {"sha256": "0123456789abcdef"}, "grpo": arm({"1": 0.20, "2": 0.30}),
         "ce_gppo_1_0.5": arm({"1": 0.23, "2": 0.34})}
    path = tmp_path / "study-merge-active.json"
    for p, block in ((path, a), (tmp_path / "study-merge-active-b.json", b)):
        p.write_text(__import__("json").dumps(block))
    assert A.block_paths(str(path)) == [str(path), str(tmp_path / "study-merge-active-b.json")]
    packed = tmp_path / "packed"  # the committed blocks are .json.gz; one not packed yet is read under its plain name
    packed.mkdir()
    for name in ("s.json.gz", "s-b.json.gz", "s-c.json", "s-b.json"):
        (packed / name).write_text("")
    want = [str(packed / name) for name in ("s.json.gz", "s-b.json.gz", "s-c.json")]
    assert A.block_paths(str(packed / "s.json.gz")) == want
    assert [A.block_letter(p) for p in A.block_paths(str(packed / "s.json"))[1:]] == ["B", "C"]
    study = A.merge_blocks([a, b])
    assert sorted(study["grpo"], key=A.seed_order) == ["0", "1", "B1", "B2"]
    assert study["_blocks"] == {"A": "be4a413e32125925", "B": "0123456789abcdef"}
    assert "B1" not in a["grpo"]  # block A's record is not changed by the merge
    pairs = A.paired_by_seed(study, "ce_gppo_1_0.5", "grpo", A.mean_entropy)
    assert list(pairs) == ["0", "B1", "B2"]  # block A's seed 1 has no (1, 0.5) run; block B's seed 1 pairs in B
    assert [round(v, 6) for v in pairs.values()] == [0.02, 0.03, 0.04]
    c = A.contrast("x", pairs, "above")
    assert c["n"] == 3 and c["mean"] == pytest.approx(0.03)
    assert c["blocks"]["A"] == [1, pytest.approx(0.02)] and c["blocks"]["B"] == [2, pytest.approx(0.035)]
    text = A.verdicts_report(study)
    assert "| 3: (1, 0.5) falls fastest: (1, 0.5) - grpo | 3 | +0.0300 [" in text
    assert "A (1): +0.0200; B (2): +0.0350 |" in text
    assert "block B: warm start `0123456789abcdef`, 4 finished runs" in A.blocks_note(study)
    note = A.blocks_note(study)  # GRPO's runs of each block against stage 1's rule, described
    assert "seed B1 (2.00% outside, avg@8 50.0 -> n/a, worst n/a: fails learns and stable)" in note


def test_holm_adjusted_p_values_step_down_and_stay_monotone():
    # R: p.adjust(c(0.01, 0.04, 0.03, 0.005), "holm") = 0.03 0.06 0.06 0.02
    assert stats.holm_adjusted([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm_adjusted([0.5, 0.9]) == [1.0, 1.0] and stats.holm_adjusted([]) == []
    pvalues = [0.001, 0.2, 0.011, 0.04, 0.0123]
    adjusted = stats.holm_adjusted(pvalues)
    assert [a <= 0.05 for a in adjusted] == stats.holm(pvalues)  # the adjusted p and the step-down reject alike
    assert all(a >= p for a, p in zip(adjusted, pvalues))


def test_the_verdicts_give_the_raw_p_and_the_holm_adjusted_p_apart(monkeypatch):
    """Issue 59: the column headed "p (Holm)" held the raw p; a family of three with raw p 0.001, 0.02 and 0.3 has
    Holm-adjusted p 0.003, 0.04 and 0.3, each in its own column."""
    def contrast(label, p):
        return {"label": label, "n": 5, "mean": 0.1, "ci": [0.05, 0.15], "p": p, "want": "above", "mde": 0.05,
                "blocks": {"A": [5, 0.1]}}

    family = A.with_holm([contrast("a", 0.001), contrast("b", 0.02), contrast("c", 0.3)])
    assert [c["p_holm"] for c in family] == pytest.approx([0.003, 0.04, 0.3])
    monkeypatch.setattr(A, "claims", lambda study: {"betas": family, "dynamic": [], "accuracy": [],
                                                    "keeps_accuracy": [], "od_never_switched": {}})
    text = A.verdicts_report({})
    assert "| claim | seeds | estimate [95% CI] | p | p, Holm-adjusted | MDE |" in text
    assert "| a | 5 | +0.1000 [+0.0500, +0.1500] | 0.001 | 0.003 (survives) | 0.0500 | holds |" in text
    assert "| b | 5 | +0.1000 [+0.0500, +0.1500] | 0.020 | 0.040 (survives) | 0.0500 | holds |" in text
    assert "| c | 5 | +0.1000 [+0.0500, +0.1500] | 0.300 | 0.300 (does not survive) | 0.0500 | holds uncorrected only" \
        in text
