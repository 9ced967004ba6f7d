"""The third study's readings, by docs/study-protocol-collapse.md, re-derived from its JSON alone (tools/study.py
writes it from the run folders):

    python -m tools.study_collapse      # docs/figures/study-collapse/{arms,verdicts,tokens}.md and its figures

Every run's collapse (the 10-step mean training accuracy below 5% at some step s >= 11, or final avg@8 below 10%) and
onset; per arm the incidence, onsets and final accuracy; each family's exact tests with Holm's correction and the
verdict its rule gives; the secondary entropy contrasts; and what the clip regions held, token by token, in the runs
that collapsed and in those that did not. Each part reads what exists so far and says what is missing.
"""

import math
import os

from cegppo_utils.data import UserError
from tools import cli
from tools.stats import (
    exact_trend,
    fisher_exact,
    holm,
    holm_adjusted,
    logit_mean_ci,
    mean_ci,
    min_detectable_incidence,
    rank_correlation_p,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JSON = os.path.join(ROOT, "docs", "figures", "study-collapse.json")
FIGURES = os.path.join(ROOT, "docs", "figures", "study-collapse")
STEPS = 200  # every run's length
WINDOW, FLOOR, AFTER, FINAL_FLOOR = 10, 0.05, 11, 0.10  # the endpoint: 10-step mean accuracy < 5% from step 11 on;
# or final avg@8 < 10%
DOSE = [("ce_gppo_0_1", 0.0), ("ce_gppo_0.1_1", 0.1), ("ce_gppo_0.25_1", 0.25), ("ce_gppo_0.5_1", 0.5),
        ("ce_gppo_1_1", 1.0)]
# The protocol's families: (name, [(arm, against), ...]); a family's tests are Holm-corrected together.
FAMILIES = [
    ("1. beta1 against the token-mean control", [("ce_gppo_0.5_1", "ppo_clip_tm"), ("ce_gppo_1_1", "ppo_clip_tm"),
                                                 ("ce_gppo_0_1", "ppo_clip_tm")]),
    ("3. aggregation", [("ppo_clip_tm", "grpo")]),
    ("4. the official recipe", [("ce_gppo_0.5_1_recipe", "ce_gppo_0.5_1"),
                                ("ce_gppo_0.5_1_recipe", "ppo_clip_tm_recipe")]),
    ("5. optimizer steps per batch", [("ce_gppo_0.5_1_u4", "ppo_clip_tm_u4"), ("ce_gppo_0.5_1_u2", "ppo_clip_tm_u2")]),
]
REGIONS = {"low_neg": "the beta1 region", "high_pos": "the beta2 region", "inside": "the tokens inside the interval"}
EVIDENCE = ("eos_share", "late_share", "old_logp_mean", "ratio_p10", "ratio_p50")
SHARES = {"low_neg": "clip_frac_low_neg", "high_pos": "clip_frac_high_pos"}


# --- one run -------------------------------------------------------------------------------------------------------

def step_rows(run) -> list[dict]:
    """The run's training steps in order (step 0 is an evaluation only)."""
    return sorted((r for r in run["steps"] if "acc_mean" in r), key=lambda r: r["step"])


def final_acc(run):
    evals = [r for r in run["steps"] if r.get("eval_acc") is not None and r["step"] == STEPS]
    return evals[-1]["eval_acc"] if evals else None


def onset(run) -> int | None:
    """The first step s >= 11 whose 10 steps s..s+9 average a training accuracy below 5%; STEPS when only the final
    avg@8 rule holds; None for a run that did not collapse."""
    acc = [r["acc_mean"] for r in step_rows(run)]
    for s in range(AFTER, len(acc) - WINDOW + 2):
        if sum(acc[s - 1:s - 1 + WINDOW]) / WINDOW < FLOOR:
            return s
    final = final_acc(run)
    return STEPS if final is not None and final < FINAL_FLOOR else None


def finished(runs: dict) -> dict:
    return {seed: run for seed, run in runs.items() if run.get("steps_done", 0) >= STEPS}


def mean_over(rows, key):
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


# --- per arm and the tests -----------------------------------------------------------------------------------------

def incidence(runs: dict) -> tuple[int, int]:
    runs = finished(runs)
    return sum(onset(r) is not None for r in runs.values()), len(runs)


def family_rows(study: dict, tests) -> list[dict]:
    """Each test of a family: the two incidences, raw and Holm-adjusted p, and the verdict by the protocol's rule."""
    rows = []
    for arm, against in tests:
        (a, n1), (b, n2) = incidence(study.get(arm, {})), incidence(study.get(against, {}))
        rows.append({"arm": arm, "against": against, "a": a, "n1": n1, "b": b, "n2": n2,
                     "p": fisher_exact(a, n1, b, n2) if n1 and n2 else None})
    ps = [r["p"] for r in rows if r["p"] is not None]
    adjusted, rejected = iter(holm_adjusted(ps)), iter(holm(ps))
    for r in rows:
        if r["p"] is None:
            r.update(holm=None, verdict="no runs yet")
            continue
        r["holm"], reject = next(adjusted), next(rejected)
        r["verdict"] = "holds" if reject else "holds uncorrected only" if r["p"] < 0.05 else "not shown"
    return rows


def dose(study: dict) -> dict:
    """The beta1 dose at beta2 = 1: incidence per beta1, the exact trend test, onset against beta1 (non-collapsed runs
    ranked after every onset, at STEPS + 1), and the smallest beta1 with a collapse."""
    arms, xs, ys = [], [], []
    for arm, beta1 in DOSE:
        runs = finished(study.get(arm, {}))
        if not runs:
            continue
        onsets = [onset(r) for r in runs.values()]
        arms.append((beta1, len(runs), sum(o is not None for o in onsets)))
        xs += [beta1] * len(onsets)
        ys += [STEPS + 1 if o is None else o for o in onsets]
    out = {"arms": arms}
    if len(arms) > 1 and any(k for _, _, k in arms):
        out["trend_p"] = exact_trend(arms)
        out["onset_rho"], out["onset_p"] = rank_correlation_p(xs, ys)
    out["smallest_collapsing_beta1"] = min((b for b, _, k in arms if k), default=None)
    return out


def entropy_before(run, until) -> float | None:
    """The run's mean entropy over its logged steps before step `until` (all its steps when None)."""
    rows = [r for r in step_rows(run) if until is None or r["step"] < until]
    return mean_over(rows, "entropy")


def entropy_contrast(study: dict, arm: str, against: str) -> dict | None:
    """The secondary endpoint: per seed both arms ran, each run's mean entropy before the pair's earlier onset (all
    steps when neither collapsed); the paired mean difference with its 95% t-interval."""
    a, b = finished(study.get(arm, {})), finished(study.get(against, {}))
    diffs = []
    for seed in sorted(set(a) & set(b)):
        onsets = [o for o in (onset(a[seed]), onset(b[seed])) if o is not None]
        until = min(onsets) if onsets else None
        x, y = entropy_before(a[seed], until), entropy_before(b[seed], until)
        if x is not None and y is not None:
            diffs.append(x - y)
    if not diffs:
        return None
    mean, (lo, hi) = mean_ci(diffs)
    return {"n": len(diffs), "mean": mean, "lo": lo, "hi": hi}


# --- what the regions held ----------------------------------------------------------------------------------------

def evidence(run, first=None, last=None) -> dict:
    """The run's mean of each region's per-token metrics (and its share of the trained tokens) over steps first..last
    (inclusive; None: open)."""
    rows = [r for r in step_rows(run) if (first is None or r["step"] >= first) and (last is None or r["step"] <= last)]
    out = {f"{region}_{what}": mean_over(rows, f"{region}_{what}") for region in REGIONS for what in EVIDENCE}
    out.update({f"{region}_share": mean_over(rows, key) for region, key in SHARES.items()})
    return out


def composition(study: dict, arms) -> list[dict]:
    """Per arm and collapse status: the mean over runs of evidence() over steps 1-10 and over the steps before onset."""
    rows = []
    for arm in arms:
        runs = finished(study.get(arm, {}))
        for status in ("collapsed", "did not collapse"):
            chosen = [r for r in runs.values() if (onset(r) is not None) == (status == "collapsed")]
            if not chosen:
                continue
            for window in ("steps 1-10", "before onset"):
                per_run = [evidence(r, 1, 10) if window == "steps 1-10" else
                           evidence(r, None, (onset(r) - 1) if onset(r) else None) for r in chosen]
                mean = {k: mean_over(per_run, k) for k in per_run[0]}
                rows.append({"arm": arm, "status": status, "runs": len(chosen), "window": window, **mean})
    return rows


# --- the pages -----------------------------------------------------------------------------------------------------

def pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"


def num(x, digits=3):
    return "n/a" if x is None else f"{x:.{digits}f}"


def arms_table(study: dict, arms) -> str:
    lines = ["| arm | runs | collapsed | onsets (step; - none) | final avg@8, mean [95% CI, logit scale] "
             "| steps that trained nothing, mean |", "|---|---|---|---|---|---|"]
    for arm in arms:
        runs = finished(study.get(arm, {}))
        if not runs:
            lines.append(f"| `{arm}` | 0 | | | | |")
            continue
        onsets = [onset(r) for _, r in sorted(runs.items())]
        finals = [final_acc(r) for r in runs.values() if final_acc(r) is not None]
        mean, (lo, hi) = logit_mean_ci(finals)  # on the logit scale: within 0-100%
        idle = [sum(1 for r in step_rows(run) if r.get("entropy") is None) for run in runs.values()]
        lines.append(f"| `{arm}` | {len(runs)} | {sum(o is not None for o in onsets)} | "
                     f"{', '.join('-' if o is None else str(o) for o in onsets)} | "
                     f"{100 * mean:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] | {sum(idle) / len(idle):.1f} |")
    return "\n".join(lines)


def verdicts_page(study: dict) -> str:
    out = ["# The third study: verdicts", "",
           "By docs/study-protocol-collapse.md, re-derived from the study's JSON by `python -m tools.study_collapse`. "
           "Fisher's exact test (two-sided) per contrast, Holm's correction within each family; a verdict is "
           "**holds** (Holm-adjusted p < 0.05), **holds uncorrected only** (raw p < 0.05) or **not shown**. With 5 "
           f"runs per arm and no collapse in the control, 80% power needs a true rate of at least "
           f"{pct(min_detectable_incidence(0.0, 5))} (uncorrected), "
           f"{pct(min_detectable_incidence(0.0, 5, alpha=0.05 / 3))}"
           " at Holm's first threshold in a family of 3.", ""]
    for name, tests in FAMILIES:
        out += [f"## {name}", "", "| arm | collapsed | against | collapsed | p (raw) | p (Holm) | verdict | "
                "entropy before the pair's collapse, paired difference [95% CI] |", "|---|---|---|---|---|---|---|---|"]
        for r in family_rows(study, tests):
            e = entropy_contrast(study, r["arm"], r["against"])
            ent = "n/a" if e is None else f"{e['mean']:+.4f} [{e['lo']:+.4f}, {e['hi']:+.4f}] ({e['n']} pairs)"
            p = "n/a" if r["p"] is None else f"{r['p']:.3g}"
            h = "n/a" if r["holm"] is None else f"{r['holm']:.3g}"
            out.append(f"| `{r['arm']}` | {r['a']} of {r['n1']} | `{r['against']}` | {r['b']} of {r['n2']} | {p} | "
                       f"{h} | {r['verdict']} | {ent} |")
        out.append("")
    d = dose(study)
    out += ["## 2. the dose (beta1 at beta2 = 1)", "",
            "| beta1 | runs | collapsed |", "|---|---|---|"] + [f"| {b} | {n} | {k} |" for b, n, k in d["arms"]] + [""]
    if "trend_p" in d:
        out += [f"Exact trend test of incidence in beta1: p = {d['trend_p']:.3g} "
                f"(one test: {'holds' if d['trend_p'] < 0.05 else 'not shown'}). "
                f"Onset against beta1 (runs that did not collapse ranked last), shown, not judged: Spearman's rho "
                f"{d['onset_rho']:+.2f}, permutation p {d['onset_p']:.3g}. The smallest beta1 with a collapse: "
                f"{d['smallest_collapsing_beta1']}.", ""]
    else:
        out += ["No collapse among the dose's finished runs yet, or fewer than two of its arms finished: no trend.", ""]
    steps_arms = [("ce_gppo_0.5_1_u2", 2), ("ce_gppo_0.5_1_u4", 4), ("ce_gppo_0.5_1", 8)]
    per_u = [(math.log2(u), *incidence(study.get(arm, {}))[::-1]) for arm, u in steps_arms]
    per_u = [(score, n, k) for score, n, k in per_u if n]
    if len(per_u) > 1 and any(k for _, _, k in per_u):
        out += [f"Shown, not judged: the trend of CE-GPPO (0.5, 1)'s incidence in log2 U over U = 2, 4, 8: p = "
                f"{exact_trend(per_u):.3g}.", ""]
    return "\n".join(out)


def tokens_page(study: dict, arms) -> str:
    out = ["# What the clip regions held", "",
           "Per arm and by whether the run collapsed: the mean over its runs of each step's per-token evidence "
           "(train.py, loss.region_evidence), over steps 1-10 and over the steps before the run's onset (all 200 for a "
           "run that did not collapse). Shares of the region's tokens: `eos` the end-of-sequence token, `late` in the "
           "last 10% of the response; `logp` the mean log pi_old; `d p10`, `d p50` percentiles of the ratio; `share` "
           "the region's share of all trained tokens. Shown, not judged.", ""]
    for region, label in REGIONS.items():
        out += [f"## {label[0].upper() + label[1:]} (`{region}`)", "",
                "| arm | runs | window | share | eos | late | logp | d p10 | d p50 |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in composition(study, arms):
            share = pct(r.get(f"{region}_share")) if region in SHARES else "-"
            out.append(f"| `{r['arm']}` {r['status']} | {r['runs']} | {r['window']} | {share} | "
                       f"{pct(r[f'{region}_eos_share'])} | {pct(r[f'{region}_late_share'])} | "
                       f"{num(r[f'{region}_old_logp_mean'], 2)} | {num(r[f'{region}_ratio_p10'])} | "
                       f"{num(r[f'{region}_ratio_p50'])} |")
        out.append("")
    return "\n".join(out)


def write(path: str, text: str):
    from cegppo_utils import runfolder
    runfolder.write_text_atomically(path, text if text.endswith("\n") else text + "\n")


def figures(study: dict, arms, folder: str):
    """Training accuracy and entropy against step, each arm's mean over its finished runs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for arm in arms:
        runs = list(finished(study.get(arm, {})).values())
        if not runs:
            continue
        for ax, key in zip(axes, ("acc_mean", "entropy")):
            steps = range(1, STEPS + 1)
            means = [mean_over([next((r for r in step_rows(run) if r["step"] == s), {}) for run in runs], key)
                     for s in steps]
            ax.plot([s for s, m in zip(steps, means) if m is not None], [m for m in means if m is not None],
                    label=f"{arm} ({len(runs)})", lw=1)
    axes[0].set(xlabel="step", ylabel="training accuracy (share of responses correct)", title="accuracy")
    axes[1].set(xlabel="step", ylabel="mean token entropy (nats)", title="entropy (steps that trained)")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    from cegppo_utils import runfolder
    runfolder.save_figure(fig, os.path.join(folder, "curves.png"), dpi=110)  # whole, never through a link
    plt.close(fig)


def report(json_path: str = JSON, folder: str = FIGURES, arms=None):
    from tools.configs import COLLAPSE_ARMS
    study = cli.read_json(json_path, "--json", what="a study's JSON")
    for name, runs in study.items():  # the records the tables read, before any page is written
        bad = not name.startswith("_") and (not isinstance(runs, dict) or any(
            not isinstance(r, dict) or not isinstance(r.get("steps"), list) for r in runs.values()))
        if bad:
            raise UserError(f"--json {cli.short(json_path)}: {cli.short(name)} is not "
                            "{seed: run record with its steps}")
    arms = arms or COLLAPSE_ARMS
    os.makedirs(folder, exist_ok=True)
    hashes = sorted({run.get("model_sha256") or "unknown" for name, runs in study.items() if not name.startswith("_")
                     for run in runs.values()})
    write(os.path.join(folder, "arms.md"), "# The third study: every arm\n\nWarm start(s): "
          + ", ".join(f"`{h}`" for h in hashes if h) + f". Finished runs only ({STEPS} steps).\n\n"
          + arms_table(study, arms))
    write(os.path.join(folder, "verdicts.md"), verdicts_page(study))
    write(os.path.join(folder, "tokens.md"), tokens_page(study, arms))
    figures(study, arms, folder)
    return study


def main(argv=None):
    """The command line: bad input is one line and exit code 2, found before anything is written."""
    parser = cli.Parser("study_collapse.py", description=__doc__)
    parser.add_argument("--json", default=JSON, help="the study's JSON (tools/study.py --json)")
    parser.add_argument("--figures", default=FIGURES, help="where the tables and figures go")
    args = parser.parse_args(argv)
    json_path, figures = os.path.expanduser(args.json), os.path.expanduser(args.figures)
    problem = cli.input_problem(json_path, "--json") or cli.folder_problem(figures, "--figures", create=True)
    if problem:
        parser.error(problem)
    cli.guard("study_collapse.py", report, json_path, figures)
    print(f"study_collapse: tables and figures in {figures}")


if __name__ == "__main__":
    main()
