"""The CPU-scale entropy study: every method on the tiny task, 3 seeds each, then the figures and the table.

    python study.py                 # runs what is missing (about 35 minutes on 2 cores), then plots
    python study.py --steps 20 --seeds 0     # a quicker, smaller version
    python study.py --plot-only

Runs go to runs/study/<config>-s<seed>/ (a finished run is skipped, so an interrupted study resumes); figures and
the table to docs/figures/. docs/cpu-reproduction.md discusses the results.
"""

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> train.py flags on top of --preset tiny (which already uses several mini-batches per rollout batch)
CONFIGS = {
    "grpo": ["--algo", "grpo"],
    "dapo": ["--algo", "dapo"],
    "gppo": ["--algo", "gppo"],
    "ce_gppo_0.5_1": ["--algo", "ce_gppo", "--beta1", "0.5", "--beta2", "1.0"],
    "ce_gppo_0.75_1": ["--algo", "ce_gppo", "--beta1", "0.75", "--beta2", "1.0"],
    "ce_gppo_1_0.5": ["--algo", "ce_gppo", "--beta1", "1.0", "--beta2", "0.5"],
    "ce_gppo_0_1": ["--algo", "ce_gppo", "--beta1", "0.0", "--beta2", "1.0"],
    "ce_gppo_0.5_1_dyn_id": ["--algo", "ce_gppo", "--beta1", "0.5", "--beta2", "1.0", "--dynamic-clip", "id"],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="RL steps per run")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {list(CONFIGS)}")
    parser.add_argument("--root", default=os.path.join(HERE, "runs", "study"), help="where the runs go")
    parser.add_argument("--figures", default=os.path.join(HERE, "docs", "figures"), help="where figures and the table go")
    parser.add_argument("--plot-only", action="store_true", help="only redraw from existing runs")
    parser.add_argument("--no-plot", action="store_true", help="only run, do not draw")
    args = parser.parse_args()
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    start = time.time()
    if not args.plot_only:
        for name in names:
            for seed in seeds:
                out = os.path.join(args.root, f"{name}-s{seed}")
                if os.path.exists(os.path.join(out, "final", "config.json")):
                    print(f"[study] {name} seed {seed}: done already")
                    continue
                flags = ["--preset", "tiny", *CONFIGS[name], "--seed", str(seed), "--max-steps", str(args.steps),
                         "--eval-every", str(args.steps), "--save-every", str(args.steps), "--output-dir", out]
                if os.path.exists(os.path.join(out, "checkpoints")):
                    flags.append("--resume")
                elif os.path.exists(out):
                    import shutil
                    shutil.rmtree(out)  # a run that died before its first checkpoint starts over
                t0 = time.time()
                print(f"[study] {name} seed {seed} ...", flush=True)
                run = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *flags],
                                     cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                if run.returncode:
                    sys.exit(f"[study] {name} seed {seed} failed:\n{run.stderr[-3000:]}")
                print(f"[study] {name} seed {seed}: {time.time() - t0:.0f}s", flush=True)
    if args.no_plot:
        return
    import plot
    runs = {name: [os.path.join(args.root, f"{name}-s{s}") for s in seeds] for name in names}
    plot.make_figures(runs, args.figures)
    print(f"[study] total {time.time() - start:.0f}s; figures in {args.figures}")


if __name__ == "__main__":
    main()
