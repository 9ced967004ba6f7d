"""The fourth study's readings, by docs/study-protocol-stability.md, re-derived from its JSON alone (tools/study.py
writes it from the run folders):

    python -m tools.study_stability     # docs/figures/study-stability/{arms,verdicts,dose,mechanism}.md, curves.png

Per run: final avg@8 (P1), the lowest 10-step mean training accuracy after step 10 (P2), collapse and onset (the third
study's definition, tools/study_collapse.py), and the dose over steps 1-19. Per contrast: the paired differences over
the seeds both arms ran within one block (one warm start), each family's paired t-tests with Holm's correction over its
contrasts and both endpoints, and the verdict its rule gives; family 4's slope and difference; the dose's prediction
tested on these runs; what the beta1 region's gradient did; entropy; the accuracy cost where nothing collapsed. Each
part reads what exists so far and says what is missing.
"""

import math
import os

from cegppo_utils import cli
from cegppo_utils.data import UserError
from tools import study_json
from tools.configs import CONFIGS, STABILITY_ARMS
from tools.stats import (
    ImpossibleInput,
    auc,
    auc_bootstrap_ci,
    exact_rate_ci,
    fisher_exact,
    holm,
    holm_adjusted,
    logit_mean_ci,
    mean_ci,
    min_detectable,
    rate_difference_ci,
    sign_flip_p,
    slope_ci,
    t_sf,
    t_test_p,
)
from tools.study_collapse import (  # the third study's run length, windows and collapse: the same here
    STEPS,
    entropy_contrast,
    final_acc,
    finished,
    incidence,
    mean_over,
    no_eos_onset,
    onset,
    paired_entropy,
    step_rows,
    value_problem,
    window_means,
    write,
)
from tools.study_json import configurations, load_study

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JSON = study_json.stored(os.path.join(ROOT, "docs", "figures", "study-stability.json.gz"))
FIGURES = os.path.join(ROOT, "docs", "figures", "study-stability")
ALPHA = 0.05
DOSE_STEPS, DOSE_THRESHOLD = 19, 0.0013  # the prediction: a run collapses when its mean dose over steps 1-19 > 0.13%
MARGIN = -0.10  # family 2: "removes" needs the ratio-aware arm's P1 interval against the control above -10 points
# the arms with a beta1 region that trains, and their beta1, read from the flags they ran with (tools/configs.py)
BETA1 = {a: float(CONFIGS[a][CONFIGS[a].index("--beta1") + 1]) for a in STABILITY_ARMS}
BETA1 = {a: b for a, b in BETA1.items() if b > 0}
LR = {a: float(CONFIGS[a][CONFIGS[a].index("--lr") + 1]) if "--lr" in CONFIGS[a] else 2e-4 for a in STABILITY_ARMS}
CELLS = [("lr 2e-4, 8 steps", "ce_gppo_0.5_1", "ppo_clip_tm", 2e-4), ("lr 1e-4, 8 steps", "ce_gppo_0.5_1_lr1e-4",
         "ppo_clip_tm_lr1e-4", 1e-4), ("lr 5e-5, 8 steps", "ce_gppo_0.5_1_lr5e-5", "ppo_clip_tm_lr5e-5", 5e-5),
         ("lr 8e-4, 2 steps", "ce_gppo_0.5_1_u2_lr8e-4", "ppo_clip_tm_u2_lr8e-4", 8e-4)]
FAMILIES = [
    ("1. beta1 against its token-mean control, per cell", [(a, c) for _, a, c, _ in CELLS]
     + [("ce_gppo_1_1", "ppo_clip_tm")]),
    ("2. the mechanism: the ratio-aware beta1", [("ce_gppo_1_1_ratio", "ce_gppo_1_1"),
                                                ("ce_gppo_0.5_1_ratio", "ce_gppo_0.5_1")]),
    ("3. the recipe's parts", [("ce_gppo_0.5_1_nll", "ce_gppo_0.5_1"), ("ce_gppo_0.5_1_oversample", "ce_gppo_0.5_1")]),
]
SHOWN = [("ce_gppo_1_1_ratio", "ppo_clip_tm"), ("ce_gppo_0.5_1_ratio", "ppo_clip_tm"),
         ("ce_gppo_0.5_1_nll", "ppo_clip_tm"), ("ce_gppo_0.5_1_oversample", "ppo_clip_tm"),
         # added 2026-11-29: the lr 2e-4 control against the lr 1e-4 one (is the reference cell's control itself
         # impaired?), and the ratio-aware (0.5, 1) against the better control
         ("ppo_clip_tm", "ppo_clip_tm_lr1e-4"), ("ce_gppo_0.5_1_ratio", "ppo_clip_tm_lr1e-4")]
# What a step of the fourth study's runs must hold where it holds it: finite numbers, proportions within [0, 1].
STABILITY_NUMBERS = ("beta1_dose", "grad_norm_low_neg", "grad_norm_high_pos", "grad_norm_rest",
                     "grad_cos_low_neg_rest", "low_neg_ratio_p10")
ENDPOINTS = {"P1": "final avg@8", "P2": "lowest 10-step training accuracy"}


# --- one run -------------------------------------------------------------------------------------------------------

def lowest_accuracy(run) -> float | None:
    """P2: the lowest mean acc_mean over steps s..s+9, s >= 11 (None for a run without such a window)."""
    means = window_means(run)
    return min(means.values()) if means else None


def endpoint(run, name: str):
    return final_acc(run) if name == "P1" else lowest_accuracy(run)


def dose_1_19(run) -> float:
    """The mean beta1_dose over the steps 1-19 that logged it (0 where none did: no step trained a beta1 region)."""
    values = [r["beta1_dose"] for r in step_rows(run) if r["step"] <= DOSE_STEPS and r.get("beta1_dose") is not None]
    return sum(values) / len(values) if values else 0.0


# --- contrasts -----------------------------------------------------------------------------------------------------

def pairs(study: dict, arm: str, against: str) -> list[tuple[str, dict, dict]]:
    """(seed, run, comparator's run) for each seed both finished from the same warm start (one block)."""
    a, b = finished(study.get(arm, {})), finished(study.get(against, {}))
    return [(s, a[s], b[s]) for s in sorted(set(a) & set(b), key=int)
            if a[s].get("model_sha256") == b[s].get("model_sha256")]


def paired(study: dict, arm: str, against: str, name: str) -> dict | None:
    """The paired differences of endpoint `name`: n, mean, 95% t-interval, t-test p, sign-flip p (None: no pair)."""
    diffs = [endpoint(x, name) - endpoint(y, name) for _, x, y in pairs(study, arm, against)
             if endpoint(x, name) is not None and endpoint(y, name) is not None]
    if len(diffs) < 2:
        return {"n": len(diffs)} if diffs else None
    mean, (lo, hi) = mean_ci(diffs)
    return {"n": len(diffs), "mean": mean, "lo": lo, "hi": hi, "p": t_test_p(diffs), "flip_p": sign_flip_p(diffs),
            "sd": math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)), "diffs": diffs}


def without_seed(study: dict, seed: str) -> dict:
    """The study with one seed's runs left out of every arm."""
    return {arm: ({s: r for s, r in runs.items() if s != seed} if not arm.startswith("_") else runs)
            for arm, runs in study.items()}


def leave_one_out(study: dict, tests) -> dict:
    """{(arm, endpoint): (in how many of the seeds left out, one at a time, the contrast still holds after Holm, how
    many seeds were tried)}: how far a verdict rests on one seed (added 2026-11-29, not in the protocol)."""
    seeds = sorted({s for a, b in tests for s, _, _ in pairs(study, a, b)}, key=int)
    held = {}
    for seed in seeds:
        for r in family_rows(without_seed(study, seed), tests):
            key = (r["arm"], r["endpoint"])
            held[key] = held.get(key, 0) + (r["verdict"] == "holds")
    return {key: (n, len(seeds)) for key, n in held.items()}


def family_rows(study: dict, tests) -> list[dict]:
    """Each contrast x endpoint of a family with its raw and Holm-adjusted p and verdict. Holm counts every test of the
    family, one without two pairs yet as p = 1, so missing runs never loosen the others' thresholds."""
    rows = [{"arm": a, "against": b, "endpoint": e, **(paired(study, a, b, e) or {"n": 0})}
            for a, b in tests for e in ENDPOINTS]
    ps = [r.get("p", 1.0) for r in rows]
    for r, adjusted, reject in zip(rows, holm_adjusted(ps), holm(ps, ALPHA)):
        r["holm"] = adjusted if "p" in r else None
        r["verdict"] = ("too few pairs" if "p" not in r else "holds" if reject
                        else "holds uncorrected only" if r["p"] <= ALPHA else "not shown")
    return rows


# --- family 4: what sets it ---------------------------------------------------------------------------------------

def cell_differences(study: dict, cell) -> dict:
    """{seed: the cell's paired P1 difference, (0.5, 1) minus its control}."""
    _, arm, control, _ = cell
    return {s: final_acc(x) - final_acc(y) for s, x, y in pairs(study, arm, control)
            if final_acc(x) is not None and final_acc(y) is not None}


def what_sets_it(study: dict) -> dict:
    """The slope of the 8-step cells' P1 differences on log2(lr), and the 2-step cell's difference minus the reference
    cell's, paired by seed; Holm over the two; the protocol's reading."""
    xs, ys = [], []
    for cell in CELLS[:3]:
        for d in cell_differences(study, cell).values():
            xs.append(math.log2(cell[3]))
            ys.append(d)
    out = {"slope_points": len(xs)}
    if len(xs) >= 3 and len(set(xs)) > 1:
        out["slope"], (out["slope_lo"], out["slope_hi"]), out["slope_p"] = slope_ci(xs, ys)
    ref, two = cell_differences(study, CELLS[0]), cell_differences(study, CELLS[3])
    steps = [two[s] - ref[s] for s in sorted(set(ref) & set(two), key=int)]
    out["steps_pairs"] = len(steps)
    if len(steps) >= 2:
        out["steps_mean"], (out["steps_lo"], out["steps_hi"]) = mean_ci(steps)
        out["steps_p"] = t_test_p(steps)
    ps = [out.get("slope_p", 1.0), out.get("steps_p", 1.0)]
    out["slope_holds"], out["steps_holds"] = holm(ps, ALPHA) if "slope_p" in out and "steps_p" in out else (False,
                                                                                                            False)
    if len(steps) >= 2:
        out["steps_flip_p"] = sign_flip_p(steps)
    out.update(lack_of_fit(xs, ys))
    low, mid = cell_differences(study, CELLS[2]), cell_differences(study, CELLS[1])
    small = [mid[s] - low[s] for s in sorted(set(low) & set(mid), key=int)]
    if len(small) >= 2:  # the two smallest steps: does halving lr from 1e-4 to 5e-5 change the deficit at all?
        out["small_mean"], (out["small_lo"], out["small_hi"]) = mean_ci(small)
        out["small_pairs"] = len(small)
    return out


def lack_of_fit(xs, ys) -> dict:
    """The F-test of a straight line against one mean per x (added 2026-11-29): the line's residual sum of squares
    split into pure error (within each x) and lack of fit; F = (SS_lof / (groups - 2)) / (SS_pe / (n - groups)). With
    three groups F has 1 numerator degree of freedom, so p = P(|T| > sqrt(F)) for Student's t with n - groups."""
    groups = {}
    for x, y in zip(xs, ys):
        groups.setdefault(x, []).append(y)
    n, k = len(ys), len(groups)
    if k != 3 or n - k < 1:
        return {}
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    pure = sum((y - sum(g) / len(g)) ** 2 for g in groups.values() for y in g)
    if pure <= 0:
        return {}
    f = (residual - pure) / (k - 2) / (pure / (n - k))
    return {"lof_f": f, "lof_df": (k - 2, n - k), "lof_p": min(1.0, 2 * t_sf(math.sqrt(max(f, 0.0)), n - k)),
            "cell_means": {x: sum(g) / len(g) for x, g in sorted(groups.items())}}


def reading(study: dict, sets: dict) -> str:
    """The protocol's sentence for family 4."""
    if "slope_p" not in sets or "steps_p" not in sets:
        return "not yet testable (too few pairs)"
    two_cell = next(r for r in family_rows(study, FAMILIES[0][1]) if r["arm"] == CELLS[3][1] and r["endpoint"] == "P1")
    if sets["steps_holds"] and not sets["slope_holds"]:
        return ("the number of off-policy steps per batch sets it; the summed step size alone does not"
                if two_cell["verdict"] == "not shown" else
                "fewer steps per batch reduce it, but the 2-step cell's own deficit is shown: not the protocol's "
                "sentence")
    if sets["slope_holds"] and not sets["steps_holds"]:
        return "the size of each step sets it"
    return "both do" if sets["slope_holds"] else "not separated here"


# --- the dose's prediction -----------------------------------------------------------------------------------------

def prediction(study: dict, arms) -> dict | None:
    """The 0.13% rule on the finished runs of `arms`: the AUC of dose_1_19 with its stratified bootstrap interval, the
    AUC of beta1 alone, sensitivity and specificity with exact intervals, and the runs it got wrong."""
    runs = [(arm, s, r) for arm in arms for s, r in finished(study.get(arm, {})).items()]
    collapsed = [(arm, s, dose_1_19(r)) for arm, s, r in runs if onset(r) is not None]
    survived = [(arm, s, dose_1_19(r)) for arm, s, r in runs if onset(r) is None]
    out = {"runs": len(runs), "collapsed": len(collapsed), "survived": len(survived)}
    if not collapsed or not survived:
        return out
    pos, neg = [d for _, _, d in collapsed], [d for _, _, d in survived]
    if len(pos) < 2 or len(neg) < 2:  # a bootstrap interval from one run of a class is that run's order: no claim
        return out
    out.update(auc=auc(pos, neg), auc_ci=auc_bootstrap_ci(pos, neg))
    beta = [BETA1.get(a, 0.0) for a, _, _ in collapsed], [BETA1.get(a, 0.0) for a, _, _ in survived]
    out["beta1_auc"] = auc(*beta)
    # added 2026-11-29, shown: the arm's lr alone as the score, and the dose within each arm where both outcomes occur
    out["lr_auc"] = auc([LR[a] for a, _, _ in collapsed], [LR[a] for a, _, _ in survived])
    by_arm = {arm: ([d for a, _, d in collapsed if a == arm], [d for a, _, d in survived if a == arm]) for arm in arms}
    out["by_arm"] = {arm: auc(up, down) for arm, (up, down) in by_arm.items() if up and down}
    hits, rejections = sum(d > DOSE_THRESHOLD for d in pos), sum(d <= DOSE_THRESHOLD for d in neg)
    out.update(sensitivity=(hits, len(pos), exact_rate_ci(hits, len(pos))),
               specificity=(rejections, len(neg), exact_rate_ci(rejections, len(neg))),
               wrong=[(a, s, d, True) for a, s, d in collapsed if d <= DOSE_THRESHOLD]
               + [(a, s, d, False) for a, s, d in survived if d > DOSE_THRESHOLD])
    out["ranks"] = out["auc_ci"][0] > 0.5
    out["rule_holds"] = out["sensitivity"][2][0] > 0.5 and out["specificity"][2][0] > 0.5
    return out


# --- what the beta1 region's gradient did ------------------------------------------------------------------------

MECHANISM = (("low_neg_share_of_rest", "beta1 part / rest"), ("grad_cos_low_neg_rest", "cos(beta1 part, rest)"),
             ("grad_norm_low_neg", "beta1 part"), ("grad_norm_high_pos", "beta2 part"), ("grad_norm_rest", "rest"),
             ("beta1_dose", "dose"), ("clip_frac_low_neg", "beta1 region share"),
             ("low_neg_ratio_p10", "region d p10"))


def mechanism_means(run, first=None, last=None) -> dict:
    """The run's mean of each MECHANISM metric over steps first..last (inclusive; None: open); the beta1 part's norm
    over the rest's is taken per step, on the steps that logged both (the last mini-batch's)."""
    rows = [r for r in step_rows(run) if (first is None or r["step"] >= first) and (last is None or r["step"] <= last)]
    out = {key: mean_over(rows, key) for key, _ in MECHANISM[1:]}
    out["low_neg_share_of_rest"] = mean_over([{"x": share_of_rest(r)} for r in rows], "x")
    return out


def share_of_rest(row) -> float | None:
    """A step's beta1 part over the rest (gradient norms of its last mini-batch); None where it logged neither."""
    if row.get("grad_norm_low_neg") is None or not row.get("grad_norm_rest"):
        return None
    return row["grad_norm_low_neg"] / row["grad_norm_rest"]


def mechanism_rows(study: dict, arms) -> list[dict]:
    """Per arm and collapse status, the mean over runs of mechanism_means over steps 1-10 and before the onset."""
    rows = []
    for arm in arms:
        runs = finished(study.get(arm, {}))
        for status in ("collapsed", "did not collapse"):
            chosen = [r for r in runs.values() if (onset(r) is not None) == (status == "collapsed")]
            for window in ("steps 1-10", "before onset") if chosen else ():
                per_run = [mechanism_means(r, 1, 10) if window == "steps 1-10" else
                           mechanism_means(r, None, (onset(r) - 1) if onset(r) else None) for r in chosen]
                rows.append({"arm": arm, "status": status, "runs": len(chosen), "window": window,
                             **{k: mean_over(per_run, k) for k, _ in MECHANISM}})
    return rows


# --- the pages -----------------------------------------------------------------------------------------------------

def points(x, signed=True) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"


def num(x, digits=3) -> str:
    return "n/a" if x is None else f"{x:.{digits}g}"


def arms_table(study: dict, arms) -> str:
    lines = ["| arm | runs | collapsed [exact 95% CI] | onsets | P1 final avg@8, mean [95% CI, logit] | "
             "P2 lowest 10-step accuracy, mean | dose steps 1-19, mean | no-EOS collapse (added) | its onsets |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        runs = finished(study.get(arm, {}))
        if not runs:
            lines.append(f"| `{arm}` | 0 | | | | | | | |")
            continue
        ordered = [r for _, r in sorted(runs.items(), key=lambda kv: int(kv[0]))]
        onsets = [onset(r) for r in ordered]
        finals = [final_acc(r) for r in ordered if final_acc(r) is not None]
        lows = [lowest_accuracy(r) for r in ordered if lowest_accuracy(r) is not None]
        k = sum(o is not None for o in onsets)
        lo, hi = exact_rate_ci(k, len(ordered))
        p1 = "n/a" if len(finals) < 2 else "{:.1f} [{:.1f}, {:.1f}]".format(
            100 * logit_mean_ci(finals)[0], *(100 * v for v in logit_mean_ci(finals)[1]))
        lines.append(f"| `{arm}` | {len(ordered)} | {k} [{100 * lo:.0f}%, {100 * hi:.0f}%] | "
                     f"{', '.join('-' if o is None else str(o) for o in onsets)} | {p1} | "
                     f"{points(sum(lows) / len(lows), False) if lows else 'n/a'} | "
                     f"{100 * sum(dose_1_19(r) for r in ordered) / len(ordered):.3f}% | "
                     f"{sum(no_eos_onset(r) is not None for r in ordered)} | "
                     f"{', '.join('-' if no_eos_onset(r) is None else str(no_eos_onset(r)) for r in ordered)} |")
    return "\n".join(lines)


def failed_runs(study: dict, arms) -> list[str]:
    """Every segment of a run that ended in a nonzero exit code, by arm and seed (a failed run is reported as failed,
    as the protocol says, even where its data are complete)."""
    return [f"`{arm}` seed {seed}, steps {seg.get('from_step')}-{seg.get('to_step')}: exit code {seg['exit_code']}"
            for arm in arms for seed, run in sorted(study.get(arm, {}).items(), key=lambda kv: int(kv[0]))
            for seg in run.get("hardware") or [] if seg.get("exit_code") not in (0, None)]


def contrast_cells(r: dict) -> str:
    if "mean" not in r:
        return f"{r['n']} | n/a | n/a | n/a | n/a"
    mde = min_detectable(r["sd"], r["n"]) if r["sd"] > 0 and r["n"] >= 2 else None
    return (f"{r['n']} | {points(r['mean'])} [{points(r['lo'])}, {points(r['hi'])}] | {r['p']:.3g} | "
            f"{r['flip_p']:.3g} | {points(mde, False) if mde is not None else 'n/a'}")


def family_section(study: dict, name: str, tests) -> list[str]:
    out = [f"## {name}", "", "| arm | against | endpoint | pairs | paired difference, points [95% CI] | p (t) | "
           "p (sign flips) | MDE at 5% | p (Holm) | verdict | holds leaving one seed out | collapsed (arm / against) | "
           "difference in rate [95% CI, Newcombe] | Fisher p |", "|---" * 14 + "|"]
    rows, kept = family_rows(study, tests), leave_one_out(study, tests)
    for r in rows:
        (a, n1), (b, n2) = incidence(study.get(r["arm"], {})), incidence(study.get(r["against"], {}))
        fisher = f"{fisher_exact(a, n1, b, n2):.3g}" if n1 and n2 else "n/a"
        newcombe = "n/a" if not (n1 and n2) else "{:+.0f} [{:+.0f}, {:+.0f}]".format(
            *(100 * v for v in rate_difference_ci(a, n1, b, n2)))
        adjusted = "n/a" if r["holm"] is None else f"{r['holm']:.3g}"
        held, tried = kept.get((r["arm"], r["endpoint"]), (0, 0))
        out.append(f"| `{r['arm']}` | `{r['against']}` | {r['endpoint']} | {contrast_cells(r)} | {adjusted} | "
                   f"{r['verdict']} | {f'{held} of {tried}' if tried else 'n/a'} | {a} of {n1} / {b} of {n2} | "
                   f"{newcombe} | {fisher} |")
    return out + ["", floor_line(rows), ""]


def floor_line(rows: list[dict]) -> str:
    """What the exact sign-flip test can reach at the family's pairs (added 2026-11-29): 2 / 2^n, and that times the
    family's size after Holm."""
    ns = sorted({r["n"] for r in rows if r.get("n", 0) >= 2})
    if not ns:
        return "No contrast has two pairs yet."
    n = ns[0]
    return (f"With {n} pairs an exact sign-flip p cannot fall below 2 / 2^{n} = {2 / 2 ** n:.2g}; in a family of "
            f"{len(rows)} tests its Holm-adjusted value cannot fall below {min(1.0, len(rows) * 2 / 2 ** n):.2g}, so "
            "a verdict that holds here rests on the t-test alone. \"Holds leaving one seed out\" (added after the "
            "runs): in how many of the seeds, each left out in turn, the verdict still holds after Holm.")


def removes_lines(study: dict) -> list[str]:
    """Family 2's reading per beta1: "removes" (the contrast holds on both endpoints and the ratio-aware arm's P1
    interval against the control lies above MARGIN), "reduces" (it holds, the margin not met), or neither."""
    rows = family_rows(study, FAMILIES[1][1])
    out = []
    for arm, against in FAMILIES[1][1]:
        held = [r["verdict"] == "holds" for r in rows if r["arm"] == arm]
        vs_control = paired(study, arm, "ppo_clip_tm", "P1")
        lo = vs_control.get("lo") if vs_control else None
        if all(held) and lo is not None and lo > MARGIN:
            what = "**removes** the instability"
        elif all(held):
            what = "**reduces** it (the margin of -10 points against the control is not met)"
        else:
            what = "is not shown to change it"
        against_control = "n/a" if lo is None else \
            f"{points(vs_control['mean'])} [{points(lo)}, {points(vs_control['hi'])}]"
        out.append(f"- `{arm}` against `{against}`: the ratio-aware weight {what}; P1 against `ppo_clip_tm`: "
                   f"{against_control}.")
    return out + [""]


def sets_section(study: dict) -> list[str]:
    s = what_sets_it(study)
    out = ["## 4. what sets it", ""]
    if "slope_p" in s:
        out.append(f"- Step size at 8 steps: slope of the P1 difference on log2(lr), {points(s['slope'])} points per "
                   f"doubling [{points(s['slope_lo'])}, {points(s['slope_hi'])}], p {s['slope_p']:.3g} "
                   f"({s['slope_points']} points){'; holds (Holm over 2)' if s['slope_holds'] else ''}.")
    if "steps_p" in s:
        held = "; holds (Holm over 2)" if s["steps_holds"] else ""
        out.append(f"- Steps per batch at one summed step size: P1 difference at 2 steps (lr 8e-4) minus at 8 steps "
                   f"(lr 2e-4), {points(s['steps_mean'])} [{points(s['steps_lo'])}, {points(s['steps_hi'])}], p "
                   f"{s['steps_p']:.3g}, sign flips {s['steps_flip_p']:.3g} ({s['steps_pairs']} seeds){held}.")
    out.append(f"- The protocol's reading: **{reading(study, s)}**.")
    if "lof_f" in s:  # added 2026-11-29
        means = ", ".join(f"{points(m)} at lr {2 ** x:.0e}".replace("e-0", "e-") for x, m in s["cell_means"].items())
        out.append(f"- Added after the runs, shown: the cells' mean P1 differences are {means}. A lack-of-fit test of "
                   f"the straight line against one mean per lr: F({s['lof_df'][0]}, {s['lof_df'][1]}) = "
                   f"{s['lof_f']:.1f}, p {s['lof_p']:.2g}"
                   + (": the line does not describe them, so the slope measures a threshold between the lrs, not a "
                      "rate per doubling." if s["lof_p"] <= ALPHA else "."))
    if "small_mean" in s:
        out.append(f"- Added after the runs, shown: the P1 difference at lr 1e-4 minus at 5e-5, "
                   f"{points(s['small_mean'])} [{points(s['small_lo'])}, {points(s['small_hi'])}] "
                   f"({s['small_pairs']} seeds).")
    out.append("- Departure from the protocol, said where it is read: at 8 steps lr moves the size of each step, the "
               "summed movement per batch (8 x lr) and the off-policy drift that fills the beta1 region together, so "
               "\"the size of each step sets it\" is not separated from the other two; and the 2-step cell's control "
               "collapsed too, so its contrast separates nothing. What the data show is narrower: lr sets it, at 8 "
               "steps. The fifth study (docs/study-protocol-depth.md) separates the three.")
    return out + [""]


def shown_section(study: dict) -> list[str]:
    """Shown, not judged: the recipe's parts and the ratio-aware arms against the control; entropy; cost."""
    out = ["## Shown, not judged", "", "| arm | against | endpoint | pairs | paired difference, points [95% CI] | "
           "p (t) | p (sign flips) | MDE at 5% |", "|---|---|---|---|---|---|---|---|"]
    for arm, against in SHOWN:
        for e in ENDPOINTS:
            r = paired(study, arm, against, e) or {"n": 0}
            out.append(f"| `{arm}` | `{against}` | {e} | {contrast_cells(r)} |")
    out += ["", "The last four rows were added after the runs (2026-11-29)."]
    out += ["", "Entropy before the pair's earlier onset (nats, paired; the third study's secondary endpoint), and "
            "P1 over the seeds where neither run of the pair collapsed (a subgroup chosen by the outcome). Each "
            "contrast is (beta1, 1) minus (0, 0): beta1 and beta2 move together, so none separates what beta1 does "
            "to entropy from what beta2 does.", "",
            "| arm | against | entropy difference [95% CI] | P1 where neither collapsed, points |", "|---|---|---|---|"]
    for arm, against in FAMILIES[0][1]:
        e = entropy_contrast(study, arm, against)
        calm = [final_acc(x) - final_acc(y) for _, x, y in pairs(study, arm, against)
                if onset(x) is None and onset(y) is None]
        ent = paired_entropy(e)
        cost = "n/a (no such pair)" if not calm else f"{points(sum(calm) / len(calm))} ({count_pairs(len(calm))})"
        out.append(f"| `{arm}` | `{against}` | {ent} | {cost} |")
    return out + [""]


def count_pairs(n: int) -> str:
    return f"{n} pair" if n == 1 else f"{n} pairs"


def verdicts_page(study: dict) -> str:
    out = ["# The fourth study: verdicts", "",
           "By docs/study-protocol-stability.md, re-derived from the study's JSON by "
           "`python -m tools.study_stability`. P1: final avg@8; P2: the lowest 10-step mean training accuracy after "
           "step 10; paired over the seeds both arms finished in one block. Paired t-test per contrast and endpoint "
           "(the sign-flip p beside it), Holm within each family over its contrasts and both endpoints; **holds** "
           f"(Holm-adjusted p <= {ALPHA}), **holds uncorrected only** (raw p <= {ALPHA}) or **not shown**, the MDE "
           "(80% power at 5%, from the pairs' own SD) beside it. Collapse (the third study's definition) with "
           "Fisher's exact test, secondary.", ""]
    for i, (name, tests) in enumerate(FAMILIES):
        out += family_section(study, name, tests) + (removes_lines(study) if i == 1 else [])
    return "\n".join(out + sets_section(study) + shown_section(study))


def dose_page(study: dict, arms) -> str:
    out = ["# The fourth study: the dose's prediction, out of sample", "",
           f"Written into the protocol before any run: a run collapses when its mean `beta1_dose` over steps 1-"
           f"{DOSE_STEPS} exceeds {100 * DOSE_THRESHOLD:.2f}%. Tested on the finished runs of the arms with beta1 > 0 "
           "(then, shown, on every run, the controls' dose 0 included). AUC: ties half; 95% interval from a stratified "
           "bootstrap (10,000 resamples, seed 0). Sensitivity and specificity with exact (Clopper-Pearson) intervals.",
           ""]
    for label, chosen in (("the arms with beta1 > 0 (the test)", [a for a in arms if a in BETA1]),
                          ("every arm (shown)", list(arms))):
        p = prediction(study, chosen)
        out += [f"## {label[0].upper() + label[1:]}", ""]
        if p is None or "auc" not in p:
            out += [f"{p['runs'] if p else 0} finished runs, {p['collapsed'] if p else 0} collapsed: not testable (an "
                    "AUC and its bootstrap interval need at least two runs of each outcome).", ""]
            continue
        (hits, n_pos, (slo, shi)), (rej, n_neg, (plo, phi)) = p["sensitivity"], p["specificity"]
        out += [f"- {p['runs']} runs, {p['collapsed']} collapsed. AUC of the dose {p['auc']:.3f} "
                f"[{p['auc_ci'][0]:.3f}, {p['auc_ci'][1]:.3f}]: "
                f"{'**ranks collapse out of sample**' if p['ranks'] else 'not shown to rank collapse'}; beta1 alone "
                f"{p['beta1_auc']:.3f}; the arm's lr alone {p['lr_auc']:.3f} (added after the runs).",
                "- Within each arm where both outcomes occur (added after the runs, shown; no interval): "
                + (", ".join(f"`{a}` {v:.2f}" for a, v in p["by_arm"].items()) or "none") + ".",
                f"- The {100 * DOSE_THRESHOLD:.2f}% rule: sensitivity {hits} of {n_pos} [{100 * slo:.0f}%, "
                f"{100 * shi:.0f}%], specificity {rej} of {n_neg} [{100 * plo:.0f}%, {100 * phi:.0f}%]: "
                f"{'**holds**' if p['rule_holds'] else 'does not hold (a lower end at or below 50%)'}.",
                "- Wrong: " + (", ".join(f"`{a}` seed {s} (dose {100 * d:.3f}%, "
                                         f"{'collapsed' if c else 'did not collapse'})"
                                         for a, s, d, c in p["wrong"]) or "none") + ".", ""]
    return "\n".join(out)


def mechanism_page(study: dict, arms) -> str:
    out = ["# The fourth study: what the beta1 region's gradient did", "",
           "Per arm and by whether the run collapsed, the mean over its runs of each step's values, over steps 1-10 "
           "and over the steps before the run's onset (all 200 for a run that did not collapse). The gradient parts "
           "are the norms of the last mini-batch's gradient, before clipping, from the beta1 region's tokens, the "
           "beta2 region's and the rest (train.py --region-grad-norms); `beta1 part / rest` is their ratio per step. "
           "The dose and the region's share are over every token of the step. Shown, not judged.", "",
           "| arm | runs | window | " + " | ".join(label for _, label in MECHANISM) + " |",
           "|---|---|---|" + "---|" * len(MECHANISM)]
    for r in mechanism_rows(study, arms):
        cells = [f"{100 * r[k]:.3f}%" if k in ("beta1_dose", "clip_frac_low_neg") and r[k] is not None
                 else num(r[k]) for k, _ in MECHANISM]
        out.append(f"| `{r['arm']}` {r['status']} | {r['runs']} | {r['window']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


PANELS = (("acc_mean", "training accuracy", "accuracy"), ("entropy", "mean token entropy (nats)", "entropy"),
          ("response_length_mean", "mean response length (tokens)", "response length"),
          ("low_neg_share_of_rest", "beta1 part / rest (gradient norms)", "the beta1 region's gradient"))


def figures(study: dict, arms, folder: str):
    """PANELS against step, each arm's mean over its finished runs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cegppo_utils import runfolder
    fig, axes = plt.subplots(1, len(PANELS), figsize=(6 * len(PANELS), 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, arm in enumerate(arms):
        runs = list(finished(study.get(arm, {})).values())
        if not runs:
            continue
        by_step = [{r["step"]: {**r, "low_neg_share_of_rest": share_of_rest(r)} for r in step_rows(run)}
                   for run in runs]
        for ax, (key, _, _) in zip(axes, PANELS):
            means = [(s, mean_over([rows.get(s, {}) for rows in by_step], key)) for s in range(1, STEPS + 1)]
            ax.plot([s for s, m in means if m is not None], [m for _, m in means if m is not None],
                    label=f"{arm} ({len(runs)})", lw=1, color=colors[i % len(colors)],
                    ls="--" if arm.startswith("ppo_clip_tm") else "-")
    for ax, (_, label, title) in zip(axes, PANELS):
        ax.set(xlabel="step", ylabel=label, title=title)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    runfolder.save_figure(fig, os.path.join(folder, "curves.png"), dpi=100)
    plt.close(fig)


OUTPUTS = ("arms.md", "verdicts.md", "dose.md", "mechanism.md", "curves.png")


def report(json_path: str = JSON, folder: str = FIGURES):
    """Every page and the figure from the study's JSON; a JSON the pages cannot read is a one-line UserError, found
    before anything is written."""
    from tools.configs import STABILITY_ARMS
    study = load_study(json_path, "--json")
    problem = value_problem(study, STABILITY_NUMBERS)
    if problem:
        raise UserError(f"--json {cli.short(json_path)}: not {study_json.WHAT} ({problem})")
    os.makedirs(folder, exist_ok=True)
    hashes = sorted({run.get("model_sha256") or "unknown" for runs in configurations(study).values()
                     for run in runs.values()})
    failed = failed_runs(study, STABILITY_ARMS)
    write(os.path.join(folder, "arms.md"), "# The fourth study: every arm\n\nWarm start(s) (one block each): "
          + ", ".join(f"`{h}`" for h in hashes) + f". Finished runs only ({STEPS} steps). No-EOS collapse (added "
          "2026-11-29): a 10-step mean share of responses that hit the length cap above 50%.\n\n"
          + arms_table(study, STABILITY_ARMS) + "\n\nFailed runs (a nonzero exit code; their data are complete where "
          "the table counts them): " + ("; ".join(failed) if failed else "none") + ".")
    write(os.path.join(folder, "verdicts.md"), verdicts_page(study))
    write(os.path.join(folder, "dose.md"), dose_page(study, STABILITY_ARMS))
    write(os.path.join(folder, "mechanism.md"), mechanism_page(study, STABILITY_ARMS))
    figures(study, STABILITY_ARMS, folder)
    return study


def main(argv=None):
    """The command line: bad input is one line and exit code 2, found before anything is written."""
    parser = cli.Parser("study_stability.py", description=__doc__)
    parser.add_argument("--json", default=JSON, help="the study's JSON (tools/study.py --json)")
    parser.add_argument("--figures", default=FIGURES, help="where the tables and figures go")
    args = parser.parse_args(argv)
    json_path, figures_dir = os.path.expanduser(args.json), os.path.expanduser(args.figures)
    problem = (cli.input_problem(json_path, "--json") or cli.folder_problem(figures_dir, "--figures")
               or cli.outputs_problem(figures_dir, OUTPUTS, "--figures"))
    if problem:
        parser.error(problem)
    cli.guard("study_stability.py", report, json_path, figures_dir, refused=(ImpossibleInput,))
    print(f"study_stability: tables and figures in {figures_dir}")


if __name__ == "__main__":
    main()
