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
with the runs found, never emptied, so results accumulate. Table and figures go to docs/figures/study-<preset>/.
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
    table = table1(study)
    with open(os.path.join(figures, "table1.md"), "w") as f:
        f.write(table + "\n")
    written = draw_figures(study, figures)
    print(table)
    print(f"[study] total {time.time() - start:.0f}s; table and figures in {figures}: {', '.join(map(os.path.basename, written))}")


if __name__ == "__main__":
    main()
