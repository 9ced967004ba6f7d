"""Curves of one or more runs (train.py output folders), and a table of their results.

    python -m cegppo_utils.plot runs/tiny   # -> runs/tiny/plots/curves.png, summary.md/.json
    python -m cegppo_utils.plot runs/grpo runs/ce_gppo --out figures/       # several runs, side by side
    python -m cegppo_utils.plot grpo=runs/grpo-s0,runs/grpo-s1 ce=runs/ce-s0,runs/ce-s1
                                                                            # seeds of one configuration: mean, min-max

Curves (each step's own value as a thin light trace, under its trailing moving average over a few steps; with several
seeds the line is their mean and the shading their min-max; shares of tokens in percent): token entropy, training
reward, held-out accuracy, the diagnostics of the run's algorithm (loss.ALGORITHMS: CE-GPPO's beta regions,
PPO-clip's clipped tokens, M2PO's mask, ...; read from the run's config.json), response length, approx KL, grad
norm. A panel is drawn only if some run logged its metric. The table gives, per configuration, the last held-out
`eval_acc` and the mean reward and entropy of the first and last 10 steps (mean ± std over seeds). Output goes to
--out, by default a `plots/` folder beside the first run (never the project's docs/ unless asked).
train.py calls draw_run() and run_summary() at the end of every run.
"""

import json
import math
import os
import textwrap

import loss as L
from cegppo_utils import runfolder

# Every run's panels; the algorithm's own (algorithm_panels) go between the first three and the rest.
PANELS = [
    ("entropy", "token entropy (nats)"),
    ("reward_mean", "training reward"),
    ("eval_acc", "held-out accuracy (avg@k)"),
    ("response_length_mean", "response length (tokens)"),
    ("approx_kl", "approx KL(pi_old || pi) per step"),
    ("grad_norm", "gradient norm"),
]


def run_algorithm(run_dir) -> str | None:
    """The algorithm a run folder's config.json records, or None (no readable config.json, or an unknown name)."""
    try:  # the one reader of a run's files: a FIFO there is refused, never opened
        algo = runfolder.read_json_object(os.path.join(run_dir, "config.json")).get("flags", {}).get("algo")
    except (runfolder.UserError, AttributeError):
        return None
    return algo if isinstance(algo, str) and algo in L.ALGORITHMS else None


def algorithm_panels(algos) -> list[tuple[str, str]]:
    """(metric, title) of the diagnostics the runs' algorithms name (loss.diagnostics), each metric once: titled by its
    algorithm's label, or where several algorithms label it differently, by each (a line per algorithm). A run whose
    algorithm is unknown (None) adds every algorithm's metrics, titled by the metric's name where the algorithms
    disagree on what it means; only those it logged are drawn."""
    labels = {}  # metric -> {algorithm: label}
    for algo in dict.fromkeys(a for a in algos if a is not None):
        for d in L.diagnostics(algo):
            labels.setdefault(d.metric, {})[algo] = d.label
    if None in algos:  # a run of an unknown algorithm: every algorithm's metrics not named above
        named = set(labels)
        for algo in L.ALGORITHMS:
            for d in L.diagnostics(algo):
                if d.metric not in named:
                    labels.setdefault(d.metric, {}).setdefault(None, set()).add(d.label)
    panels = []
    for metric, by_algo in labels.items():
        unknown = by_algo.pop(None, set())
        texts = set(by_algo.values()) | unknown
        if len(texts) == 1:
            title = texts.pop()
        elif by_algo and not unknown:
            title = "\n".join(textwrap.shorten(f"{a}: {t}", 78) for a, t in list(by_algo.items())[:3])
        else:
            title = f"{metric} (what the loss does there depends on the algorithm)"
        panels.append((metric, title))
    return panels


def read_metrics(run_dir):
    """A run's metrics.jsonl rows, a torn last line (a crashed run's) skipped."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {run_dir} a train.py output folder?")
    return runfolder.read_jsonl(path)


def smooth(values, window):
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1):i + 1] if v is not None]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def _mean_std(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    return m, (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0


def window_mean(rows, key, first):
    """The mean of `key` over the first (or last) 10 training steps."""
    rows = [r for r in rows if "reward_mean" in r]  # not the step-0 row of an evaluation before training
    part = rows[:10] if first else rows[-10:]
    values = [r[key] for r in part if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def summary(runs: dict[str, list[str]]) -> dict:
    """Per configuration: final eval_acc, and first/last-10-step reward and entropy, as (mean, std) over seeds."""
    table = {}
    for name, dirs in runs.items():
        per_seed = [read_metrics(d) for d in dirs]
        evals = [next((r["eval_acc"] for r in reversed(rows) if "eval_acc" in r), None) for rows in per_seed]
        table[name] = {"seeds": len(dirs), "eval_acc": _mean_std(evals)}
        for key in ("reward_mean", "entropy"):
            short = key.split("_")[0]
            table[name][f"{short}_first10"] = _mean_std([window_mean(rows, key, True) for rows in per_seed])
            table[name][f"{short}_last10"] = _mean_std([window_mean(rows, key, False) for rows in per_seed])
    return table


def markdown(table: dict) -> str:
    lines = ["| config | seeds | held-out avg@k (%) | reward, first 10 steps | reward, last 10 | entropy, first 10 "
             "| entropy, last 10 |",
             "|---|---|---|---|---|---|---|"]
    for name, row in table.items():
        def cell(ms, scale=1.0, digits=3):
            if math.isnan(ms[0]):
                return "n/a"
            spread = f" ± {scale * ms[1]:.{digits}f}" if row["seeds"] > 1 else ""  # one seed has no spread to show
            return f"{scale * ms[0]:.{digits}f}{spread}"
        lines.append(f"| {name} | {row['seeds']} | {cell(row['eval_acc'], 100, 1)} | {cell(row['reward_first10'])} | "
                     f"{cell(row['reward_last10'])} | {cell(row['entropy_first10'])} | {cell(row['entropy_last10'])} |")
    return "\n".join(lines)


def available_panels(data: dict[str, list[list[dict]]], algos=(None,)) -> list[tuple[str, str]]:
    """The panels some run has a value for (data: name -> per-seed metric rows; algos: the runs' algorithms, None
    for one not known): every run's, with its algorithm's diagnostics after the first three."""
    panels = PANELS[:3] + algorithm_panels(list(algos)) + PANELS[3:]
    return [(k, t) for k, t in panels if any(k in r for per_seed in data.values() for rows in per_seed for r in rows)]


def is_share(key: str) -> bool:
    """Whether a metric is a share of the response tokens: the loss's diagnostics that count (clip_frac_*, the
    masked, capped and truncated shares) hold "frac" in their names. A sequence-level clip's share counts tokens too
    (GSPO's gspo_clip_frac_*: the tokens of the clipped responses, loss.gspo_token_loss)."""
    return "frac" in key


def seed_band(curves):
    """(steps, mean, min, max) over seeds of [(steps, values)] per seed, taken at the steps every seed logged: a step
    where nothing trained logs no update metrics, so the seeds' values are paired by step, not by position."""
    by_step = [dict(zip(steps, values)) for steps, values in curves]
    steps = sorted(set.intersection(*(set(s) for s in by_step)))
    at = [[s[step] for s in by_step] for step in steps]
    return steps, [sum(v) / len(v) for v in at], [min(v) for v in at], [max(v) for v in at]


def figure(runs: dict[str, list[str]], window: int = 5, title: str | None = None):
    """The figure of the panels some run has (None if no run has any): per run, every step's own value as a thin light
    trace, and over it the trailing `window`-step mean (over seeds: their mean, shaded min-max), so that a one-step
    spike or a step at 0 shows as it was; shares in percent, with the unit on the axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {name: [read_metrics(d) for d in dirs] for name, dirs in runs.items()}
    panels = available_panels(data, [run_algorithm(d) for dirs in runs.values() for d in dirs])
    if not panels:
        return None
    cols = 2
    rows_n = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(13, 3.1 * rows_n), squeeze=False)
    colors = plt.get_cmap("tab10")
    for p, (key, label) in enumerate(panels):
        ax = axes[p // cols][p % cols]
        scale = 100.0 if is_share(key) else 1.0
        for c, (name, per_seed) in enumerate(data.items()):
            raw = []
            for rows in per_seed:
                points = [(r["step"], scale * r[key]) for r in rows if r.get(key) is not None]
                if points:
                    steps, values = zip(*points)
                    raw.append((list(steps), list(values)))
            if not raw:
                continue
            if key != "eval_acc":  # evaluations are drawn as they are (points): no average to set them under
                for steps, values in raw:
                    ax.plot(steps, values, color=colors(c % 10), linewidth=0.6, alpha=0.35)
            curves = [(steps, smooth(values, 1 if key == "eval_acc" else window)) for steps, values in raw]
            steps, mean, low, high = seed_band(curves)
            ax.plot(steps, mean, label=name, color=colors(c % 10), linewidth=1.4,
                    marker="o" if key == "eval_acc" else None)
            if len(curves) > 1:
                ax.fill_between(steps, low, high, color=colors(c % 10), alpha=0.15)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        if scale != 1.0:
            ax.set_ylabel("% of response tokens")
        ax.grid(alpha=0.3)
    for p in range(len(panels), rows_n * cols):
        axes[p // cols][p % cols].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=9, ncol=min(4, len(labels)) or 1)
    seeds = max(len(dirs) for dirs in runs.values())
    fig.suptitle(title or (", ".join(runs) + (": mean over seeds (shaded: min-max)" if seeds > 1 else "")
                           + f", {window}-step moving average over each step's own value (thin)"),
                 fontsize=11, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


def draw(runs: dict[str, list[str]], path: str, window: int = 5, title: str | None = None) -> str | None:
    """figure(), saved to path whole and never through a link planted there; returns path (None if no run has a
    panel)."""
    import matplotlib.pyplot as plt

    fig = figure(runs, window, title)
    if fig is None:
        return None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        runfolder.save_figure(fig, path, dpi=100)
    finally:
        plt.close(fig)
    return path


def make_figures(runs: dict[str, list[str]], out_dir: str, window: int = 5, title: str | None = None) -> list[str]:
    """curves.png, summary.json and summary.md for the runs in out_dir; prints the table."""
    os.makedirs(out_dir, exist_ok=True)
    written = [p for p in [draw(runs, os.path.join(out_dir, "curves.png"), window, title)] if p]
    table = summary(runs)  # both files whole, never through a link planted at their names
    runfolder.write_text_atomically(os.path.join(out_dir, "summary.json"), json.dumps(table, indent=1))
    runfolder.write_text_atomically(os.path.join(out_dir, "summary.md"), markdown(table) + "\n")
    written += [os.path.join(out_dir, "summary.json"), os.path.join(out_dir, "summary.md")]
    print(markdown(table))
    return written


# --- what train.py shows at the end of a run --------------------------------------------------------

def draw_run(run_dir: str, path: str) -> str | None:
    """The run's own curves (train.py writes OUTPUT_DIR/curves.png)."""
    return draw({os.path.basename(os.path.normpath(run_dir)): [run_dir]}, path)


def run_summary(rows: list[dict], output_dir: str, final_dir: str, first_step: int = 0) -> list[str]:
    """A few lines: time per step, reward / accuracy / entropy at the start and end of the run (the first and last
    10 steps, or halves of a shorter run), every held-out evaluation, and where the files are. first_step: where
    this process started (a resumed run's checkpoint), so its own steps are told apart from the log's."""
    steps = [r for r in rows if "reward_mean" in r]  # a step-0 row holds only the evaluation before training
    if not steps:
        return [f"no steps logged in {output_dir}"]
    k = max(1, min(10, len(steps) // 2))
    where = f"first {k} steps -> last {k}" if len(steps) > 1 else f"step {steps[0]['step']}"

    def span(key, fmt):
        a, b = (_mean([r.get(key) for r in part]) for part in (steps[:k], steps[-k:]))
        if a is None and b is None:
            return "n/a"
        a, b = ("n/a" if v is None else fmt(v) for v in (a, b))  # a step that kept no group logs no entropy
        return a if len(steps) == 1 else f"{a} -> {b}"

    mine = [r for r in steps if r["step"] > first_step]
    seconds = [r["time_rollout_s"] + r["time_reward_s"] + r["time_update_s"] + r.get("time_eval_s", 0.0)
               for r in mine if "time_update_s" in r]
    phases = {p: _mean([r.get(f"time_{p}_s") for r in mine]) or 0.0 for p in ("rollout", "reward", "update")}
    evals_s = sum(r.get("time_eval_s", 0.0) for r in mine)
    resumed = (f" (resumed at step {first_step}; the log holds steps {steps[0]['step']}-{steps[-1]['step']})"
               if first_step else "")
    lines = [f"done: {len(mine)} step{'s' if len(mine) != 1 else ''}, to step {steps[-1]['step']}{resumed}, "
             f"{sum(seconds) / max(len(seconds), 1):.2f} s per step (rollout {phases['rollout']:.2f}, reward "
             f"{phases['reward']:.2f}, update {phases['update']:.2f}"
             + (f", held-out evaluation {evals_s / max(len(seconds), 1):.2f}" if evals_s else "") + ")",
             f"  reward   {where}: {span('reward_mean', lambda v: f'{v:+.3f}')}"
             f"   (accuracy {span('acc_mean', lambda v: f'{100 * v:.1f}%')})",
             f"  entropy  {where}: {span('entropy', lambda v: f'{v:.4f}')} nats/token"]
    evals = [(r["step"], r["eval_acc"]) for r in rows if "eval_acc" in r]
    if evals:
        lines.append("  held-out avg@k: " + ", ".join(f"step {s} {100 * v:.1f}%" for s, v in evals))
    files = [f for f in ("config.json", "metrics.jsonl", "samples.jsonl", "eval", "curves.png", "checkpoints")
             if os.path.exists(os.path.join(output_dir, f))]
    lines.append(f"  files in {output_dir}: {', '.join(files)}; final policy (HF format): {final_dir}")
    return lines


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def sample_line(sample: dict, width: int = 150) -> str:
    """One completion from samples.jsonl on one line, shortened."""
    def short(text, n):
        text = " ".join(str(text).split())
        return text if len(text) <= n else text[:n - 3] + "..."
    head = f"[step {sample['step']} sample] reward {sample['reward']:+.0f}, A {sample['advantage']:+.2f}: "
    return head + short(sample["prompt"], 50) + " => " + short(sample["completion"], max(20, width - len(head) - 54))


def main():
    from cegppo_utils import cli  # the command line: every bad input one line and exit code 2, before any drawing
    parser = cli.Parser("plot.py", description=__doc__)
    parser.add_argument("runs", nargs="+", help="run folders, or NAME=DIR[,DIR...] for the seeds of one configuration")
    parser.add_argument("--out", default=None, help="output folder (default: plots/ beside the first run)")
    parser.add_argument("--window", type=int, default=5, help="moving-average window in steps")
    parser.add_argument("--title", default=None, help="figure title (default: from the runs' names)")
    args = parser.parse_args()
    if args.window < 1:
        parser.error(f"--window {args.window}: must be >= 1")
    runs = {}
    for spec in args.runs:
        name, _, dirs = spec.partition("=")
        if not dirs:
            name, dirs = os.path.basename(os.path.normpath(spec)), spec
        runs[name] = dirs.split(",")
        if not name or not all(d.strip() for d in runs[name]):
            parser.error(f"{cli.short(repr(spec))}: a run folder or a name is empty; give NAME=DIR[,DIR...] or DIR")
    for dirs in runs.values():
        for d in dirs:
            metrics = os.path.join(d, "metrics.jsonl")
            if not os.path.exists(metrics):
                parser.error(f"{cli.short(d)}/metrics.jsonl not found: is {cli.short(d)} a train.py output folder?")
            problem = cli.input_problem(metrics, "run")
            if not problem:
                try:  # every row by the run's own rule (an object with its step), before anything is drawn
                    runfolder.read_jsonl(metrics)
                except runfolder.UserError as e:
                    problem = str(e)
            if problem:
                parser.error(problem)
    first = runs[next(iter(runs))][0]
    out = args.out or os.path.join(first, "plots")
    problem = cli.folder_problem(out, "--out")
    taken = [f for f in ("curves.png", "summary.json", "summary.md") if os.path.isdir(os.path.join(out, f))]
    if problem or taken:  # found before the drawing, not when its files are written
        parser.error(problem or f"--out {cli.short(out)}: {taken[0]} in it is a folder; move it aside")
    written = make_figures(runs, out, args.window, args.title)
    print("wrote " + ", ".join(written))


if __name__ == "__main__":
    main()
