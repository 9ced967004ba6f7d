"""The long-run entropy study: each configuration trained with a preset for several seeds, then the curves and a table.

    python tools/study.py --preset tiny --steps 50                 # the original CPU study on the arithmetic task
    python tools/study.py --preset sums --steps 150                # the study on the longer-response task (README)
    python tools/study.py --preset tiny --plot-only
    python tools/study.py --preset sums --steps 150 --parallel 18  # a machine with many cores (or a GPU): runs at once

Runs go to runs/study/<preset>/<config>-s<seed>/ and keep checkpoints, so an interrupted study resumes: a finished
run is skipped, an unfinished one continues from its last checkpoint (train.py --resume), exactly. Figures and the
table go to docs/figures/study-<preset>/ (see docs/cpu-reproduction.md).
"""

import argparse
import concurrent.futures
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the pipeline's modules

from configs import CONFIGS, STUDY_DEFAULT  # noqa: E402


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
    start = time.time()
    print(f"[study] {name} seed {seed} ...", flush=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *flags], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if run.returncode:
        raise RuntimeError(f"[study] {name} seed {seed} failed:\n{run.stderr[-3000:]}")
    print(f"[study] {name} seed {seed}: {time.time() - start:.0f}s", flush=True)
    return time.time() - start


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every flag's default."""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--preset", default="tiny", help="train.py preset: task, model and the update's settings")
    parser.add_argument("--steps", type=int, default=50, help="RL steps per run")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--configs", default=",".join(STUDY_DEFAULT), help=f"comma-separated, from {list(CONFIGS)}")
    parser.add_argument("--eval-every", type=int, default=None, help="held-out evaluation every N steps (default: at the end only)")
    parser.add_argument("--root", default=os.path.join(ROOT, "runs", "study"), help="where the runs go")
    parser.add_argument("--figures", default=None, help="where figures and the table go (default: docs/figures/study-<preset>)")
    parser.add_argument("--plot-only", action="store_true", help="only redraw from existing runs")
    parser.add_argument("--no-plot", action="store_true", help="only run, do not draw")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (each gets cores / parallel threads)")
    args = parser.parse_args()
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    root = os.path.join(args.root, args.preset)
    figures = args.figures or os.path.join(ROOT, "docs", "figures", f"study-{args.preset}")
    extra = ["--eval-every", str(args.eval_every or args.steps)]
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
    if args.no_plot:
        return
    import plot
    runs = {name: [os.path.join(root, f"{name}-s{s}") for s in seeds] for name in names}
    plot.make_figures(runs, figures, title=f"{args.preset}: {len(seeds)} seeds per configuration (mean; shaded: min-max), "
                                           "5-step moving average")
    print(f"[study] total {time.time() - start:.0f}s; figures in {figures}")


if __name__ == "__main__":
    main()
