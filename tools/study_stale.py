"""What one step of staleness does to CE-GPPO, at a glance: CE-GPPO (0.5, 1) and its token-mean PPO-clip control at
--preset merge-active, lr 1e-4 (the fifth study's cell A, where both learn), each synchronous and one step
off-policy (train.py --off-policy-steps 1, its uncorrected default: the behaviour gap measured, not weighted), paired
by seed. Shown, not judged: per arm its runs' final held-out avg@8, lowest 10-step training accuracy, collapses (the
third study's definition), the clip regions' shares, entropy and the measured behaviour gap; per objective the paired
differences stale minus synchronous, seed by seed. No test is run and no claim is made: see the page's last paragraph.

    # the stale arms (tools/configs.py STALE_ARMS), 3 seeds, two runs at once, each on one core
    python -m tools.study --preset merge-active --steps 200 --seeds 30,31,32 --parallel 2 \\
        --configs ppo_clip_tm_lr1e-4_stale1,ce_gppo_0.5_1_lr1e-4_stale1 \\
        --root runs/study-stale --json docs/figures/study-stale.json --no-plot
    # docs/figures/study-stale.md from the JSONs alone: the synchronous arms are the fifth study's cell A runs of the
    # same seeds (the same configs, warm start and code path: their steps 0-3 rerun at the stale arms' commit gave
    # every logged number again, bit for bit); without --synchronous they are read from --json, run beside the others
    python -m tools.study_stale --synchronous docs/figures/study-depth.json.gz

The stale arms sample ahead in the run's own process (--no-sampler-process): the numbers a sampler process gives
(tests/test_off_policy.py), on one core each, so the study's two runs at once fit a 2-core machine.
"""

import os

from cegppo_utils import cli
from tools import study_json
from tools.configs import STALE_ARMS, STALE_PAIRS
from tools.study_collapse import AFTER, FINAL_FLOOR, FLOOR, WINDOW

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JSON = os.path.join(ROOT, "docs", "figures", "study-stale.json")
PAGE = os.path.join(ROOT, "docs", "figures", "study-stale.md")
STEPS = 200


# --- one run -------------------------------------------------------------------------------------------------------

def training_steps(run) -> list[dict]:
    return sorted((r for r in run["steps"] if "acc_mean" in r), key=lambda r: r["step"])


def mean_of(run, key):
    values = [r[key] for r in training_steps(run) if isinstance(r.get(key), (int, float))]
    return sum(values) / len(values) if values else None


def final_acc(run, steps):
    evals = [r["eval_acc"] for r in run["steps"] if r.get("eval_acc") is not None and r["step"] == steps]
    return evals[-1] if evals else None


def lowest_accuracy(run):
    """The lowest mean training accuracy over 10 steps s..s+9, s >= 11 (None for a run shorter than that)."""
    acc = [r["acc_mean"] for r in training_steps(run)]
    means = [sum(acc[s - 1:s - 1 + WINDOW]) / WINDOW for s in range(AFTER, len(acc) - WINDOW + 2)]
    return min(means) if means else None


def collapsed(run, steps) -> bool:
    """The third study's endpoint: a 10-step mean training accuracy below 5% from step 11 on, or final avg@8 < 10%."""
    low, final = lowest_accuracy(run), final_acc(run, steps)
    return (low is not None and low < FLOOR) or (final is not None and final < FINAL_FLOOR)


def share(x) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}"  # the regions hold a percent or less of the tokens


# The per-run values the page shows: (key, column head, value(run, steps), shown as)
VALUES = [
    ("final", "final avg@8 (%)", final_acc, study_json.pct),
    ("lowest", "lowest 10-step acc (%)", lambda run, steps: lowest_accuracy(run), study_json.pct),
    ("low_neg", "beta1 region (% tokens)", lambda run, steps: mean_of(run, "clip_frac_low_neg"), share),
    ("high_pos", "beta2 region (% tokens)", lambda run, steps: mean_of(run, "clip_frac_high_pos"), share),
    ("entropy", "entropy (nats)", lambda run, steps: mean_of(run, "entropy"),
     lambda x: "n/a" if x is None else f"{x:.3f}"),
    ("gap", "behaviour gap (k3)", lambda run, steps: mean_of(run, "rollout_kl_k3"),
     lambda x: "n/a" if x is None else f"{x:.2e}"),
]


def finished(study: dict, arm: str, steps: int) -> dict:
    return study_json.finished_runs(study.get(arm, {}), steps)


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


# --- the page ------------------------------------------------------------------------------------------------------

def page(study: dict, steps: int = STEPS, synchronous_from: str | None = None) -> str:
    """The arms' table, the paired differences and what a protocol would need: markdown. synchronous_from: the file
    the synchronous arms were read from, where it is not the stale arms' own."""
    lines = ["# One step stale: CE-GPPO (0.5, 1) and token-mean PPO-clip at `merge-active`, lr 1e-4", "",
             study_json.para(f"Runs of {steps} steps (tools/study_stale.py; the commands are in its docstring). Each "
                             "cell is the mean over the arm's finished runs of a per-run value: the region shares "
                             "and entropy are means over the run's steps; the behaviour gap is the k3 estimate of "
                             "KL(q || pi_old) between the sampler's and the trainer's log-probs, which one update of "
                             "staleness adds to. Shown, not judged."
                             + (f" The synchronous arms are read from {synchronous_from}." if synchronous_from
                                else "")), "",
             "| arm | runs | collapsed | " + " | ".join(head for _, head, _, _ in VALUES) + " |",
             "|---|---|---|" + "---|" * len(VALUES)]
    for arm in STALE_ARMS:
        runs = finished(study, arm, steps)
        cells = [show(mean(value(run, steps) for run in runs.values())) for _, _, value, show in VALUES]
        lines.append(f"| `{arm}` | {len(runs)} | {sum(collapsed(r, steps) for r in runs.values())} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Paired by seed, stale minus synchronous (each seed's difference, then their mean):", "",
              "| objective | value | per seed | mean |", "|---|---|---|---|"]
    for objective, (stale, synchronous) in STALE_PAIRS.items():
        a, b = finished(study, stale, steps), finished(study, synchronous, steps)
        seeds = sorted(set(a) & set(b), key=int)
        for key, head, value, show in VALUES[:5]:
            diffs = {s: (value(a[s], steps), value(b[s], steps)) for s in seeds}
            diffs = {s: x - y for s, (x, y) in diffs.items() if x is not None and y is not None}
            shown = ", ".join(f"{s}: {signed(d, show)}" for s, d in diffs.items()) or "none yet"
            lines.append(f"| {objective} | {head} | {shown} | {signed(mean(diffs.values()), show)} |")
    lines += ["", study_json.para(
        "To judge what staleness costs CE-GPPO, a protocol fixed before the runs would name the endpoints (final "
        "avg@8, the lowest training accuracy, collapse), the margin within which one step of staleness counts as "
        "costing nothing (the fifth study's 5 points on final avg@8), the contrast (the stale-minus-synchronous "
        "difference of CE-GPPO against that of its control, an interaction, whose paired SD is about sqrt(2) times "
        "one arm's), enough seeds for that margin at that SD (the earlier studies' paired SDs give it), and whether "
        "the stale arms are corrected (--rollout-correction) or, as here, not.")]
    return "\n".join(lines)


def arms(json_path: str, sync_path: str | None) -> dict:
    """The stale arms from json_path; the synchronous ones from sync_path where given, else from json_path too."""
    study = study_json.load_study(json_path)
    if sync_path:
        synchronous = study_json.load_study(sync_path)
        for _, arm in STALE_PAIRS.values():
            study[arm] = synchronous.get(arm, {})
    return study


def signed(x, show) -> str:
    if x is None:
        return "n/a"
    text = show(abs(x))
    return text if text == "n/a" else ("-" if x < 0 else "+") + text


def main(argv=None):
    """The command line: bad input is one line and exit code 2, found before anything is written."""
    parser = cli.Parser("study_stale.py", description=__doc__)
    parser.add_argument("--json", default=JSON, help="the study's JSON (tools/study.py --json)")
    parser.add_argument("--synchronous", default=None, help="the study JSON the synchronous arms are read from "
                                                              "(default: --json)")
    parser.add_argument("--out", default=PAGE, help="the page to write")
    parser.add_argument("--steps", type=int, default=STEPS, help="the runs' length (a run that ended sooner is left "
                                                                 "out)")
    args = parser.parse_args(argv)
    json_path, out = os.path.expanduser(args.json), os.path.expanduser(args.out)
    sync_path = os.path.expanduser(args.synchronous) if args.synchronous else None
    problem = (cli.input_problem(json_path, "--json") or study_json.study_problem(json_path, "--json")
               or (sync_path and (cli.input_problem(sync_path, "--synchronous")
                                  or study_json.study_problem(sync_path, "--synchronous")))
               or cli.output_problem(out, "--out", create=True))
    if args.steps < 1:
        problem = problem or f"--steps {args.steps}: must be >= 1"
    if problem:
        parser.error(problem)
    text = cli.guard("study_stale.py", lambda: page(arms(json_path, sync_path), args.steps,
                                                        os.path.basename(sync_path) if sync_path else None))
    from cegppo_utils import runfolder
    runfolder.write_text_atomically(out, text + "\n")
    print(text)


if __name__ == "__main__":
    main()
