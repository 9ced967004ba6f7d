"""The long-run study: each configuration trained with a preset for several seeds; then every run's per-step numbers
in one JSON, a Table-1 analog with 95% intervals (paired against GRPO, seed by seed), and the paper's figures.

    python tools/study.py --preset tiny --steps 50                 # the original CPU study on the arithmetic task
    python tools/study.py --preset sums --steps 150                # the study on the longer-response task (README)
    python tools/study.py --preset tiny --plot-only                # collect, tabulate and draw what has run so far
    python tools/study.py --preset sums --steps 150 --parallel 18  # a machine with many cores (or a GPU): runs at once

Any flag that is not study.py's own is a train.py flag, passed to every run (and part of the run's identity: a
resumed run must be given the same ones).

Runs go to runs/study/<preset>/<config>-s<seed>/ and keep checkpoints, so an interrupted study resumes: a finished
run is skipped, an unfinished one continues from its last checkpoint (train.py --resume), exactly; each run's
hardware.jsonl says which machine ran which steps. A study may run in parts and on several machines: the JSON
(docs/figures/study-<preset>.json, {config: {seed: {start_acc, final_acc, best_acc, ..., steps: [...]}}}) is updated
with the runs found, never emptied, so results accumulate. Table, figures and the verdict on each of the paper's
claims, read by the rules of docs/study-protocol.md (verdicts.md), go to docs/figures/study-<preset>/.
"""

import argparse
import concurrent.futures
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the pipeline's modules

from configs import CONFIGS, STUDY_DEFAULT  # noqa: E402
from stats import mean_ci  # noqa: E402

# The per-step numbers the study keeps of each run (the rest stay in its metrics.jsonl).
KEPT = ("step", "entropy", "reward_mean", "acc_mean", "eval_acc", "clip_frac_low_neg", "clip_frac_high_pos",
        "clip_frac_low_pos", "clip_frac_high_neg", "approx_kl", "response_length_mean", "od_state", "entropy_coef")


def run_one(preset, name, seed, steps, out, extra, threads=None):
    """Train one configuration and seed to `steps`, resuming it if a checkpoint exists; returns seconds taken."""
    import runfolder as RF
    done = RF.read_jsonl(os.path.join(out, "metrics.jsonl"))
    if os.path.exists(os.path.join(out, "final", "config.json")) and done and done[-1]["step"] >= steps:
        print(f"[study] {name} seed {seed}: done already", flush=True)
        return 0.0
    flags = ["--preset", preset, *CONFIGS[name], "--seed", str(seed), "--max-steps", str(steps),
             "--save-every", str(max(1, min(25, steps))), "--output-dir", out, *extra]
    if os.path.exists(os.path.join(out, "config.json")):
        flags.append("--resume")  # from its last checkpoint, or from step 0 if it died before the first
    start, first = time.time(), (done[-1]["step"] if done else 0)
    print(f"[study] {name} seed {seed} ...", flush=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *flags], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rows = RF.read_jsonl(os.path.join(out, "metrics.jsonl"))
    if os.path.isdir(out):  # which machine ran which steps
        from bench import cpu_model
        with open(os.path.join(out, "hardware.jsonl"), "a") as f:
            f.write(json.dumps({"cpu": cpu_model(), "threads": threads or os.cpu_count(), "from_step": first,
                                "to_step": rows[-1]["step"] if rows else 0, "seconds": round(time.time() - start, 1),
                                "exit_code": run.returncode}) + "\n")
    if run.returncode:
        raise RuntimeError(f"[study] {name} seed {seed} failed:\n{run.stderr[-3000:]}")
    print(f"[study] {name} seed {seed}: {time.time() - start:.0f}s", flush=True)
    return time.time() - start


# --- what the runs say ----------------------------------------------------------------------------

def run_record(out: str) -> dict | None:
    """One run's summary and per-step numbers, from its run folder (None if it logged nothing)."""
    import runfolder as RF
    from plot import window_mean
    rows = RF.read_jsonl(os.path.join(out, "metrics.jsonl"))
    steps = [r for r in rows if "reward_mean" in r]
    if not steps:
        return None
    evals = [(r["step"], r["eval_acc"]) for r in rows if "eval_acc" in r]
    trained = [(s, a) for s, a in evals if s > 0]
    best = max(trained, key=lambda e: e[1]) if trained else (None, None)

    hardware = RF.read_jsonl(os.path.join(out, "hardware.jsonl"))
    return {"steps_done": steps[-1]["step"], "start_acc": next((a for s, a in evals if s == 0), None),
            "final_acc": trained[-1][1] if trained else None, "final_step": trained[-1][0] if trained else None,
            "best_acc": best[1], "best_step": best[0],
            "entropy_first10": window_mean(rows, "entropy", True), "entropy_last10": window_mean(rows, "entropy", False),
            "reward_first10": window_mean(rows, "reward_mean", True), "reward_last10": window_mean(rows, "reward_mean", False),
            "hardware": hardware, "steps": [{k: r[k] for k in KEPT if k in r} for r in rows]}


def collect(path: str, root: str, names, seeds) -> dict:
    """The study's JSON at `path`, updated with every run found under root (runs not found are left as they were)."""
    study = json.load(open(path)) if os.path.exists(path) else {}
    for name in names:
        for seed in seeds:
            record = run_record(os.path.join(root, f"{name}-s{seed}"))
            if record:
                study.setdefault(name, {})[str(seed)] = record
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(study, f)
    os.replace(path + ".tmp", path)
    return study


def table1(study: dict, baseline: str = "grpo") -> str:
    """The Table-1 analog: held-out avg@k at the end and at the best step (mean [95% CI] over seeds), and the paired
    difference against the baseline on the seeds both have."""
    def cell(values, scale=100.0):
        values = [v for v in values if v is not None]
        if not values:
            return "n/a"
        mean, (lo, hi) = mean_ci(values)
        return f"{scale * mean:.1f} [{scale * lo:.1f}, {scale * hi:.1f}]" if len(values) > 1 else f"{scale * mean:.1f}"

    lines = [f"| config | seeds | steps | start | final avg@k | best avg@k | final - {baseline} (paired) | "
             "entropy, first 10 -> last 10 steps |", "|---|---|---|---|---|---|---|---|"]
    base = study.get(baseline, {})
    for name, runs in study.items():
        seeds = sorted(runs, key=int)
        pairs = [runs[s]["final_acc"] - base[s]["final_acc"] for s in seeds
                 if s in base and runs[s]["final_acc"] is not None and base[s]["final_acc"] is not None]
        first = [runs[s]["entropy_first10"] for s in seeds]
        last = [runs[s]["entropy_last10"] for s in seeds]
        entropy = f"{sum(first) / len(first):.3f} -> {sum(last) / len(last):.3f}" if None not in first + last else "n/a"
        lines.append(f"| {name} | {len(seeds)} | {min(runs[s]['steps_done'] for s in seeds)} | "
                     f"{cell([runs[s]['start_acc'] for s in seeds])} | {cell([runs[s]['final_acc'] for s in seeds])} | "
                     f"{cell([runs[s]['best_acc'] for s in seeds])} | "
                     f"{cell(pairs) if name != baseline else '-'} | {entropy} |")
    return "\n".join(lines)


# --- the verdicts, by the rules of docs/study-protocol.md ---------------------------------------------------------

def paired(study: dict, a: str, b: str, value) -> tuple | None:
    """a - b of a per-run number (value: run -> number or None), on the seeds both ran: (n, mean, [lo, hi]) with
    the 95% t-interval over seeds; None with fewer than 2 such seeds."""
    seeds = [s for s in study.get(a, {}) if s in study.get(b, {})
             and value(study[a][s]) is not None and value(study[b][s]) is not None]
    if len(seeds) < 2:
        return None
    return (len(seeds), *mean_ci([value(study[a][s]) - value(study[b][s]) for s in seeds]))


def over_seeds(study: dict, name: str, key) -> tuple | None:
    """(n, mean, [lo, hi]) of a per-run number over the seeds of one configuration; None with fewer than 2."""
    values = [key(run) for run in study.get(name, {}).values() if key(run) is not None]
    return (len(values), *mean_ci(values)) if len(values) >= 2 else None


def entropy_change(run):
    """Last-10 minus first-10 steps' mean token entropy of one run."""
    if run.get("entropy_first10") is None or run.get("entropy_last10") is None:
        return None
    return run["entropy_last10"] - run["entropy_first10"]


def window_entropy(run, lo: float, hi: float):
    """Mean entropy over the steps in (lo T, hi T] of a run of T steps (T = 200: 0-0.1 is steps 1-20)."""
    T = run["steps_done"]
    values = [r["entropy"] for r in run["steps"] if lo * T < r.get("step", 0) <= hi * T and r.get("entropy") is not None]
    return sum(values) / len(values) if values else None


def judge(result, want: str) -> str:
    """The protocol's reading of an interval: `want` "above" or "below" 0 holds when the interval lies wholly there,
    is reversed when it lies wholly on the other side, and is otherwise not resolved; "not below" (accuracy kept)
    holds unless the interval lies wholly below 0."""
    if result is None:
        return "fewer than 2 seeds"
    _, _, (lo, hi) = result
    if want == "not below":
        return "does not hold" if hi < 0 else "holds"
    good, bad = (lo > 0, hi < 0) if want == "above" else (hi < 0, lo > 0)
    return "holds" if good else "reversed" if bad else "not resolved"


def best_dynamic(study: dict, seeds=("0", "1", "2")) -> str | None:
    """The dynamic-clip schedule with the highest mean final avg@k over seeds 0-2 (a tie goes to ID)."""
    means = {}
    for name in ("grpo_dyn_id", "grpo_dyn_did", "grpo_dyn_od"):
        finals = [study[name][s]["final_acc"] for s in seeds if s in study.get(name, {}) and study[name][s].get("final_acc") is not None]
        if len(finals) == len(seeds):
            means[name] = sum(finals) / len(finals)
    return max(means, key=lambda n: (means[n], n == "grpo_dyn_id")) if means else None


# (claim, comparison, configuration a, b or None, the per-run number, what the paper predicts). a - b paired by seed;
# with b None, the number over a's seeds.
def final(run):
    return run.get("final_acc")


def last10(run):
    return run.get("entropy_last10")


RULES = [
    ("1: a larger beta1 lowers entropy", "(0.5, 1) - (0, 1)", "ce_gppo_0.5_1", "ce_gppo_0_1", last10, "below"),
    ("1: a larger beta1 lowers entropy", "(1, 0.5) - (0.5, 1)", "ce_gppo_1_0.5", "ce_gppo_0.5_1", last10, "below"),
    ("1: a larger beta2 keeps entropy higher", "(1, 1) - (1, 0.5)", "gppo", "ce_gppo_1_0.5", last10, "above"),
    ("2: (1, 0.5) collapses entropy", "(1, 0.5) - PPO-clip", "ce_gppo_1_0.5", "ppo_clip", last10, "below"),
    ("2: (1, 0.5) lowers accuracy", "(1, 0.5) - (0.5, 1), final avg@k", "ce_gppo_1_0.5", "ce_gppo_0.5_1", final, "below"),
    ("2: (0.5, 1) keeps entropy stable", "(0.5, 1): last-10 - first-10 entropy", "ce_gppo_0.5_1", None, entropy_change, "not below"),
    *[("3: CE-GPPO (0.5, 1) ends above " + b, f"(0.5, 1) - {b}, final avg@k", "ce_gppo_0.5_1", b, final, "above")
      for b in ("grpo", "dapo", "cispo", "gspo", "entropy_0.001", "entropy_0.003")],
    ("4: an entropy bonus of 0.001 does not stop the fall", "entropy_0.001: last-10 - first-10 entropy", "entropy_0.001", None,
     entropy_change, "below"),
    *[(f"5: {n} keeps entropy higher than GRPO", f"{n} - grpo, last-10 entropy", n, "grpo", last10, "above")
      for n in ("grpo_dyn_id", "grpo_dyn_did", "grpo_dyn_od")],
    *[(f"5: {n} without losing accuracy", f"{n} - grpo, final avg@k", n, "grpo", final, "not below")
      for n in ("grpo_dyn_id", "grpo_dyn_did", "grpo_dyn_od")],
]
# Also reported, not in the protocol (so not a verdict on a claim): beta1 at a fixed beta2 = 1.
EXPLORATORY = [
    ("beta1 0.5 -> 0.75 at beta2 1", "(0.75, 1) - (0.5, 1)", "ce_gppo_0.75_1", "ce_gppo_0.5_1", last10, "below"),
    ("beta1 0.5 -> 1 at beta2 1", "(1, 1) - (0.5, 1)", "gppo", "ce_gppo_0.5_1", last10, "below"),
]
# The designed trajectories (claim 5): window means of entropy, on fractions of the run (T = 200: steps 1-20,
# 81-100, 101-120, 181-200), each an inequality between two windows.
W = {"1-20": (0.0, 0.1), "81-100": (0.4, 0.5), "101-120": (0.5, 0.6), "181-200": (0.9, 1.0)}
TRAJECTORIES = {"grpo_dyn_id": [("81-100", ">", "1-20"), ("181-200", "<", "81-100")],
                "grpo_dyn_did": [("81-100", "<", "1-20"), ("101-120", ">", "81-100"), ("181-200", "<", "101-120")]}


def follows(windows: dict, checks) -> bool:
    """Whether window means ({window: entropy or None}) satisfy every (x, ">" or "<", y) of a designed trajectory."""
    return all(windows[x] is not None and windows[y] is not None and (windows[x] > windows[y] if op == ">" else windows[x] < windows[y])
               for x, op, y in checks)


def od_switches(run) -> int:
    states = [r["od_state"] for r in run["steps"] if r.get("od_state") is not None]
    return sum(a != b for a, b in zip(states, states[1:]))


def verdicts(study: dict, mechanism: dict | None = None) -> str:
    """Every claim's comparison as the protocol reads it, as a markdown page; with the one-step experiment's JSON,
    also whether its signs predict the runs' (step_vs_run)."""
    def cell(result, scale):
        if result is None:
            return "n/a", "-"
        n, mean, (lo, hi) = result
        return f"{scale * mean:+.{1 if scale == 100 else 4}f} [{scale * lo:+.{1 if scale == 100 else 4}f}, {scale * hi:+.{1 if scale == 100 else 4}f}]", str(n)

    def rows(rules):
        out = []
        for claim, what, a, b, key, want in rules:
            result = paired(study, a, b, key) if b else over_seeds(study, a, key)
            text, n = cell(result, 100 if key is final else 1)
            out.append(f"| {claim} | {what} | {n} | {text} | {want} 0 | **{judge(result, want)}** |")
        return out

    head = ["| claim | comparison (accuracy in points, entropy in nats/token) | seeds | mean [95% CI] | predicted | verdict |",
            "|---|---|---|---|---|---|"]
    lines = ["Paired by seed; 95% t-intervals over seeds; no correction for multiple comparisons.", "", *head, *rows(RULES)]
    runs = study.get("entropy_0.003", {}).values()
    first = [r["entropy_first10"] for r in runs if r.get("entropy_first10") is not None]
    last = [r["entropy_last10"] for r in runs if r.get("entropy_last10") is not None]
    if first and last:
        ratio = (sum(last) / len(last)) / (sum(first) / len(first))
        lines.append(f"| 4: an entropy bonus of 0.003 explodes | entropy_0.003: mean last-10 / first-10 entropy | {len(last)} | "
                     f"{ratio:.2f} | > 1.5 | **{'holds' if ratio > 1.5 else 'does not hold'}** |")
    for name, checks in TRAJECTORIES.items():
        runs = list(study.get(name, {}).values())
        if not runs:
            continue
        each = [{w: window_entropy(r, *W[w]) for w in W} for r in runs]
        mean = {w: None if any(e[w] is None for e in each) else sum(e[w] for e in each) / len(each) for w in W}
        per_run = sum(follows(e, checks) for e in each)
        shape = ", ".join(f"{w} {mean[w]:.4f}" for w in W if mean[w] is not None)
        lines.append(f"| 5: {name} follows its designed trajectory | seed-mean entropy of steps {shape} | {len(runs)} | "
                     f"{per_run} of {len(runs)} runs alone | {'; '.join(f'{x} {op} {y}' for x, op, y in checks)} | "
                     f"**{'holds' if follows(mean, checks) else 'does not hold'}** |")
    od = list(study.get("grpo_dyn_od", {}).values())
    if od:
        switches = [od_switches(r) for r in od]
        lines.append(f"| 5: grpo_dyn_od oscillates | switches of od_state per run: {switches} | {len(od)} | "
                     f"{sum(s >= 2 for s in switches)} of {len(od)} runs | >= 2 switches | "
                     f"**{'holds' if all(s >= 2 for s in switches) else 'does not hold'}** |")
    best = best_dynamic(study)
    lines += ["", f"The best dynamic-clip schedule (highest mean final avg@k over seeds 0-2): {best or 'not yet known'}.",
              "", "Also reported, not part of the protocol's claims:", "", *head, *rows(EXPLORATORY)]
    table = step_vs_run(study, mechanism or {})
    if table:
        lines += ["", "Does the one-step mechanism predict the run? (tools/mechanism.py from the same warm start; 95% "
                  "t-intervals, over batches for one step and over seeds for the run)", "", table]
    return "\n".join(lines)


def step_vs_run(study: dict, mechanism: dict, reference: str = "ppo_clip") -> str:
    """The protocol's question for the one-step experiment: does the sign of a configuration's one-step entropy effect
    (mechanism.py, paired by batch, against PPO-clip) match the sign of its entropy over the run (last-10 entropy,
    paired by seed, against PPO-clip)? Configurations in both, as a markdown table."""
    def cell(mean, lo, hi):
        return f"{mean:+.5f} [{lo:+.5f}, {hi:+.5f}]"

    lines = ["| config | one step: dH - PPO-clip (batches) | over the run: last-10 entropy - PPO-clip (seeds) | "
             "signs of the means | both intervals exclude 0 |", "|---|---|---|---|---|"]
    for name in study:
        step = mechanism.get(name, {})
        run = paired(study, name, reference, last10)
        if name == reference or "dH_vs_ppo_ci95" not in step or run is None:
            continue
        mean, (lo, hi) = step["dH_vs_ppo_mean"], step["dH_vs_ppo_ci95"]
        n, run_mean, (run_lo, run_hi) = run
        agree = "agree" if (mean > 0) == (run_mean > 0) else "differ"
        resolved = (lo > 0 or hi < 0) and (run_lo > 0 or run_hi < 0)
        lines.append(f"| {name} | {cell(mean, lo, hi)} ({step['n']}) | {cell(run_mean, run_lo, run_hi)} ({n}) | {agree} | "
                     f"{'yes' if resolved else 'no'} |")
    return "\n".join(lines) if len(lines) > 2 else ""


# The paper's figures on this task: (file, title, configurations, metrics). Configurations not run are left out.
FIGURES = [
    ("entropy-betas.png", "entropy under CE-GPPO's (beta1, beta2) (paper Fig. 3-4)",
     ["ppo_clip", "ce_gppo_0_1", "ce_gppo_0.5_1", "ce_gppo_0.75_1", "ce_gppo_1_0.5", "gppo"], ["entropy"]),
    ("payoff.png", "CE-GPPO against GRPO, DAPO and an entropy bonus (paper Fig. 5)",
     ["ce_gppo_0.5_1", "grpo", "dapo", "entropy_0.001", "entropy_0.003"], ["entropy", "eval_acc"]),
    ("baselines.png", "every baseline of Table 1",
     ["grpo", "dapo", "cispo", "gspo", "ce_gppo_0.5_1", "ce_gppo_0.75_1"], ["entropy", "eval_acc"]),
    ("clip-regions.png", "the clipped regions CE-GPPO keeps a gradient on (fraction of tokens)",
     ["ppo_clip", "ce_gppo_0_1", "ce_gppo_0.5_1", "ce_gppo_1_0.5", "gppo"], ["clip_frac_low_neg", "clip_frac_high_pos"]),
    ("kl.png", "KL(pi_old || pi) per step (k3)", None, ["approx_kl"]),
]


def draw_figures(study: dict, out_dir: str, window: int = 5) -> list[str]:
    """FIGURES, plus dynamic clipping against the same algorithm with fixed clipping; each a mean over seeds
    (shaded: min-max), smoothed over `window` steps (held-out accuracy unsmoothed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import plot
    dynamic = [n for n in study if "_dyn_" in n]
    figures = FIGURES + ([("dynamic-clip.png", "dynamic clipping (arXiv 2602.09782) against fixed clipping; dashed: T/2, "
                          "where ID and DID change phase", dynamic + sorted({n.split("_dyn_")[0] for n in dynamic}),
                          ["entropy", "eval_acc"])] if dynamic else [])
    written = []
    for file, title, names, keys in figures:
        names = [n for n in (names or list(study)) if n in study]
        if not names:
            continue
        fig, axes = plt.subplots(1, len(keys), figsize=(6.5 * len(keys), 4), squeeze=False)
        for ax, key in zip(axes[0], keys):
            for c, name in enumerate(names):
                curves = []
                for run in study[name].values():
                    points = [(r["step"], r[key]) for r in run["steps"] if r.get(key) is not None]
                    if points:
                        x, y = zip(*points)
                        curves.append((list(x), plot.smooth(list(y), 1 if key == "eval_acc" else window)))
                if not curves:
                    continue
                n = min(len(y) for _, y in curves)
                x = curves[0][0][:n]
                ax.plot(x, [sum(y[i] for _, y in curves) / len(curves) for i in range(n)], color=plt.get_cmap("tab10")(c % 10),
                        label=f"{name} ({len(curves)})", marker="o" if key == "eval_acc" else None, linewidth=1.3)
                if len(curves) > 1:
                    ax.fill_between(x, [min(y[i] for _, y in curves) for i in range(n)], [max(y[i] for _, y in curves) for i in range(n)],
                                    color=plt.get_cmap("tab10")(c % 10), alpha=0.12)
            if file == "dynamic-clip.png":
                last = max(r["steps_done"] for name in names for r in study[name].values())
                ax.axvline(last / 2, color="k", linestyle="--", linewidth=0.8)
            ax.set_title(dict(plot.PANELS).get(key, key), fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(title + " — mean over seeds (in brackets), shaded min-max", fontsize=10)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, file), dpi=100)
        plt.close(fig)
        written.append(os.path.join(out_dir, file))
    return written


def main():
    import flags  # the shared help formatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=flags.HelpFormatter, allow_abbrev=False)
    parser.add_argument("--preset", default="tiny", help="train.py preset: task, model and the update's settings")
    parser.add_argument("--steps", type=int, default=50, help="RL steps per run")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--configs", default=",".join(STUDY_DEFAULT), help=f"comma-separated, from {list(CONFIGS)}")
    parser.add_argument("--eval-every", type=int, default=None, help="held-out evaluation every N steps (default: the preset's)")
    parser.add_argument("--root", default=os.path.join(ROOT, "runs", "study"), help="where the runs go")
    parser.add_argument("--figures", default=None, help="where figures and the table go (default: docs/figures/study-<preset>)")
    parser.add_argument("--json", default=None, help="the study's JSON, updated with the runs found (default: docs/figures/study-<preset>.json)")
    parser.add_argument("--mechanism", default=None, help="the one-step experiment's JSON, set beside the runs "
                        "(default: docs/figures/mechanism-<preset>-warm.json, where it exists)")
    parser.add_argument("--plot-only", action="store_true", help="only redraw from existing runs")
    parser.add_argument("--no-plot", action="store_true", help="only run, do not draw")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (each gets cores / parallel threads)")
    args, train_flags = parser.parse_known_args()  # any other flag is a train.py flag, for every run
    flags.parse_args(["--preset", args.preset, *train_flags], prog="study.py")  # a bad one ends here
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    root = os.path.join(args.root, args.preset)
    figures = args.figures or os.path.join(ROOT, "docs", "figures", f"study-{args.preset}")
    extra = train_flags + (["--eval-every", str(args.eval_every)] if args.eval_every is not None else [])
    start = time.time()
    if args.parallel < 1:
        parser.error("--parallel must be >= 1")
    if args.mechanism and not os.path.isfile(args.mechanism):
        parser.error(f"--mechanism: no such file {args.mechanism}")
    if not args.plot_only:
        jobs = [(name, seed) for seed in seeds for name in names]  # seed-major: an interrupted study has whole seeds first
        threads = max(1, (os.cpu_count() or 1) // args.parallel) if args.parallel > 1 else None
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            futures = [pool.submit(run_one, args.preset, name, seed, args.steps, os.path.join(root, f"{name}-s{seed}"),
                                   extra, threads) for name, seed in jobs]
            failed = [str(f.exception()) for f in futures if f.exception()]
        if failed:
            sys.exit("\n".join(failed))
    study = collect(args.json or os.path.join(ROOT, "docs", "figures", f"study-{args.preset}.json"), root, names, seeds)
    if args.no_plot:
        return
    os.makedirs(figures, exist_ok=True)
    # the table, the verdicts and the figures read finished runs only (an unfinished run's last evaluation is not its final one)
    finished = {n: {s: r for s, r in runs.items() if r["steps_done"] >= args.steps} for n, runs in study.items()}
    finished = {n: runs for n, runs in finished.items() if runs}
    unfinished = [f"{n} seed {s} ({r['steps_done']} steps)" for n, runs in study.items() for s, r in runs.items()
                  if r["steps_done"] < args.steps]
    table = table1(finished)
    if unfinished:
        table += f"\n\nNot finished (left out above): {', '.join(unfinished)}."
    with open(os.path.join(figures, "table1.md"), "w") as f:
        f.write(table + "\n")
    mechanism_path = args.mechanism or os.path.join(ROOT, "docs", "figures", f"mechanism-{args.preset}-warm.json")
    mechanism = json.load(open(mechanism_path)) if os.path.exists(mechanism_path) else None
    with open(os.path.join(figures, "verdicts.md"), "w") as f:
        f.write(verdicts(finished, mechanism) + "\n")
    written = draw_figures(finished, figures)  # means over whole runs only
    print(table)
    print(f"[study] total {time.time() - start:.0f}s; table and figures in {figures}: {', '.join(map(os.path.basename, written))}")


if __name__ == "__main__":
    main()
