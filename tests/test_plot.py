"""plot.py on hand-made metrics: the table's numbers and the figure file."""

import json
import math

import pytest

from cegppo_utils import plot


def fake_run(path, rewards, entropies, eval_acc):
    path.mkdir(parents=True)
    rows = []
    for i, (r, e) in enumerate(zip(rewards, entropies)):
        rows.append({"step": i + 1, "reward_mean": r, "entropy": e, "clip_frac_low_neg": 0.01,
                     "clip_frac_high_pos": 0.0, "clip_frac_low_pos": 0.0, "clip_frac_high_neg": 0.002,
                     "response_length_mean": 20.0})
    rows[-1]["eval_acc"] = eval_acc
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.slow
def test_summary_and_figures(tmp_path):
    a = fake_run(tmp_path / "a-s0", [0.0] * 10 + [1.0] * 10, [0.5] * 20, 0.6)
    b = fake_run(tmp_path / "a-s1", [0.2] * 10 + [0.6] * 10, [0.3] * 20, 0.8)
    c = fake_run(tmp_path / "b-s0", [-1.0] * 20, [0.1] * 20, 0.1)
    written = plot.make_figures({"a": [a, b], "b": [c]}, str(tmp_path / "fig"))
    assert (tmp_path / "fig" / "curves.png").stat().st_size > 10_000
    table = json.loads((tmp_path / "fig" / "summary.json").read_text())
    assert table["a"]["eval_acc"] == pytest.approx([0.7, math.sqrt(0.02)])
    assert (table["a"]["reward_first10"][0] == pytest.approx(0.1)
            and table["a"]["reward_last10"][0] == pytest.approx(0.8))
    assert table["a"]["entropy_last10"][0] == pytest.approx(0.4)
    assert table["b"]["seeds"] == 1 and table["b"]["eval_acc"] == [0.1, 0.0]
    assert "| a | 2 | 70.0 ± 14.1 |" in (tmp_path / "fig" / "summary.md").read_text()
    # no ± 0
    assert "| b | 1 | 10.0 | -1.000 | -1.000 | 0.100 | 0.100 |" in (tmp_path / "fig" / "summary.md").read_text()
    assert len(written) == 3


def test_missing_run_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere/metrics.jsonl not found"):
        plot.read_metrics(str(tmp_path / "nowhere"))


@pytest.mark.slow
def test_plot_py_on_any_run_folder_writes_beside_it(tmp_path):
    """`python -m cegppo_utils.plot RUN`: output in RUN/plots (never docs/), titles from the run, no nan for a missing
    metric."""
    import subprocess
    import sys

    from conftest import ROOT
    run = fake_run(tmp_path / "my-run", [0.1] * 12, [0.4] * 12, 0.5)
    rows = [json.loads(line) for line in (tmp_path / "my-run" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("eval_acc", None)  # a run without held-out evaluation
    (tmp_path / "my-run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = subprocess.run([sys.executable, "-m", "cegppo_utils.plot", run], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "my-run" / "plots" / "curves.png").stat().st_size > 10_000
    table = (tmp_path / "my-run" / "plots" / "summary.md").read_text()
    assert "| my-run | 1 | n/a |" in table and "nan" not in table
    panels = [k for k, _ in plot.available_panels({"my-run": [plot.read_metrics(run)]})]
    assert "eval_acc" not in panels and "approx_kl" not in panels and panels[:2] == ["entropy", "reward_mean"]
    bad = subprocess.run([sys.executable, "-m", "cegppo_utils.plot", str(tmp_path / "nothing")], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "nothing/metrics.jsonl not found" in bad.stderr and "Traceback" not in bad.stderr


def test_run_summary_and_sample_line(tmp_path):
    rows = [{"step": i + 1, "reward_mean": -0.5 + 0.05 * i, "acc_mean": 0.25 + 0.02 * i, "entropy": 0.2 - 0.005 * i,
             "time_rollout_s": 0.5, "time_reward_s": 0.1, "time_update_s": 0.4} for i in range(20)]
    rows[4]["eval_acc"], rows[19]["eval_acc"] = 0.4, 0.55
    (tmp_path / "config.json").write_text("{}")
    lines = plot.run_summary(rows, str(tmp_path), str(tmp_path / "final"))
    assert "20 steps, to step 20, 1.00 s per step" in lines[0]
    # steps 1-10, 11-20
    assert "first 10 steps -> last 10: -0.275 -> +0.225" in lines[1] and "34.0% -> 54.0%" in lines[1]
    assert "0.1775 -> 0.1275" in lines[2]
    assert "step 5 40.0%, step 20 55.0%" in lines[3]
    assert "config.json" in lines[4] and str(tmp_path / "final") in lines[4]
    # a short run resumed at step 2 of 4, with an evaluation before training: halves, its own steps, step 0
    short = [{"step": 0, "eval_acc": 0.3}] + rows[:4]
    lines = plot.run_summary(short, str(tmp_path), str(tmp_path / "final"), first_step=2)
    assert "done: 2 steps, to step 4 (resumed at step 2; the log holds steps 1-4)" in lines[0]
    assert "first 2 steps -> last 2: -0.475 -> -0.375" in lines[1]
    assert "step 0 30.0%" in lines[3]
    assert plot.run_summary([{"step": 0, "eval_acc": 0.3}], str(tmp_path), "f") == [f"no steps logged in {tmp_path}"]
    # a last step that kept no group logs no entropy (a short run with few prompts): said, not a TypeError
    no_update = rows[:1] + [{k: v for k, v in rows[1].items() if k != "entropy"}]
    assert "entropy  first 1 steps -> last 1: 0.2000 -> n/a nats/token" in plot.run_summary(no_update, str(tmp_path),
                                                                                           "f")[2]
    one = [{**rows[0], "time_eval_s": 1.5}]  # one step, with an evaluation's time in its row
    assert plot.run_summary(one, str(tmp_path), "f")[0].startswith(
        "done: 1 step, to step 1, 2.50 s per step (rollout 0.50, reward 0.10, update 0.40, held-out evaluation 1.50)")
    line = plot.sample_line({"step": 3, "reward": 1.0, "advantage": 0.5, "prompt": "Compute 1 + 2.",
                             "completion": "x " * 200})
    assert line.startswith("[step 3 sample] reward +1, A +0.50: Compute 1 + 2. => x x") and line.endswith("...")
    assert len(line) <= 150


def test_a_runs_panels_are_its_algorithms(tmp_path):
    """curves.png draws the diagnostics of the run's own algorithm (its config.json): CE-GPPO's beta regions, PPO-clip's
    clipped tokens, none of either for SAPO (which does not clip), M2PO's mask; runs of two algorithms side by side
    get each one's label; a run without config.json gets the metric's name where algorithms disagree on it."""
    rows = [{"step": 1, "reward_mean": 0.0, "entropy": 0.2, "clip_frac_low_neg": 0.01, "clip_frac_high_pos": 0.0,
             "dual_clip_frac": 0.0, "m2po_masked_frac": 0.1, "response_length_mean": 20.0}]

    def titles(*algos):
        runs = {}
        for algo in algos:
            folder = tmp_path / f"{algo}-{len(list(tmp_path.iterdir()))}"
            run = fake_run(folder, [0.0], [0.2], 0.5)
            (folder / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
            if algo != "unknown":
                (folder / "config.json").write_text(json.dumps({"flags": {"algo": algo}}))
            runs[run] = plot.run_algorithm(run)
        data = {name: [plot.read_metrics(name)] for name in runs}
        return dict(plot.available_panels(data, list(runs.values())))

    ce = titles("ce_gppo")
    assert ce["clip_frac_low_neg"].startswith("beta1 region") and ce["clip_frac_high_pos"].startswith("beta2 region")
    assert "dual_clip_frac" in ce and "m2po_masked_frac" not in ce
    grpo = titles("grpo")
    assert grpo["clip_frac_low_neg"].startswith("clipped") and "beta" not in " ".join(grpo.values())
    sapo = titles("sapo")
    assert list(sapo) == ["entropy", "reward_mean", "response_length_mean"]  # no clip region, no beta
    assert titles("m2po")["m2po_masked_frac"].startswith("masked") and "clip_frac_low_neg" not in titles("m2po")
    both = titles("ce_gppo", "grpo")["clip_frac_low_neg"].splitlines()
    assert both[0].startswith("ce_gppo: beta1 region") and both[1].startswith("grpo: clipped")
    assert titles("unknown")["clip_frac_low_neg"] == ("clip_frac_low_neg (what the loss does there depends on the "
                                                     "algorithm)")


def test_curves_draw_each_steps_own_value_under_the_moving_average_and_shares_in_percent(tmp_path):
    """Issue 59: every panel was a trailing 5-step mean with no raw trace, so a one-step gradient-norm spike was drawn
    at a quarter of its height and an 8-step run showed clipped tokens where there were none. Each step's own value is
    drawn (first, thin), the mean over it; shares of tokens in percent, the unit on the axis."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": t, "reward_mean": 0.0, "entropy": 0.2, "grad_norm": 16.3 if t == 5 else 1.0,
             "clip_frac_low_neg": 0.02 if t <= 4 else 0.0} for t in range(1, 9)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.json").write_text(json.dumps({"flags": {"algo": "grpo"}}))
    fig = plot.figure({"run": [str(run)]})
    axes = {ax.get_title(): ax for ax in fig.axes}
    raw, mean = [list(line.get_ydata()) for line in axes["gradient norm"].get_lines()]
    assert raw == [1.0] * 4 + [16.3] + [1.0] * 3 and max(mean) == pytest.approx((16.3 + 4) / 5)
    clip = axes["clipped: d < 1 - eps_low, A < 0 (no gradient)"]
    raw, mean = [list(line.get_ydata()) for line in clip.get_lines()]
    assert raw == [2.0] * 4 + [0.0] * 4 and mean[-1] == pytest.approx(0.4)  # the mean is not 0 where the step is
    assert clip.get_ylabel() == "% of response tokens" and axes["gradient norm"].get_ylabel() == ""
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_seeds_are_averaged_step_by_step_and_gspo_shares_are_of_tokens(tmp_path):
    """Seed s1 trained nothing at step 2 (no update metrics there): the seeds' mean, min and max pair their values by
    step, at the steps both logged (1 and 3), not by position (which paired s0's step 2 with s1's step 3). GSPO's clip
    shares count the clipped responses' tokens: their axis says so."""
    logged = {"s0": {1: (1.0, 0.1), 2: (2.0, 0.2), 3: (3.0, 0.3)}, "s1": {1: (3.0, 0.3), 3: (7.0, 0.5)}}
    dirs = []
    for seed, steps in logged.items():
        (tmp_path / seed).mkdir()
        rows = [{"step": t, "reward_mean": 0.0, "grad_norm": g, "gspo_clip_frac_low": f} for t, (g, f) in steps.items()]
        (tmp_path / seed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / seed / "config.json").write_text(json.dumps({"flags": {"algo": "gspo"}}))
        dirs.append(str(tmp_path / seed))
    fig = plot.figure({"gspo": dirs}, window=1)
    axes = {ax.get_title(): ax for ax in fig.axes}
    mean = axes["gradient norm"].get_lines()[-1]  # after each seed's own trace
    assert list(mean.get_xdata()) == [1, 3] and list(mean.get_ydata()) == [2.0, 5.0]
    share = axes["sequence clipped: s < 1 - eps_low, A < 0 (no gradient)"]
    assert list(share.get_lines()[-1].get_ydata()) == pytest.approx([20.0, 40.0])
    assert share.get_ylabel() == "% of response tokens"
    assert plot.seed_band([([1, 2, 3], [1.0, 2.0, 3.0]), ([1, 3], [3.0, 7.0])]) == ([1, 3], [2.0, 5.0], [1.0, 3.0],
                                                                                    [3.0, 7.0])
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_curves_and_the_table_are_never_written_through_a_link(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5, "entropy": 0.2}) + "\n")
    out = tmp_path / "plots"
    out.mkdir()
    mine = tmp_path / "mine.txt"
    mine.write_text("a user's file\n")
    for name in ("curves.png", "summary.json", "summary.md"):
        (out / name).symlink_to(mine)
    plot.make_figures({"run": [str(run)]}, str(out))
    assert mine.read_text() == "a user's file\n"
    assert not any((out / name).is_symlink() for name in ("curves.png", "summary.json", "summary.md"))
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG" and json.loads((out / "summary.json").read_text())["run"]
