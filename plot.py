"""Curves from one or more runs' metrics.jsonl, seeds shaded as mean +- spread, and a table of final held-out accuracy.

    python plot.py --runs grpo=runs/study/grpo-s0,runs/study/grpo-s1 ce_gppo=runs/study/ce_gppo_0.5_1-s0 --out docs/figures

Each run is a train.py output folder. Curves: entropy, reward, the four clip-region fractions and response length
against step (smoothed over a few steps; shading is the min-max over seeds). The table (markdown, also as JSON)
holds each configuration's last held-out `eval_acc` (avg@4, tiny task) as mean +- std over seeds, and the mean
entropy and reward of the last 10 steps.
"""

import argparse
import json
import math
import os

PANELS = [
    ("entropy", "token entropy"),
    ("reward_mean", "training reward"),
    ("clip_frac_low_neg", "clip fraction: d < 1-eps, A < 0 (beta1 region)"),
    ("clip_frac_high_pos", "clip fraction: d > 1+eps, A > 0 (beta2 region)"),
    ("clip_frac_low_pos", "clip fraction: d < 1-eps, A > 0"),
    ("clip_frac_high_neg", "clip fraction: d > 1+eps, A < 0"),
    ("response_length_mean", "response length"),
]


def read_metrics(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {run_dir} a train.py output folder?")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def smooth(values, window):
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1):i + 1] if v is not None]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def series(rows, key):
    return [r.get(key) for r in rows]


def _mean_std(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    return m, (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0


def summary(runs: dict[str, list[str]]) -> dict:
    """Per configuration: final eval_acc, and last-10-step entropy and reward, as mean and std over seeds."""
    table = {}
    for name, dirs in runs.items():
        per_seed = [read_metrics(d) for d in dirs]
        evals = [next((r["eval_acc"] for r in reversed(rows) if "eval_acc" in r), None) for rows in per_seed]
        last = lambda rows, k: sum(r.get(k, 0.0) for r in rows[-10:]) / len(rows[-10:])  # noqa: E731
        first = lambda rows, k: sum(r.get(k, 0.0) for r in rows[:10]) / len(rows[:10])  # noqa: E731
        table[name] = {
            "seeds": len(dirs),
            "eval_acc": _mean_std(evals),
            "reward_first10": _mean_std([first(rows, "reward_mean") for rows in per_seed]),
            "reward_last10": _mean_std([last(rows, "reward_mean") for rows in per_seed]),
            "entropy_first10": _mean_std([first(rows, "entropy") for rows in per_seed]),
            "entropy_last10": _mean_std([last(rows, "entropy") for rows in per_seed]),
        }
    return table


def markdown(table: dict) -> str:
    def cell(ms, scale=1.0, digits=3):
        return f"{scale * ms[0]:.{digits}f} ± {scale * ms[1]:.{digits}f}"

    lines = ["| config | seeds | held-out avg@4 (%) | reward, first 10 steps | reward, last 10 | entropy, first 10 | entropy, last 10 |",
             "|---|---|---|---|---|---|---|"]
    for name, row in table.items():
        lines.append(f"| {name} | {row['seeds']} | {cell(row['eval_acc'], 100, 1)} | {cell(row['reward_first10'])} | "
                     f"{cell(row['reward_last10'])} | {cell(row['entropy_first10'])} | {cell(row['entropy_last10'])} |")
    return "\n".join(lines)


def make_figures(runs: dict[str, list[str]], out_dir: str, window: int = 5) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    data = {name: [read_metrics(d) for d in dirs] for name, dirs in runs.items()}
    written = []
    cols = 2
    rows_n = math.ceil(len(PANELS) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(13, 3.2 * rows_n), squeeze=False)
    colors = plt.get_cmap("tab10")
    for p, (key, title) in enumerate(PANELS):
        ax = axes[p // cols][p % cols]
        for c, (name, per_seed) in enumerate(data.items()):
            curves = [smooth(series(rows, key), window) for rows in per_seed]
            length = min(len(cv) for cv in curves)
            steps = [r["step"] for r in per_seed[0][:length]]
            mean = [sum(cv[i] for cv in curves) / len(curves) for i in range(length)]
            ax.plot(steps, mean, label=name, color=colors(c % 10), linewidth=1.4)
            if len(curves) > 1:
                ax.fill_between(steps, [min(cv[i] for cv in curves) for i in range(length)],
                                [max(cv[i] for cv in curves) for i in range(length)], color=colors(c % 10), alpha=0.15)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for p in range(len(PANELS), rows_n * cols):
        axes[p // cols][p % cols].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower right", fontsize=9, ncol=2, bbox_to_anchor=(0.98, 0.02))
    fig.suptitle(f"tiny task, mean over seeds (shaded: min-max), {window}-step moving average", fontsize=11)
    fig.tight_layout()
    path = os.path.join(out_dir, "curves.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    table = summary(runs)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(table, f, indent=1)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(markdown(table) + "\n")
    written += [os.path.join(out_dir, "summary.json"), os.path.join(out_dir, "summary.md")]
    print(markdown(table))
    return written


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", required=True, help="NAME=DIR[,DIR...] per configuration (one DIR per seed)")
    parser.add_argument("--out", default="docs/figures", help="output folder")
    parser.add_argument("--window", type=int, default=5, help="moving-average window in steps")
    args = parser.parse_args()
    runs = {}
    for spec in args.runs:
        name, _, dirs = spec.partition("=")
        if not dirs:
            parser.error(f"--runs entries look like NAME=DIR[,DIR...]; got {spec!r}")
        runs[name] = dirs.split(",")
    make_figures(runs, args.out, args.window)


if __name__ == "__main__":
    main()
