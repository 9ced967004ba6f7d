"""The fifth study's readings, by docs/study-protocol-depth.md, re-derived from its JSON alone (tools/study.py writes
it from the run folders):

    python -m tools.study_depth     # docs/figures/study-depth/{arms,verdicts,summary}.md and curves.png

Per run: final avg@8 (P1), the lowest 10-step mean training accuracy after step 10 (P2), collapse and its onset (the
third study's definition), the truncation endpoint (the share of responses that hit the length cap per 10-step window;
a "no-EOS collapse" where a 10-step mean passes 50%), entropy over all steps and over the last 50, and the machine's
time. Per contrast: paired differences over the seeds both arms finished within one block (one warm start), the
paired t-test and the exact sign-flip p, Holm within each family over its contrasts and endpoints, the minimum
detectable effect, and the reading the protocol fixed: where (0.5, 1) is unstable and what that says (family 1),
whether CE-GPPO, DAPO or the ratio-aware weight is better than, equivalent to or worse than token-mean PPO-clip where
that control learns (family 2), and what beta2 and beta1 each do to entropy when varied alone (family 3). Each part
reads what exists so far and says what is missing.
"""

import math
import os
import statistics

from cegppo_utils import cli
from cegppo_utils.data import UserError
from tools import study_json
from tools.configs import DEPTH_ARMS, DEPTH_CELLS, DEPTH_SEEDS
from tools.stats import (
    ImpossibleInput,
    exact_rate_ci,
    fisher_exact,
    holm,
    holm_adjusted,
    logit_mean_ci,
    mean_ci,
    min_detectable,
    rate_difference_ci,
    sign_flip_p,
    t_test_p,
)
from tools.study_collapse import (  # the third study's run length, windows, collapse and truncation: the same here
    STEPS,
    final_acc,
    finished,
    incidence,
    mean_over,
    no_eos_onset,
    onset,
    step_rows,
    truncation_windows,
    value_problem,
    write,
)
from tools.study_json import configurations, load_study
from tools.study_stability import lowest_accuracy, pairs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JSON = study_json.stored(os.path.join(ROOT, "docs", "figures", "study-depth.json.gz"))
FIGURES = os.path.join(ROOT, "docs", "figures", "study-depth")
ALPHA = 0.05
UNSTABLE = -0.10  # family 1: a cell is unstable when its P1 deficit holds and its interval lies below -10 points,
# stable when the interval lies above -10 points, and otherwise not resolved
MARGIN = 0.05  # family 2: "equivalent" when the P1 interval lies within +-5 points of the control
LAST = 50  # family 3's second window: the last 50 steps (151-200)
ENDPOINTS = {"P1": "final avg@8", "P2": "lowest 10-step training accuracy"}
CONTROL = {cell: arms[0] for cell, (_, _, arms) in DEPTH_CELLS.items()}
ARM = {cell: dict(zip(("control", "0_1", "0.5_1", "dapo", "ratio"), arms)) if cell == "A" else
       dict(zip(("control", "0.5_1", "dapo"), arms)) for cell, (_, _, arms) in DEPTH_CELLS.items()}
FAMILY1 = [(cell, ARM[cell]["0.5_1"], CONTROL[cell]) for cell in ("D", "B", "C")]  # (0.5, 1) minus (0, 0), per cell
FAMILY2 = [(ARM["A"]["0.5_1"], CONTROL["A"]), (ARM["A"]["dapo"], CONTROL["A"]), (ARM["A"]["ratio"], CONTROL["A"]),
           (ARM["B"]["0.5_1"], CONTROL["B"]), (ARM["B"]["dapo"], CONTROL["B"])]
# family 3: (arm, against, what it isolates, the sign the paper's §5 predicts), in cell A, over two windows
FAMILY3 = [(ARM["A"]["0_1"], CONTROL["A"], "beta2 (0 -> 1, beta1 = 0)", +1),
           (ARM["A"]["0.5_1"], ARM["A"]["0_1"], "beta1 (0 -> 0.5, beta2 = 1)", -1)]
WINDOWS = {"steps 1-200": (1, STEPS), f"steps {STEPS - LAST + 1}-{STEPS}": (STEPS - LAST + 1, STEPS)}


# --- one run -------------------------------------------------------------------------------------------------------

def endpoint(run, name: str):
    return final_acc(run) if name == "P1" else lowest_accuracy(run)


def window_entropy(run, lo: int, hi: int) -> float | None:
    """The run's mean token entropy over the steps lo..hi that logged it (a step that trained nothing logs none)."""
    return mean_over([r for r in step_rows(run) if lo <= r["step"] <= hi], "entropy")


def machine_minutes(run) -> float | None:
    """The machine's time the run took, in minutes: the seconds of its hardware segments (None where none is kept)."""
    seconds = [s.get("seconds") for s in run.get("hardware") or [] if isinstance(s.get("seconds"), (int, float))]
    return sum(seconds) / 60 if seconds else None


def step_clock_minutes(run) -> float | None:
    """The run's training time, robust to a paused or shared machine: STEPS times the median of its steps' clocks
    (sampling, reward and update seconds), in minutes; evaluations are not in it."""
    clocks = [sum(r.get(k) or 0.0 for k in ("time_rollout_s", "time_reward_s", "time_update_s"))
              for r in step_rows(run) if r.get("time_update_s") is not None]
    return STEPS * statistics.median(clocks) / 60 if clocks else None


def failures(run) -> list[str]:
    """The run's segments that ended in a nonzero exit code, as "steps a-b: exit code c" (a failed segment is reported,
    even where a resume finished the run)."""
    return [f"steps {s.get('from_step')}-{s.get('to_step')}: exit code {s['exit_code']}"
            for s in run.get("hardware") or [] if s.get("exit_code") not in (0, None)]


def interruptions(run) -> list[str]:
    """The run's segments stopped from outside (no exit code: a session's end, a kill) that a later segment resumed
    from a checkpoint, as "steps a-b, resumed from c": not failures, since a resume repeats the run's steps."""
    segments = run.get("hardware") or []
    return [f"steps {s.get('from_step')}-{s.get('to_step')}, resumed from {nxt.get('from_step')}"
            for s, nxt in zip(segments, segments[1:]) if s.get("exit_code") is None]


# --- contrasts -----------------------------------------------------------------------------------------------------

def summary(diffs: list[float]) -> dict:
    """n, mean, 95% t-interval, t-test p, exact sign-flip p and SD of paired differences ({"n": n} below 2)."""
    if len(diffs) < 2:
        return {"n": len(diffs)}
    mean, (lo, hi) = mean_ci(diffs)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
    return {"n": len(diffs), "mean": mean, "lo": lo, "hi": hi, "p": t_test_p(diffs), "flip_p": sign_flip_p(diffs),
            "sd": sd, "diffs": diffs}


def paired(study: dict, arm: str, against: str, value) -> dict:
    """Paired differences of value(run) (None: not defined for that run) over the seeds both arms finished in one
    block, summarised."""
    return summary([value(x) - value(y) for _, x, y in pairs(study, arm, against)
                    if value(x) is not None and value(y) is not None])


def judge(rows: list[dict]) -> list[dict]:
    """Holm over the family's rows (one without two pairs counts as p 1, so missing runs never loosen the others'
    thresholds); each row's holm and the verdict holds / holds uncorrected only / not shown / too few pairs."""
    ps = [r.get("p", 1.0) for r in rows]
    for r, adjusted, reject in zip(rows, holm_adjusted(ps), holm(ps, ALPHA)):
        r["holm"] = adjusted if "p" in r else None
        r["verdict"] = ("too few pairs" if "p" not in r else "holds" if reject
                        else "holds uncorrected only" if r["p"] <= ALPHA else "not shown")
    return rows


def endpoint_rows(study: dict, tests) -> list[dict]:
    """Each (arm, against) x endpoint of a family, judged together."""
    return judge([{"arm": a, "against": b, "endpoint": e, **paired(study, a, b, lambda r, e=e: endpoint(r, e))}
                  for a, b in tests for e in ENDPOINTS])


def stability(row: dict) -> str:
    """Family 1's reading of one cell from its P1 row: unstable (the deficit holds and the interval lies below
    UNSTABLE), stable (the interval lies above UNSTABLE), or not resolved."""
    if "mean" not in row:
        return "too few pairs"
    if row["verdict"] == "holds" and row["mean"] < 0 and row["hi"] < UNSTABLE:
        return "unstable"
    return "stable" if row["lo"] > UNSTABLE else "not resolved"


def reading(cells: dict) -> str:
    """The protocol's sentence from the cells' states {"D": ..., "B": ..., "C": ...}."""
    if "too few pairs" in cells.values():
        return "not yet testable (a cell has fewer than two pairs)"
    if cells["D"] != "unstable":
        return ("the reference cell D did not replicate the instability in this block (" + cells["D"] + "): no "
                "reading")
    if "not resolved" in (cells["B"], cells["C"]):
        return "not separated here (B or C not resolved)"
    return {("unstable", "unstable"): "the off-policy depth sets it",
            ("unstable", "stable"): "the summed movement per batch sets it",
            ("stable", "stable"): "the size of each step sets it",
            ("stable", "unstable"): "none of the three readings (C unstable where B is not)"}[(cells["B"], cells["C"])]


def benefit(row: dict) -> str:
    """Family 2's reading of a P1 row: better / worse (the contrast holds after Holm), equivalent within +-MARGIN (the
    interval inside the margin, neither holds), or not resolved; a contrast that holds inside the margin says so."""
    if "mean" not in row:
        return "not resolved (too few pairs)"
    inside = -MARGIN < row["lo"] and row["hi"] < MARGIN
    if row["verdict"] == "holds":
        word = "better" if row["mean"] > 0 else "worse"
        return f"{word}, within the margin" if inside else word
    return "equivalent within the margin" if inside else "not resolved"


def entropy_rows(study: dict) -> list[dict]:
    """Family 3: each contrast x window, judged together; the verdict read against the paper's predicted sign."""
    rows = []
    for arm, against, what, sign in FAMILY3:
        for window, (lo, hi) in WINDOWS.items():
            rows.append({"arm": arm, "against": against, "what": what, "sign": sign, "window": window,
                         **paired(study, arm, against, lambda r, lo=lo, hi=hi: window_entropy(r, lo, hi))})
    for r in judge(rows):
        if r["verdict"] == "holds":
            r["reading"] = "as the paper says" if r["mean"] * r["sign"] > 0 else "against the paper"
        else:
            r["reading"] = r["verdict"]
    return rows


# --- the pages -----------------------------------------------------------------------------------------------------

def points(x, signed=True) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"


def nats(x) -> str:
    return "n/a" if x is None else f"{x:+.4f}"


def contrast_cells(r: dict, fmt=points) -> str:
    """pairs | mean [95% CI] | p (t) | p (sign flips) | MDE at 5%."""
    if "mean" not in r:
        return f"{r['n']} | n/a | n/a | n/a | n/a"
    mde = min_detectable(r["sd"], r["n"]) if r["sd"] > 0 else None
    return (f"{r['n']} | {fmt(r['mean'])} [{fmt(r['lo'])}, {fmt(r['hi'])}] | {r['p']:.3g} | {r['flip_p']:.3g} | "
            f"{'n/a' if mde is None else fmt(mde).lstrip('+')}")


def incidence_cells(study: dict, arm: str, against: str) -> str:
    """a of n1 / b of n2 collapsed | the difference in rate with Newcombe's interval | Fisher's p."""
    (a, n1), (b, n2) = incidence(study.get(arm, {})), incidence(study.get(against, {}))
    if not (n1 and n2):
        return f"{a} of {n1} / {b} of {n2} | n/a | n/a"
    d, lo, hi = rate_difference_ci(a, n1, b, n2)
    return f"{a} of {n1} / {b} of {n2} | {100 * d:+.0f} [{100 * lo:+.0f}, {100 * hi:+.0f}] | " \
           f"{fisher_exact(a, n1, b, n2):.3g}"


def floor_line(rows: list[dict]) -> str:
    """What the sign-flip test can reach: with n pairs its p is at least 2 / 2^n, times the family's size under Holm."""
    ns = sorted({r["n"] for r in rows if r["n"] >= 2})
    if not ns:
        return "No contrast has two pairs yet."
    n = ns[0]
    return (f"With {n} pairs an exact sign-flip p cannot fall below 2 / 2^{n} = {2 / 2 ** n:.2g}, so in this family "
            f"of {len(rows)} its Holm-adjusted value cannot fall below {min(1.0, len(rows) * 2 / 2 ** n):.2g}; the "
            "verdicts read the t-test, as the protocol fixed.")


HEAD = ("| arm | against | endpoint | pairs | paired difference [95% CI] | p (t) | p (sign flips) | MDE at 5% | "
        "p (Holm) | verdict |")


def family1_section(study: dict) -> list[str]:
    rows = endpoint_rows(study, [(a, b) for _, a, b in FAMILY1])
    out = ["## 1. Where (0.5, 1) is unstable: off-policy depth, summed movement or step size", "",
           "P1 and P2 in points. A cell is **unstable** where its P1 deficit holds after Holm and its interval lies "
           f"below {points(UNSTABLE)} points, **stable** where its interval lies above {points(UNSTABLE)}, and "
           "otherwise not resolved.", "", HEAD + " cell's state | collapsed (arm / control) | difference in rate "
           "[95% CI, Newcombe] | Fisher p |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    states = {}
    for (cell, arm, control), p1, p2 in zip(FAMILY1, rows[::2], rows[1::2]):
        states[cell] = stability(p1)
        for r in (p1, p2):
            state = f"{cell}: {states[cell]}" if r is p1 else ""
            out.append(f"| `{r['arm']}` | `{r['against']}` | {r['endpoint']} | {contrast_cells(r)} | "
                       f"{'n/a' if r['holm'] is None else format(r['holm'], '.3g')} | "
                       f"{r['verdict']} | {state} | {incidence_cells(study, arm, control) if r is p1 else ' | |'} |")
    return out + ["", floor_line(rows), "", f"The protocol's reading: **{reading(states)}**.", ""]


def family2_section(study: dict) -> list[str]:
    rows = endpoint_rows(study, FAMILY2)
    out = ["## 2. Benefit where the control learns: against token-mean PPO-clip", "",
           f"P1 read with a margin of +-{points(MARGIN, False)} points: **better** or **worse** where the contrast "
           "holds after Holm, **equivalent within the margin** where neither holds and the 95% interval lies inside "
           "it, **not resolved** otherwise. P2 is judged (Holm over both endpoints) but carries no margin.", "",
           HEAD + " reading | collapsed (arm / control) | difference in rate [95% CI, Newcombe] | Fisher p |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p1 = r["endpoint"] == "P1"
        out.append(f"| `{r['arm']}` | `{r['against']}` | {r['endpoint']} | {contrast_cells(r)} | "
                   f"{'n/a' if r['holm'] is None else format(r['holm'], '.3g')} | {r['verdict']} | "
                   f"{benefit(r) if p1 else ''} | "
                   f"{incidence_cells(study, r['arm'], r['against']) if p1 else ' | |'} |")
    return out + ["", floor_line(rows), ""]


def family3_section(study: dict) -> list[str]:
    rows = entropy_rows(study)
    out = ["## 3. Entropy in cell A: beta2 apart from beta1 (the paper's §5)", "",
           "Paired difference of each run's mean token entropy (nats) over the window's steps that trained. The "
           "paper predicts a larger beta2 raises entropy and a larger beta1 lowers it.", "",
           "| contrast | isolates | window | pairs | paired difference [95% CI] | p (t) | p (sign flips) | MDE at 5% | "
           "p (Holm) | reading |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| `{r['arm']}` - `{r['against']}` | {r['what']} | {r['window']} | {contrast_cells(r, nats)} | "
                   f"{'n/a' if r['holm'] is None else format(r['holm'], '.3g')} | {r['reading']} |")
    calm = []
    for arm, against, what, _ in FAMILY3:
        e = summary([window_entropy(x, 1, STEPS) - window_entropy(y, 1, STEPS) for _, x, y in pairs(study, arm, against)
                     if onset(x) is None and onset(y) is None and window_entropy(x, 1, STEPS) is not None
                     and window_entropy(y, 1, STEPS) is not None])
        calm.append(f"- `{arm}` - `{against}` ({what}), steps 1-200, pairs where neither run collapsed: "
                    + (f"{nats(e['mean'])} [{nats(e['lo'])}, {nats(e['hi'])}] ({e['n']} pairs)" if "mean" in e
                       else f"{e['n']} pair(s)") + ".")
    confounded = paired(study, ARM["A"]["0.5_1"], CONTROL["A"], lambda r: window_entropy(r, 1, STEPS))
    return out + ["", floor_line(rows), "", "Shown, not judged:", ""] + calm + [
        f"- `{ARM['A']['0.5_1']}` - `{CONTROL['A']}`, steps 1-200 (beta1 and beta2 moved together, the fourth "
        "study's contrast): " + (f"{nats(confounded['mean'])} [{nats(confounded['lo'])}, {nats(confounded['hi'])}] "
                                 f"({confounded['n']} pairs)" if "mean" in confounded else "too few pairs") + ".", ""]


LABEL = {"control": "PPO-clip (0, 0)", "0_1": "CE-GPPO (0, 1)", "0.5_1": "CE-GPPO (0.5, 1)", "dapo": "DAPO",
         "ratio": "ratio-aware (0.5, 1)"}  # each arm's role, as README names it


def label(arm: str) -> str:
    return next(LABEL[role] for roles in ARM.values() for role, a in roles.items() if a == arm)


def summary_table(study: dict) -> str:
    """The study in one table, as README carries it: every registered contrast on its primary endpoint (P1 in
    families 1 and 2, entropy in family 3), judged within its family as on the verdicts page, with its reading and,
    for families 1 and 2, the collapses."""
    cell = {a: c for c, (_, _, arms) in DEPTH_CELLS.items() for a in arms}
    lines = ["| family | contrast | cell | endpoint | pairs | estimate [95% CI] | MDE | p (Holm) | reading | "
             "collapsed (arm / control) |", "|---" * 10 + "|"]
    family1 = [r for r in endpoint_rows(study, [(a, b) for _, a, b in FAMILY1]) if r["endpoint"] == "P1"]
    family2 = [r for r in endpoint_rows(study, FAMILY2) if r["endpoint"] == "P1"]
    for family, rows, read in ((1, family1, stability), (2, family2, benefit),
                               (3, entropy_rows(study), lambda r: r["reading"])):
        for r in rows:
            estimate = contrast_cells(r, points if family < 3 else nats).split(" | ")
            collapsed = incidence_cells(study, r["arm"], r["against"]).split(" | ")[0] if family < 3 else ""
            endpoint = f"entropy (nats), {r['window']}" if family == 3 else "P1, final avg@8 (points)"
            lines.append(f"| {family} | {label(r['arm'])} - {label(r['against'])} | {cell[r['arm']]} | {endpoint} | "
                         f"{estimate[0]} | {estimate[1]} | {estimate[4]} | "
                         f"{'n/a' if r['holm'] is None else format(r['holm'], '.3g')} | {read(r)} | {collapsed} |")
    states = {c: stability(r) for (c, _, _), r in zip(FAMILY1, family1)}
    return "\n".join(lines + ["", f"Family 1's reading, as the protocol fixed it: **{reading(states)}**."])


def summary_page(study: dict) -> str:
    return "\n".join(["# The fifth study in one table", "", *interim(study),
                      "Cells (optimizer steps per batch): " + "; ".join(cell_of(arms[0]) for _, _, arms in
                                                                              DEPTH_CELLS.values()) + ". Family 1: "
                      "is (0.5, 1) unstable in the cell; family 2: better, equivalent within +-5 points, worse or "
                      "not resolved against PPO-clip; family 3: beta2 and beta1 each varied alone. P2 and the "
                      "tests' details: [the verdicts](verdicts.md).", "", summary_table(study), ""])


def planned_runs() -> list[tuple[str, int]]:
    """(arm, seed) of every run the protocol registered: every cell at DEPTH_SEEDS["all"], cell A also at "A only"."""
    return [(arm, seed) for cell, (_, _, arms) in DEPTH_CELLS.items() for arm in arms
            for seed in DEPTH_SEEDS["all"] + (DEPTH_SEEDS["A only"] if cell == "A" else [])]


def interim(study: dict) -> list[str]:
    """The line that heads each page while registered runs are missing (none once all have finished): the protocol
    fixed its readings for the finished study, so an interim page is not read."""
    plan = planned_runs()
    done = sum(str(seed) in finished(study.get(arm, {})) for arm, seed in plan)
    if done == len(plan):
        return []
    return [f"**Interim: {done} of the {len(plan)} registered runs have finished. The protocol's readings are for the "
            "finished study; until then nothing on this page is a result, a reading or a trend to act on.**", ""]


def verdicts_page(study: dict) -> str:
    out = ["# The fifth study: verdicts", "", *interim(study),
           "By docs/study-protocol-depth.md, re-derived from the study's JSON by `python -m tools.study_depth`. P1: "
           "final avg@8; P2: the lowest 10-step mean training accuracy after step 10; paired over the seeds both "
           "arms finished in one block. Paired t-test per contrast (the exact sign-flip p beside it), Holm within "
           f"each family; **holds** (Holm-adjusted p <= {ALPHA}), **holds uncorrected only** (raw p <= {ALPHA}) or "
           "**not shown**, with the MDE (80% power at 5%, from the pairs' own SD). Collapse (the third study's "
           "definition): Fisher's exact test and Newcombe's interval of the difference in rate, secondary.", ""]
    return "\n".join(out + family1_section(study) + family2_section(study) + family3_section(study))


def cell_of(arm: str) -> str:
    return next(f"{cell} ({steps} steps, lr {lr:.0e})".replace("e-0", "e-")
                for cell, (steps, lr, arms) in DEPTH_CELLS.items() if arm in arms)


def arms_table(study: dict) -> str:
    lines = ["| cell | arm | runs | collapsed [exact 95% CI] | onsets | no-EOS collapse [exact 95% CI] | its onsets | "
             "truncated, steps 151-200 | P1 final avg@8 [95% CI, logit] | P2, mean | optimizer steps per step | "
             "entropy, steps 1-200 | machine minutes, median (range) | training minutes by step clocks, median "
             "(range) |",
             "|---" * 14 + "|"]
    for arm in DEPTH_ARMS:
        runs = [r for _, r in sorted(finished(study.get(arm, {})).items(), key=lambda kv: int(kv[0]))]
        if not runs:
            lines.append(f"| {cell_of(arm)} | `{arm}` | 0 |" + " |" * 11)
            continue
        onsets, eos = [onset(r) for r in runs], [no_eos_onset(r) for r in runs]
        k, j = sum(o is not None for o in onsets), sum(o is not None for o in eos)
        (lo, hi), (elo, ehi) = exact_rate_ci(k, len(runs)), exact_rate_ci(j, len(runs))
        finals = [final_acc(r) for r in runs if final_acc(r) is not None]
        p1 = "n/a" if not finals else f"{100 * finals[0]:.1f}"  # one run: its value alone
        if len(finals) > 1:
            mean, (low, high) = logit_mean_ci(finals)
            p1 = f"{100 * mean:.1f} [{100 * low:.1f}, {100 * high:.1f}]"
        late = [mean_over([s for s in step_rows(r) if s["step"] > STEPS - LAST], "truncated_frac") for r in runs]
        late = [x for x in late if x is not None]
        lows = [lowest_accuracy(r) for r in runs if lowest_accuracy(r) is not None]
        opt = [mean_over(step_rows(r), "optimizer_steps") for r in runs]
        opt = [x for x in opt if x is not None]
        ent = [window_entropy(r, 1, STEPS) for r in runs]
        ent = [x for x in ent if x is not None]
        minutes = [m for m in (machine_minutes(r) for r in runs) if m is not None]
        clocks = [m for m in (step_clock_minutes(r) for r in runs) if m is not None]
        lines.append(
            f"| {cell_of(arm)} | `{arm}` | {len(runs)} | {k} [{100 * lo:.0f}%, {100 * hi:.0f}%] | "
            f"{', '.join('-' if o is None else str(o) for o in onsets)} | {j} [{100 * elo:.0f}%, {100 * ehi:.0f}%] | "
            f"{', '.join('-' if o is None else str(o) for o in eos)} | "
            f"{f'{100 * sum(late) / len(late):.1f}%' if late else 'n/a'} | {p1} | "
            f"{points(sum(lows) / len(lows), False) if lows else 'n/a'} | "
            f"{f'{sum(opt) / len(opt):.2f}' if opt else 'n/a'} | {f'{sum(ent) / len(ent):.4f}' if ent else 'n/a'} | "
            f"{median_range(minutes)} | {median_range(clocks)} |")
    return "\n".join(lines)


def median_range(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})" if xs else "n/a"


def truncation_table(study: dict) -> str:
    """Each arm's mean truncated share per 10-step window (percent), the endpoint kept per run in the JSON."""
    heads = [f"{w + 1}-{w + 10}" for w in range(0, STEPS, 10)]
    lines = ["| arm | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for arm in DEPTH_ARMS:
        runs = list(finished(study.get(arm, {})).values())
        if not runs:
            continue
        windows = [truncation_windows(r) for r in runs]
        means = [mean_over([{"x": w[i] if i < len(w) else None} for w in windows], "x") for i in range(len(heads))]
        lines.append(f"| `{arm}` | " + " | ".join("n/a" if m is None else f"{100 * m:.0f}" for m in means) + " |")
    return "\n".join(lines)


def arms_page(study: dict) -> str:
    hashes = sorted({run.get("model_sha256") or "unknown" for runs in configurations(study).values()
                     for run in runs.values()})
    def each_run(describe) -> list[str]:  # "`arm` seed s: describe(run)" for every run it describes
        return [f"`{arm}` seed {seed}: {said}" for arm in DEPTH_ARMS
                for seed, run in sorted(study.get(arm, {}).items(), key=lambda kv: int(kv[0]))
                if (said := describe(run))]
    failed = each_run(lambda run: "; ".join(failures(run)))
    resumed = each_run(lambda run: "; ".join(interruptions(run)))
    unfinished = [f"`{arm}` seed {seed} ({run['steps_done']} steps)" for arm in DEPTH_ARMS
                  for seed, run in sorted(study.get(arm, {}).items(), key=lambda kv: int(kv[0]))
                  if run["steps_done"] < STEPS]
    return "\n".join([
        "# The fifth study: every arm", "", *interim(study),
        "Warm start(s) (one block each): " + ", ".join(f"`{h}`" for h in hashes) + f". Finished runs only ({STEPS} "
        "steps). Collapse: the third study's rule (a 10-step mean training accuracy below 5% from step 11 on, or "
        "final avg@8 below 10%). No-EOS collapse: a 10-step mean share of responses that hit the length cap above "
        "50%. Machine minutes: the time of the run's segments (one torch thread, two runs at once, evaluations "
        "included), which counts any time the machine was paused or shared. Training minutes by step clocks: "
        f"{STEPS} times the median of a run's step clocks (sampling, reward and update; no evaluation), which a "
        "pause or a busy spell moves little.", "", arms_table(study), "",
        "Failed segments (a nonzero exit code, reported even where a resume finished the run): "
        + ("; ".join(failed) if failed else "none") + ".", "",
        "Stopped from outside and resumed from the last checkpoint (a session's end; the steps after the checkpoint "
        "ran again, and their second rows are the ones kept): "
        + ("; ".join(resumed) if resumed else "none") + ".", "",
        "Not finished: " + ("; ".join(unfinished) if unfinished else "none") + ".", "",
        "## The truncation endpoint: share of responses that hit the length cap, per 10-step window (%)", "",
        truncation_table(study)])


PANELS = (("acc_mean", "training accuracy", "accuracy"), ("entropy", "mean token entropy (nats)", "entropy"),
          ("truncated_frac", "share of responses at the length cap", "truncation"),
          ("clip_frac_low_neg", "beta1 region's share of tokens", "the beta1 region"))


def figures(study: dict, folder: str):
    """PANELS against step, each arm's mean over its finished runs; the cells' controls dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cegppo_utils import runfolder
    fig, axes = plt.subplots(1, len(PANELS), figsize=(6 * len(PANELS), 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, arm in enumerate(DEPTH_ARMS):
        runs = list(finished(study.get(arm, {})).values())
        if not runs:
            continue
        by_step = [{r["step"]: r for r in step_rows(run)} for run in runs]
        for ax, (key, _, _) in zip(axes, PANELS):
            means = [(s, mean_over([rows.get(s, {}) for rows in by_step], key)) for s in range(1, STEPS + 1)]
            ax.plot([s for s, m in means if m is not None], [m for _, m in means if m is not None],
                    label=f"{arm} ({len(runs)})", lw=1, color=colors[i % len(colors)],
                    ls="--" if arm in CONTROL.values() else "-")
    for ax, (_, label, title) in zip(axes, PANELS):
        ax.set(xlabel="step", ylabel=label, title=title)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    runfolder.save_figure(fig, os.path.join(folder, "curves.png"), dpi=100)
    plt.close(fig)


OUTPUTS = ("arms.md", "verdicts.md", "summary.md", "curves.png")


def report(json_path: str = JSON, folder: str = FIGURES):
    """Every page and the figure from the study's JSON; a JSON the pages cannot read is a one-line UserError, found
    before anything is written."""
    study = load_study(json_path, "--json")
    problem = value_problem(study)
    if problem:
        raise UserError(f"--json {cli.short(json_path)}: not {study_json.WHAT} ({problem})")
    os.makedirs(folder, exist_ok=True)
    write(os.path.join(folder, "arms.md"), arms_page(study))
    write(os.path.join(folder, "verdicts.md"), verdicts_page(study))
    write(os.path.join(folder, "summary.md"), summary_page(study))
    figures(study, folder)
    return study


def main(argv=None):
    """The command line: bad input is one line and exit code 2, found before anything is written."""
    parser = cli.Parser("study_depth.py", description=__doc__)
    parser.add_argument("--json", default=JSON, help="the study's JSON (tools/study.py --json)")
    parser.add_argument("--figures", default=FIGURES, help="where the tables and figures go")
    args = parser.parse_args(argv)
    json_path, figures_dir = os.path.expanduser(args.json), os.path.expanduser(args.figures)
    problem = (cli.input_problem(json_path, "--json") or cli.folder_problem(figures_dir, "--figures")
               or cli.outputs_problem(figures_dir, OUTPUTS, "--figures"))
    if problem:
        parser.error(problem)
    cli.guard("study_depth.py", report, json_path, figures_dir, refused=(ImpossibleInput,))
    print(f"study_depth: tables and figures in {figures_dir}")


if __name__ == "__main__":
    main()
