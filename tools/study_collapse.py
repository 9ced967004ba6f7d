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
import re

from cegppo_utils import cli
from cegppo_utils.data import UserError
from tools import study_json
from tools.stats import (
    ImpossibleInput,
    exact_rate_ci,
    exact_trend,
    fisher_exact,
    holm,
    holm_adjusted,
    logit_mean_ci,
    mean_ci,
    min_detectable_incidence,
    rank_correlation_p,
    rate_difference_ci,
)
from tools.study_json import configurations, load_study, mean_entropy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JSON = study_json.stored(os.path.join(ROOT, "docs", "figures", "study-collapse.json.gz"))
FIGURES = os.path.join(ROOT, "docs", "figures", "study-collapse")
STEPS = 200  # every run's length
WINDOW, FLOOR, AFTER, FINAL_FLOOR = 10, 0.05, 11, 0.10  # the endpoint: 10-step mean accuracy < 5% from step 11 on;
# or final avg@8 < 10%
NO_EOS = 0.5  # the truncation endpoint (added 2026-11-29): a "no-EOS collapse" is a 10-step mean truncated_frac (the
# share of responses that hit the length cap) above 50%, from any step on
ALPHA = 0.05  # a test "rejects at 5%" (the protocol) where its p, Holm-adjusted or raw, is at most this
DOSE = [("ce_gppo_0_1", 0.0), ("ce_gppo_0.1_1", 0.1), ("ce_gppo_0.25_1", 0.25), ("ce_gppo_0.5_1", 0.5),
        ("ce_gppo_1_1", 1.0)]
# The protocol's families of Fisher tests: (name, [(arm, against), ...]); a family's tests are Holm-corrected
# together. Its family 2, the dose, is one trend test (dose()).
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
# Every per-step number the pages and the figure read: each must be a number (or absent, or null) in a step's row.
NUMBERS = ("acc_mean", "eval_acc", "entropy", "response_length_mean", "truncated_frac", *SHARES.values(),
           *(f"{region}_{what}" for region in REGIONS for what in EVIDENCE))


# --- one run -------------------------------------------------------------------------------------------------------

def step_rows(run) -> list[dict]:
    """The run's training steps in order (step 0 is an evaluation only)."""
    return sorted((r for r in run["steps"] if "acc_mean" in r), key=lambda r: r["step"])


def final_acc(run):
    evals = [r for r in run["steps"] if r.get("eval_acc") is not None and r["step"] == STEPS]
    return evals[-1]["eval_acc"] if evals else None


def window_means(run) -> dict:
    """{s: the mean training accuracy over steps s..s+9}, for every s >= 11 whose window the run reached, in order."""
    acc = [r["acc_mean"] for r in step_rows(run)]
    return {s: sum(acc[s - 1:s - 1 + WINDOW]) / WINDOW for s in range(AFTER, len(acc) - WINDOW + 2)}


def onset(run) -> int | None:
    """The first step s >= 11 whose 10 steps s..s+9 average a training accuracy below 5%; STEPS when only the final
    avg@8 rule holds; None for a run that did not collapse."""
    for s, mean in window_means(run).items():
        if mean < FLOOR:
            return s
    final = final_acc(run)
    return STEPS if final is not None and final < FINAL_FLOOR else None


def truncation_windows(run) -> list[float | None]:
    """The run's share of responses that hit the length cap, per 10-step window (steps 1-10, 11-20, ...): the mean of
    each step's truncated_frac over the window's steps that logged it (None where none did)."""
    rows = step_rows(run)
    last = rows[-1]["step"] if rows else 0
    return [mean_over([r for r in rows if w < r["step"] <= w + WINDOW], "truncated_frac")
            for w in range(0, last, WINDOW)]


def no_eos_onset(run) -> int | None:
    """The first step s >= 1 whose 10 steps s..s+9 average a truncated share above NO_EOS (the policy has stopped
    ending its responses: a collapse of its own kind, which the accuracy rule may miss while avg@8 stays high); None
    for a run that never did, or that logged no truncated_frac."""
    share = [r.get("truncated_frac") for r in step_rows(run)]
    for s in range(1, len(share) - WINDOW + 2):
        window = share[s - 1:s - 1 + WINDOW]
        if None not in window and sum(window) / WINDOW > NO_EOS:
            return s
    return None


def finished(runs: dict) -> dict:
    """An arm's runs that ran all STEPS, by seed."""
    return study_json.finished_runs(runs, STEPS)


def mean_over(rows, key):
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


# --- per arm and the tests -----------------------------------------------------------------------------------------

def incidence(runs: dict) -> tuple[int, int]:
    runs = finished(runs)
    return sum(onset(r) is not None for r in runs.values()), len(runs)


def family_rows(study: dict, tests) -> list[dict]:
    """Each test of a family: the two incidences, raw and Holm-adjusted p, and the verdict by the protocol's rule.
    Holm counts every test of the family, one without runs yet as p = 1: leaving it out would shrink the family and
    loosen the others' thresholds while runs are missing."""
    rows = []
    for arm, against in tests:
        (a, n1), (b, n2) = incidence(study.get(arm, {})), incidence(study.get(against, {}))
        rows.append({"arm": arm, "against": against, "a": a, "n1": n1, "b": b, "n2": n2,
                     "p": fisher_exact(a, n1, b, n2) if n1 and n2 else None})
    ps = [1.0 if r["p"] is None else r["p"] for r in rows]
    for r, adjusted, reject in zip(rows, holm_adjusted(ps), holm(ps, ALPHA)):
        if r["p"] is None:
            r.update(holm=None, verdict="no runs yet")
            continue
        r["holm"] = adjusted
        r["verdict"] = "holds" if reject else "holds uncorrected only" if r["p"] <= ALPHA else "not shown"
    return rows


def dose(study: dict) -> dict:
    """The beta1 dose at beta2 = 1: incidence per beta1, the exact trend test, onset against beta1 (non-collapsed runs
    ranked after every onset, at STEPS + 1), and the smallest beta1 with a collapse."""
    arms, xs, ys, cx, cy = [], [], [], [], []
    for arm, beta1 in DOSE:
        runs = finished(study.get(arm, {}))
        if not runs:
            continue
        onsets = [onset(r) for r in runs.values()]
        arms.append((beta1, len(runs), sum(o is not None for o in onsets)))
        xs += [beta1] * len(onsets)
        ys += [STEPS + 1 if o is None else o for o in onsets]
        cx, cy = cx + [beta1 for o in onsets if o is not None], cy + [o for o in onsets if o is not None]
    out = {"arms": arms}
    if len(arms) > 1 and any(k for _, _, k in arms):
        out["trend_p"] = exact_trend(arms)
        out["onset_rho"], out["onset_p"] = rank_correlation_p(xs, ys, permutations=SHUFFLES)
        if len(set(cx)) > 1:
            out["collapsed_rho"], out["collapsed_p"] = rank_correlation_p(cx, cy, permutations=SHUFFLES)
    out["smallest_collapsing_beta1"] = min((b for b, _, k in arms if k), default=None)
    return out


def entropy_contrast(study: dict, arm: str, against: str) -> dict | None:
    """The secondary endpoint: per seed both arms ran, each run's mean entropy before the pair's earlier onset (all
    steps when neither collapsed); the paired mean difference with its 95% t-interval."""
    a, b = finished(study.get(arm, {})), finished(study.get(against, {}))
    diffs = []
    for seed in sorted(set(a) & set(b), key=int):
        onsets = [o for o in (onset(a[seed]), onset(b[seed])) if o is not None]
        until = min(onsets) if onsets else None
        x, y = mean_entropy(a[seed], until), mean_entropy(b[seed], until)
        if x is not None and y is not None:
            diffs.append(x - y)
    if not diffs:
        return None
    if len(diffs) == 1:  # one pair: its difference, no interval
        return {"n": 1, "mean": diffs[0], "lo": None, "hi": None}
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
    return study_json.pct(x, "%")


def num(x, digits=3):
    return "n/a" if x is None else f"{x:.{digits}f}"


def final_cell(finals) -> str:
    """Final avg@8 in points: mean [95% CI on the logit scale, within 0-100%], one run's value alone; n/a where no run
    evaluated step 200."""
    if not finals:
        return "n/a"
    if len(finals) == 1:  # one run: its value, no interval
        return f"{100 * finals[0]:.1f}"
    mean, (lo, hi) = logit_mean_ci(finals)
    return f"{100 * mean:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def arms_table(study: dict, arms) -> str:
    lines = ["| arm | runs | collapsed [exact 95% CI of the rate] | onsets (step; - none) | final avg@8, mean [95% CI, "
             "logit scale, added after the runs] | steps that trained nothing, mean | no-EOS collapse, onsets (added "
             "2026-11-29) |", "|---|---|---|---|---|---|---|"]
    for arm in arms:
        runs = finished(study.get(arm, {}))
        if not runs:
            lines.append(f"| `{arm}` | 0 | | | | | |")
            continue
        no_eos = [no_eos_onset(r) for _, r in sorted(runs.items(), key=lambda kv: int(kv[0]))]
        onsets = [onset(r) for _, r in sorted(runs.items(), key=lambda kv: int(kv[0]))]
        finals = [final_acc(r) for r in runs.values() if final_acc(r) is not None]
        idle = [sum(1 for r in step_rows(run) if r.get("entropy") is None) for run in runs.values()]
        collapsed = sum(o is not None for o in onsets)
        lo, hi = exact_rate_ci(collapsed, len(runs))
        lines.append(f"| `{arm}` | {len(runs)} | {collapsed} [{100 * lo:.0f}%, {100 * hi:.0f}%] | "
                     f"{', '.join('-' if o is None else str(o) for o in onsets)} | "
                     f"{final_cell(finals)} | {sum(idle) / len(idle):.1f} | {sum(o is not None for o in no_eos)}: "
                     f"{', '.join('-' if o is None else str(o) for o in no_eos)} |")
    return "\n".join(lines)


def paired_entropy(e: dict | None) -> str:
    """An entropy_contrast in a table's cell: its mean, its interval where there are two pairs or more, and the
    number of pairs."""
    if e is None:
        return "n/a"
    if e["n"] == 1:
        return f"{e['mean']:+.4f} (1 pair)"  # one pair has no interval
    return f"{e['mean']:+.4f} [{e['lo']:+.4f}, {e['hi']:+.4f}] ({e['n']} pairs)"


def family_section(study: dict, name: str, tests) -> list[str]:
    """One family's table: each test's incidences, raw and Holm-adjusted p, verdict and the entropy contrast."""
    out = [f"## {name}", "", "| arm | collapsed | against | collapsed | difference in rate [95% CI, Newcombe] | "
           "p (raw) | p (Holm) | verdict | entropy before the pair's collapse, paired difference [95% CI] |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in family_rows(study, tests):
        e = entropy_contrast(study, r["arm"], r["against"])
        ent = paired_entropy(e)
        p = "n/a" if r["p"] is None else f"{r['p']:.3g}"
        h = "n/a" if r["holm"] is None else f"{r['holm']:.3g}"
        diff = "n/a" if not (r["n1"] and r["n2"]) else "{:+.1%} [{:+.1%}, {:+.1%}]".format(
            *rate_difference_ci(r["a"], r["n1"], r["b"], r["n2"]))
        out.append(f"| `{r['arm']}` | {r['a']} of {r['n1']} | `{r['against']}` | {r['b']} of {r['n2']} | {diff} | "
                   f"{p} | {h} | {r['verdict']} | {ent} |")
    return out + [""]


def dose_section(study: dict) -> list[str]:
    """The protocol's family 2: incidence per beta1, the trend test and what is shown beside it."""
    d = dose(study)
    out = ["## 2. the dose (beta1 at beta2 = 1)", "",
           "| beta1 | runs | collapsed |", "|---|---|---|"] + [f"| {b} | {n} | {k} |" for b, n, k in d["arms"]] + [""]
    if "trend_p" not in d:
        return out + ["No collapse among the dose's finished runs yet, or fewer than two of its arms finished: no "
                      "trend.", ""]
    return out + [f"Exact trend test of incidence in beta1: p = {d['trend_p']:.3g} "
                  f"(one test: {'holds' if d['trend_p'] <= ALPHA else 'not shown'}). "
                  f"Onset against beta1 (runs that did not collapse ranked last), shown, not judged: Spearman's rho "
                  f"{d['onset_rho']:+.2f}, permutation p {permutation_p(d['onset_p'])}; among the collapsed runs only "
                  f"{collapsed_only(d)}. The smallest beta1 with a collapse: "
                  f"{d['smallest_collapsing_beta1']}.", ""]


SHUFFLES = 20000  # rank_correlation_p's permutations


def permutation_p(p: float) -> str:
    """A permutation p as text; at its floor 1 / (SHUFFLES + 1), where no shuffle was as extreme, "< 1e-4" (the floor
    is not the p)."""
    return "< 1e-4" if p <= 1 / (SHUFFLES + 1) else f"{p:.3g}"  # the floor, 1 / 20,001, is 5.0e-5


def collapsed_only(d: dict) -> str:
    """Onset against beta1 over the runs that collapsed alone: without the censored runs ranked last."""
    if "collapsed_rho" not in d:
        return "too few to rank"
    return f"rho {d['collapsed_rho']:+.2f}, p {permutation_p(d['collapsed_p'])}"


def updates_trend(study: dict) -> list[str]:
    """Shown beside family 5, not judged: the trend of CE-GPPO (0.5, 1)'s incidence in log2 U."""
    steps_arms = [("ce_gppo_0.5_1_u2", 2), ("ce_gppo_0.5_1_u4", 4), ("ce_gppo_0.5_1", 8)]
    per_u = [(math.log2(u), *incidence(study.get(arm, {}))[::-1]) for arm, u in steps_arms]
    per_u = [(score, n, k) for score, n, k in per_u if n]
    if len(per_u) < 2 or not any(k for _, _, k in per_u):
        return []
    return [f"Shown, not judged: the trend of CE-GPPO (0.5, 1)'s incidence in log2 U over U = 2, 4, 8: p = "
            f"{exact_trend(per_u):.3g}.", ""]


def verdicts_page(study: dict) -> str:
    """The families in the protocol's order: 1, the dose (2), 3, 4, 5 with its trend beside it."""
    out = ["# The third study: verdicts", "",
           "By docs/study-protocol-collapse.md, re-derived from the study's JSON by `python -m tools.study_collapse`. "
           "Fisher's exact test (two-sided) per contrast, Holm's correction within each family; a verdict is "
           f"**holds** (Holm-adjusted p <= {ALPHA}), **holds uncorrected only** (raw p <= {ALPHA}) or **not shown**. "
           f"With 5 runs per arm and no collapse in the control, 80% power needs a true rate of at least "
           f"{pct(min_detectable_incidence(0.0, 5))} (uncorrected), "
           f"{pct(min_detectable_incidence(0.0, 5, alpha=0.05 / 3))}"
           " at Holm's first threshold in a family of 3.", ""]
    first, *rest = FAMILIES
    out += family_section(study, *first) + dose_section(study)
    for name, tests in rest:
        out += family_section(study, name, tests)
    return "\n".join(out + updates_trend(study))


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


# The figure's panels: (the step's metric, the axis's label, the panel's title), each arm's mean over its runs.
PANELS = (("acc_mean", "training accuracy (share of responses correct)", "accuracy"),
          ("entropy", "mean token entropy (nats)", "entropy (steps that trained)"),
          ("response_length_mean", "mean response length (tokens)", "response length"))


def figures(study: dict, arms, folder: str):
    """PANELS against step, each arm's mean over its finished runs, side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cegppo_utils import runfolder
    fig, axes = plt.subplots(1, len(PANELS), figsize=(6.5 * len(PANELS), 4.5))
    colors = plt.get_cmap("tab20").colors  # 13 arms: tab10 would give two arms one colour
    for i, arm in enumerate(arms):
        runs = list(finished(study.get(arm, {})).values())
        if not runs:
            continue
        by_step = [{r["step"]: r for r in step_rows(run)} for run in runs]
        for ax, (key, _, _) in zip(axes, PANELS):
            steps = range(1, STEPS + 1)
            means = [mean_over([rows.get(s, {}) for rows in by_step], key) for s in steps]
            ax.plot([s for s, m in zip(steps, means) if m is not None], [m for m in means if m is not None],
                    label=f"{arm} ({len(runs)})", lw=1, color=colors[i % len(colors)],
                    ls="--" if arm.startswith(("grpo", "ppo_clip_tm")) else "-")  # the controls dashed
    for ax, (_, label, title) in zip(axes, PANELS):
        ax.set(xlabel="step", ylabel=label, title=title)
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    runfolder.save_figure(fig, os.path.join(folder, "curves.png"), dpi=110)  # whole, never through a link
    plt.close(fig)


OUTPUTS = ("arms.md", "verdicts.md", "tokens.md", "curves.png")  # what report writes into its folder


PROPORTIONS = ("acc_mean", "eval_acc", "truncated_frac", *SHARES.values())  # shares: each within [0, 1]


def value_problem(study: dict, numbers=()) -> str | None:
    """Where a study's JSON of the right shape (study_json.shape_problem) holds what the pages cannot read (None if
    nothing): a seed that is not a whole number, a model_sha256 that is not text, a step's NUMBERS (and `numbers`,
    a reader's own) not finite numbers, a share outside [0, 1], more than 20 seeds in a configuration (an exact
    sign-flip test lists 2^n flips)."""
    for name, runs in configurations(study).items():
        if len(runs) > 20:
            return f"configuration {cli.short(name, 60)} has {len(runs)} seeds; the readers take at most 20"
        for seed, run in runs.items():
            where = f"configuration {cli.short(name, 60)} seed {cli.short(seed, 20)}"
            if not re.fullmatch(r"-?[0-9]+", seed):
                return f"{where}: the seed is not a whole number"
            if not isinstance(run.get("model_sha256"), (str, type(None))):
                return f"{where}: its model_sha256 is not text"
            for row in run["steps"]:
                for key in (*NUMBERS, *numbers):
                    value = row.get(key)
                    if value is None:
                        continue
                    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                        return f"{where} step {row['step']}: its {key} is not a number ({cli.short(repr(value), 30)})"
                    if key in PROPORTIONS and not 0 <= value <= 1:
                        return f"{where} step {row['step']}: its {key} is {value}, not a share in [0, 1]"
                if "acc_mean" in row and row["acc_mean"] is None:  # a training row's accuracy: the collapse windows
                    return f"{where} step {row['step']}: its acc_mean is null (a training step logs its accuracy)"
    return None


def report(json_path: str = JSON, folder: str = FIGURES):
    """Every page and the figure, from the study's JSON; a JSON the pages cannot read is a one-line UserError, found
    before anything is written."""
    from tools.configs import COLLAPSE_ARMS
    study = load_study(json_path, "--json")  # its shape checked, each run's steps one row per step
    problem = value_problem(study)
    if problem:
        raise UserError(f"--json {cli.short(json_path)}: not {study_json.WHAT} ({problem})")
    os.makedirs(folder, exist_ok=True)
    hashes = sorted({run.get("model_sha256") or "unknown" for runs in configurations(study).values()
                     for run in runs.values()})
    write(os.path.join(folder, "arms.md"), "# The third study: every arm\n\nWarm start(s): "
          + ", ".join(f"`{h}`" for h in hashes) + f". Finished runs only ({STEPS} steps). No-EOS collapse: a 10-step "
          "mean share of responses that hit the length cap above 50% (the fifth study's truncation endpoint).\n\n"
          + arms_table(study, COLLAPSE_ARMS))
    write(os.path.join(folder, "verdicts.md"), verdicts_page(study))
    write(os.path.join(folder, "tokens.md"), tokens_page(study, COLLAPSE_ARMS))
    figures(study, COLLAPSE_ARMS, folder)
    return study


def main(argv=None):
    """The command line: bad input is one line and exit code 2, found before anything is written (the folder for
    the pages is made by report, once the JSON has been read)."""
    parser = cli.Parser("study_collapse.py", description=__doc__)
    parser.add_argument("--json", default=JSON, help="the study's JSON (tools/study.py --json)")
    parser.add_argument("--figures", default=FIGURES, help="where the tables and figures go")
    args = parser.parse_args(argv)
    json_path, figures = os.path.expanduser(args.json), os.path.expanduser(args.figures)
    problem = (cli.input_problem(json_path, "--json") or cli.folder_problem(figures, "--figures")
               or cli.outputs_problem(figures, OUTPUTS, "--figures"))
    if problem:
        parser.error(problem)
    cli.guard("study_collapse.py", report, json_path, figures, refused=(ImpossibleInput,))
    print(f"study_collapse: tables and figures in {figures}")


if __name__ == "__main__":
    main()
