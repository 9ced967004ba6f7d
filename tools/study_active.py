"""The second study's readings, by docs/study-protocol-active.md, re-derived from its JSONs alone, one per block of
runs from one warm start (the runs are made by tools/study.py, which writes them):

    python -m tools.study_active     # docs/figures/study-merge-active/{regime,sizing,verdicts}.md and entropy.png

Stage 1: the regime grid (GRPO only) and the point its rule chooses. Stage 2: the effect to detect, GRPO's spread,
the seed count and the arms that fit the budget. Stage 3: every claim's paired estimate, 95% interval, raw and
Holm-adjusted p-values, minimum detectable effect and verdict. Each part reads only what exists so far, and says what
is missing.
"""

import glob
import json
import math
import os

from cegppo_utils import cli, runfolder
from tools import study_json
from tools.configs import CONFIGS, REGIME_GRID
from tools.stats import ImpossibleInput, holm, holm_adjusted, mean_ci, min_detectable, paired_power, t_test_p
from tools.study_json import ROOT, configurations, load_study, mean_entropy, para, pct, study_problem

JSON = study_json.stored(os.path.join(ROOT, "docs", "figures", "study-merge-active.json.gz"))
FIGURES = os.path.join(ROOT, "docs", "figures", "study-merge-active")
REGIONS = ("clip_frac_low_neg", "clip_frac_high_pos", "clip_frac_low_pos", "clip_frac_high_neg")

# --- blocks: one per warm start (the protocol's amendment of 2026-11-26) ----------------------------------------


def block_paths(json_path: str) -> list[str]:
    """Block A's JSON, then the further blocks' beside it (`<name>-b.json`, `-c.json`, ..., each plain or packed as
    `.json.gz`, study_json.stored), one per warm start."""
    suffix = next((s for s in (".json.gz", ".json") if json_path.endswith(s)), None)
    if suffix is None:
        return [json_path]
    base = json_path[:-len(suffix)]
    named = glob.glob(glob.escape(base) + "-[b-z].json") + glob.glob(glob.escape(base) + "-[b-z].json.gz")
    letters = sorted({block_letter(p) for p in named})
    return [json_path] + [study_json.stored(f"{base}-{x.lower()}{suffix}") for x in letters]


def block_letter(path: str) -> str:
    """A further block's letter, upper case, from its JSON's name (`<name>-b.json` or `<name>-b.json.gz`: "B")."""
    return path.removesuffix(".gz").removesuffix(".json")[-1].upper()


def merge_blocks(blocks: list[dict]) -> dict:
    """One study from its blocks: block A as it is, a later block's seeds named with its letter ("B3"), so runs pair
    only within a block. "_blocks" records each block's warm-start hash."""
    study = {name: dict(runs) if not name.startswith("_") else runs for name, runs in blocks[0].items()}
    study["_blocks"] = {"A": blocks[0].get("_warm_start", {}).get("sha256")}
    for letter, block in zip("BCDEFGHIJ", blocks[1:]):
        study["_blocks"][letter] = block.get("_warm_start", {}).get("sha256")
        for name, runs in configurations(block).items():
            study.setdefault(name, {}).update({f"{letter}{s}": run for s, run in runs.items()})
    return study


def block_of(seed: str) -> str:
    return "A" if seed[0].isdigit() else seed[0]


def seed_order(seed: str) -> tuple:
    """Block A's seeds first, each block's by number."""
    return (block_of(seed), int(seed.lstrip("ABCDEFGHIJ")))


# --- stage 1: the regime ------------------------------------------------------------------------------------------


def step_rows(run) -> list[dict]:
    """A run's training steps (the rows with a reward; step 0 is only an evaluation)."""
    return [r for r in run["steps"] if "reward_mean" in r]


def window(run, key, first: int, last: int):
    """Mean of `key` over the run's steps first..last (inclusive); None where none logged it."""
    values = [r[key] for r in step_rows(run) if first <= r["step"] <= last and r.get(key) is not None]
    return sum(values) / len(values) if values else None


def outside(row) -> float:
    """The share of a step's trained tokens outside the clip interval: the four clip regions together."""
    return sum(row.get(k, 0.0) for k in REGIONS)


def evaluations(run) -> dict:
    return {r["step"]: r["eval_acc"] for r in run["steps"] if r.get("eval_acc") is not None}


def optimizer_steps_per_batch(name: str) -> int:
    """U of a grid point: 8 prompts trained per step in mini-batches of 2 (U = 4) or 1, times its passes."""
    flags = CONFIGS[name]
    mini = int(flags[flags.index("--mini-batch-prompts") + 1]) if "--mini-batch-prompts" in flags else 2
    epochs = int(flags[flags.index("--ppo-epochs") + 1]) if "--ppo-epochs" in flags else 1
    return 8 // mini * epochs


def rule_tests(run: dict) -> dict:
    """Stage 1's three tests on a GRPO run's steps 0-100, with the numbers behind them."""
    evals = evaluations(run)
    start, end = evals.get(0), evals.get(100)
    later = [a for s, a in evals.items() if 0 < s <= 100]
    share = sum(outside(r) for r in step_rows(run) if 51 <= r["step"] <= 100) / max(
        1, sum(1 for r in step_rows(run) if 51 <= r["step"] <= 100))
    first10, last10 = window(run, "entropy", 1, 10), window(run, "entropy", 91, 100)
    binds = share >= 0.01
    learns = start is not None and end is not None and end - start >= 0.15
    stable = (start is not None and end is not None and bool(later) and min(later) >= start - 0.05
              and end >= max(later) - 0.10 and first10 is not None and last10 is not None and last10 >= first10 / 4)
    return {"share": share, "beta1_region": window(run, "clip_frac_low_neg", 51, 100),
            "beta2_region": window(run, "clip_frac_high_pos", 51, 100),
            "start": start, "end": end, "best": max(later) if later else None, "worst": min(later) if later else None,
            "entropy_first10": first10, "entropy_last10": last10, "kl": window(run, "approx_kl", 51, 100),
            "binds": binds, "learns": learns, "stable": stable, "passes": binds and learns and stable}


def grid_point(name: str, run: dict) -> dict:
    """The rule's three tests on one grid run (seed 100, 100 steps)."""
    flags = CONFIGS[name]
    return {"name": name, "lr": float(flags[flags.index("--lr") + 1]), "updates": optimizer_steps_per_batch(name),
            "steps_done": run["steps_done"], **rule_tests(run)}


def choose_regime(study: dict, seed: str = "100"):
    """(the grid's rows in the protocol's order of preference, the chosen point or None, what is missing): the first
    point of REGIME_GRID (8 optimizer steps per batch by lr, then 16, then 4) that passes all three tests. No choice
    while a point earlier in that order has not finished its 100 steps."""
    rows, missing = [], []
    for name in REGIME_GRID:
        run = study.get(name, {}).get(seed)
        if run is None or run["steps_done"] < 100:
            missing.append(name)
            continue
        rows.append(grid_point(name, run))
    chosen = None
    for name in REGIME_GRID:
        row = next((r for r in rows if r["name"] == name), None)
        if row is None:
            break  # an earlier point is unknown: it could still be the choice
        if row["passes"]:
            chosen = row
            break
    return rows, chosen, missing


def regime_report(study: dict) -> str:
    rows, chosen, missing = choose_regime(study)
    lines = ["| point | lr | optimizer steps per batch | outside the interval, steps 51-100 (%) | beta1 / beta2 "
             "region (%) | avg@8 step 0 -> 100 (best, worst) | entropy 1-10 -> 91-100 | binds | learns | no collapse |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " **(chosen)**" if chosen and r["name"] == chosen["name"] else ""
        lines.append(f"| {r['name']}{mark} | {r['lr']:g} | "
                     f"{r['updates']} | {100 * r['share']:.2f} | {100 * r['beta1_region']:.2f} / "
                     f"{100 * r['beta2_region']:.2f} | {pct(r['start'])} -> {pct(r['end'])} ({pct(r['best'])}, "
                     f"{pct(r['worst'])}) | {r['entropy_first10']:.3f} -> {r['entropy_last10']:.3f} | "
                     f"{'yes' if r['binds'] else 'no'} | {'yes' if r['learns'] else 'no'} | "
                     f"{'yes' if r['stable'] else 'no'} |")
    lines += ["", para("GRPO, seed 100, 100 steps on `merge`; the rule (docs/study-protocol-active.md): at least 1% "
                       "of trained tokens outside the clip interval over steps 51-100; avg@8 at step 100 at least 15 "
                       "points above step 0; no evaluation more than 5 points below step 0, step 100 within 10 points "
                       "of the best, last-10 entropy at least a quarter of the first-10. The choice: the first point "
                       "that passes in the order 8 optimizer steps per batch by lr, then 16, then 4.")]
    if missing:
        lines += ["", f"Not finished: {', '.join(missing)}."]
    lines += ["", f"Chosen: **{chosen['name']}**." if chosen else
              ("No point passes: the protocol's second grid (eps 0.1) is next." if not missing else
               "No choice yet: a point earlier in the order of preference has not finished.")]
    return "\n".join(lines)


# --- stage 2: the seed count ------------------------------------------------------------------------------------

REFERENCE_EFFECT = 5e-6  # nats per step: the merge study's steady one-step effect of the beta regions (lr 1e-4, U 4)
REFERENCE_SHARE = 0.00081  # its share of tokens outside the interval under GRPO
SIGMA_FLOOR = 0.0044  # the merge study's paired SD of mean entropy over a run
ARMS = ["grpo", "ce_gppo_0.5_1", "ce_gppo_1_0.5", "ce_gppo_1_1", "ce_gppo_0_1", "grpo_dyn_id", "grpo_dyn_did",
        "grpo_dyn_od_h0.5", "grpo_dyn_od", "dapo"]
DROP_ORDER = ["dapo", "grpo_dyn_od", "grpo_dyn_did", "grpo_dyn_id", "grpo_dyn_od_h0.5"]
BUDGET_CORE_SECONDS = 24 * 3600  # 12 hours of a 2-core machine running two one-core runs at once


def run_seconds(run) -> float:
    """Core-seconds a run took: its hardware segments' seconds times their threads (one run per core here)."""
    return sum((s.get("seconds") or 0.0) * (s.get("threads") or 1) for s in run.get("hardware") or [])


def sizing(study: dict, chosen: dict, steps: int = 200) -> dict | None:
    """The protocol's stage 2 from GRPO's seeds 0-2 at the chosen point: delta, sigma, n, the minimum detectable
    effect at n, and the arms that fit the budget; None until those three runs have finished."""
    runs = [study.get("grpo", {}).get(s) for s in ("0", "1", "2")]
    if chosen is None or any(r is None or r["steps_done"] < steps for r in runs):
        return None
    share = sum(outside(r) for run in runs for r in step_rows(run)) / sum(len(step_rows(run)) for run in runs)
    per_step = REFERENCE_EFFECT * (chosen["lr"] / 1e-4) * (chosen["updates"] / 4) * (share / REFERENCE_SHARE)
    delta = per_step * steps / 2
    means = [mean_entropy(r) for r in runs]
    spread = math.sqrt(sum((m - sum(means) / 3) ** 2 for m in means) / 2)
    sigma = max(math.sqrt(2) * spread, SIGMA_FLOOR)
    n = next((k for k in range(5, 11) if paired_power(delta, sigma, k) >= 0.8), 10)
    per_run = sum(run_seconds(r) for r in runs) / 3
    grid = sum(run_seconds(study[g]["100"]) for g in REGIME_GRID if "100" in study.get(g, {}))
    arms = list(ARMS)
    for drop in [None] + DROP_ORDER:
        if drop:
            arms.remove(drop)
        needed = grid + per_run * (n * len(arms) - 3)  # GRPO's first three seeds are already run
        if needed <= BUDGET_CORE_SECONDS:
            break
    return {"share_outside": share, "effect_per_step": per_step, "delta": delta, "grpo_mean_entropy": means,
            "sd_between_seeds": spread, "sigma": sigma, "seeds": n, "power_at_delta": paired_power(delta, sigma, n),
            "mde": min_detectable(sigma, n), "core_seconds_per_run": per_run, "grid_core_seconds": grid,
            "arms": arms, "core_hours_planned": needed / 3600, "fits": needed <= BUDGET_CORE_SECONDS}


def sizing_report(size: dict | None, chosen: dict | None) -> str:
    if size is None:
        return "Not yet: the sizing needs the chosen point and GRPO's seeds 0-2 there, 200 steps each."
    lines = ["| quantity | value |", "|---|---|",
             f"| chosen point | {chosen['name']}: lr {chosen['lr']:g}, {chosen['updates']} optimizer steps per batch |",
             f"| GRPO's share outside the interval, steps 1-200, seeds 0-2 | {100 * size['share_outside']:.2f}% |",
             f"| the effect to detect, per step (extrapolated) | {size['effect_per_step']:.2e} nats |",
             f"| delta: its mean over 200 steps | {size['delta']:.4f} nats |",
             f"| GRPO's mean entropy, seeds 0-2 | {', '.join(f'{m:.4f}' for m in size['grpo_mean_entropy'])} |",
             f"| sigma: sqrt(2) x their SD ({size['sd_between_seeds']:.4f}), at least {SIGMA_FLOOR} | "
             f"{size['sigma']:.4f} nats |",
             f"| seeds | {size['seeds']} (power {size['power_at_delta']:.2f} at delta) |",
             f"| minimum detectable effect at {size['seeds']} seeds (80% power, two-sided 5%) | "
             f"{size['mde']:.4f} nats |",
             f"| one run | {size['core_seconds_per_run'] / 60:.1f} core-minutes |",
             f"| arms that fit the budget | {', '.join(size['arms'])} |",
             f"| planned | {size['core_hours_planned']:.1f} of 24 core-hours "
             f"(grid {size['grid_core_seconds'] / 3600:.1f}) |"]
    return "\n".join(lines)


# --- stage 3: the claims --------------------------------------------------------------------------------------


def paired_by_seed(study, a, b, value) -> dict:
    """{seed: a - b} of a per-run number, on the seeds where both have it, in seed order. A seed names one block's
    run ("3" in block A, "B3" in block B), so a pair never spans two warm starts."""
    out = {}
    for s in sorted((s for s in study.get(a, {}) if s in study.get(b, {})), key=seed_order):
        x, y = value(study[a][s]), value(study[b][s])
        if x is not None and y is not None:
            out[s] = x - y
    return out


def contrast(label, pairs: dict, want) -> dict:
    """One paired comparison over {seed: difference}, the blocks pooled: n, mean, 95% interval, p, the minimum
    detectable effect from its own SD, and each block's mean (shown, not judged)."""
    values = list(pairs.values())
    by_block = {}
    for s, v in pairs.items():
        by_block.setdefault(block_of(s), []).append(v)
    if len(values) < 2:
        return {"label": label, "n": len(values), "want": want}
    mean, (lo, hi) = mean_ci(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return {"label": label, "n": len(values), "mean": mean, "ci": [lo, hi], "p": t_test_p(values), "want": want,
            "mde": min_detectable(sd, len(values)) if sd > 0 else 0.0,
            "blocks": {b: [len(v), sum(v) / len(v)] for b, v in sorted(by_block.items())}}


def read(c: dict) -> str:
    """The protocol's verdict on one contrast whose family's Holm step has set c["holm"]."""
    if "mean" not in c:
        return "fewer than 2 seeds"
    lo, hi = c["ci"]
    if c["want"] == "not below":
        return (f"no loss detected (a loss of up to {-100 * lo:.1f} points not excluded)" if hi >= 0
                else "loses accuracy")
    good, bad = (lo > 0, hi < 0) if c["want"] == "above" else (hi < 0, lo > 0)
    if good:
        return "holds" if c["holm"] else "holds uncorrected only"
    return "reversed" if bad else "not resolved"


def with_holm(contrasts: list[dict]) -> list[dict]:
    """Holm's step-down over the family's contrasts that have a p-value: whether each survives (c["holm"]) and its
    adjusted p-value (c["p_holm"]), beside its raw one (c["p"])."""
    tested = [c for c in contrasts if "p" in c]
    pvalues = [c["p"] for c in tested]
    for c, rejected, adjusted in zip(tested, holm(pvalues), holm_adjusted(pvalues)):
        c["holm"], c["p_holm"] = rejected, adjusted
    return contrasts


def p_text(p: float) -> str:
    """A p-value for a table: three decimals, two significant digits below 0.01, and a bound below 0.0001."""
    return f"{p:.3f}" if p >= 0.01 else f"{p:.2g}" if p >= 1e-4 else "< 0.0001"


def diff_window(first, last):
    return lambda run: window(run, "entropy", first, last)


def od_recovery(study, name) -> tuple[dict, list[str]]:
    """{seed: D over the 10 steps after the run's first switch to state 1 minus D over the 10 steps before it} (D: the
    schedule's entropy minus GRPO's on the same seed), and the seeds that never switched."""
    values, never = {}, []
    for s, run in sorted(study.get(name, {}).items(), key=lambda kv: seed_order(kv[0])):
        base = study.get("grpo", {}).get(s)
        switch = next((r["step"] for r in step_rows(run) if r.get("od_state") == 1), None)
        if switch is None:
            never.append(s)
            continue
        if base is None:
            continue
        windows = [window(r, "entropy", first, last) for first, last in ((switch + 1, switch + 10),
                                                                         (max(1, switch - 9), switch))
                   for r in (run, base)]
        if None not in windows:  # steps with no trained group log no entropy
            values[s] = (windows[0] - windows[1]) - (windows[2] - windows[3])
    return values, never


def accuracy_endpoint(run):
    """Mean held-out avg@8 over the evaluations at steps 100-200 (midpoint to end)."""
    evals = evaluations(run)
    values = [evals[s] for s in (100, 125, 150, 175, 200) if s in evals]
    return sum(values) / len(values) if len(values) == 5 else None


def claims(study: dict) -> dict:
    """Every contrast of the protocol, by family, with Holm applied within each family."""
    betas = [contrast("1: larger beta1 lowers entropy: (1, 1) - (0, 1)",
                      paired_by_seed(study, "ce_gppo_1_1", "ce_gppo_0_1", mean_entropy), "below"),
             contrast("2: larger beta2 raises entropy: (1, 1) - (1, 0.5)",
                      paired_by_seed(study, "ce_gppo_1_1", "ce_gppo_1_0.5", mean_entropy), "above")]
    betas += [contrast(f"3: (1, 0.5) falls fastest: (1, 0.5) - {b}",
                       paired_by_seed(study, "ce_gppo_1_0.5", b, mean_entropy), "below")
              for b in ("ce_gppo_0_1", "ce_gppo_0.5_1", "ce_gppo_1_1", "grpo")]
    betas += [contrast(f"4: (0.5, 1) stays highest: (0.5, 1) - {b}",
                       paired_by_seed(study, "ce_gppo_0.5_1", b, mean_entropy), "above")
              for b in ("ce_gppo_0_1", "ce_gppo_1_1", "ce_gppo_1_0.5")]
    dynamic = []
    for name in ("grpo_dyn_id", "grpo_dyn_did", "grpo_dyn_od_h0.5", "grpo_dyn_od"):
        dynamic.append(contrast(f"{name} keeps entropy higher: D(1-200)",
                                paired_by_seed(study, name, "grpo", mean_entropy), "above"))
    dynamic += [contrast("grpo_dyn_id rises: D(1-100)",
                         paired_by_seed(study, "grpo_dyn_id", "grpo", diff_window(1, 100)), "above"),
                contrast("grpo_dyn_id then falls: D(101-200)",
                         paired_by_seed(study, "grpo_dyn_id", "grpo", diff_window(101, 200)), "below")]
    did = study.get("grpo_dyn_did", {})
    own_fall = {s: window(r, "entropy", 41, 50) - window(r, "entropy", 1, 10) for s, r in did.items()
                if window(r, "entropy", 41, 50) is not None and window(r, "entropy", 1, 10) is not None}
    d = {w: paired_by_seed(study, "grpo_dyn_did", "grpo", diff_window(*w)) for w in ((1, 50), (51, 100), (151, 200))}
    seeds = [s for s in d[(1, 50)] if s in d[(51, 100)] and s in d[(151, 200)]]
    dynamic += [contrast("grpo_dyn_did falls first: its steps 41-50 - 1-10", own_fall, "below"),
                contrast("grpo_dyn_did recovers: D(51-100) - D(1-50)",
                         {s: d[(51, 100)][s] - d[(1, 50)][s] for s in seeds}, "above"),
                contrast("grpo_dyn_did falls again: D(151-200) - D(51-100)",
                         {s: d[(151, 200)][s] - d[(51, 100)][s] for s in seeds}, "below")]
    switches = {}
    for name in ("grpo_dyn_od_h0.5", "grpo_dyn_od"):
        values, never = od_recovery(study, name)
        switches[name] = never
        dynamic.append(contrast(f"{name} recovers after its first switch: D(10 after) - D(10 before)", values, "above"))
    accuracy = [contrast(f"(0.5, 1) - {b}, mean avg@8 steps 100-200",
                         paired_by_seed(study, "ce_gppo_0.5_1", b, accuracy_endpoint), "above")
                for b in ("grpo", "dapo")]
    keeps = [contrast(f"{n} - grpo, mean avg@8 steps 100-200", paired_by_seed(study, n, "grpo", accuracy_endpoint),
                      "not below") for n in ("grpo_dyn_id", "grpo_dyn_did", "grpo_dyn_od_h0.5", "grpo_dyn_od")]
    return {"betas": with_holm(betas), "dynamic": with_holm(dynamic), "accuracy": with_holm(accuracy),
            "keeps_accuracy": keeps, "od_never_switched": switches}


def verdicts_report(study: dict) -> str:
    result = claims(study)
    lines = []
    betas = "The betas (mean entropy over the steps a run logged, amendment 1 of 2026-11-25; nats; Holm over 9)"
    for family, title, unit in (("betas", betas, 1.0),
                                ("dynamic", "Dynamic clipping against GRPO (entropy, nats; Holm over the family)", 1.0),
                                ("accuracy", "Accuracy (avg@8 points; Holm over 2)", 100.0),
                                ("keeps_accuracy", "Dynamic clipping: without losing accuracy (avg@8 points)", 100.0)):
        lines += ["", f"**{title}**", "", "| claim | seeds | estimate [95% CI] | p | p, Holm-adjusted | MDE | "
                  "verdict | per block (seeds: mean) |", "|---|---|---|---|---|---|---|---|"]
        fmt = (lambda x: f"{x:+.4f}") if unit == 1.0 else (lambda x: f"{100 * x:+.1f}")
        for c in result[family]:
            if "mean" not in c:
                lines.append(f"| {c['label']} | {c['n']} | n/a | | | | fewer than 2 seeds | |")
                continue
            holm_text = "" if "holm" not in c else (
                f"{p_text(c['p_holm'])} ({'survives' if c['holm'] else 'does not survive'})")
            blocks = "; ".join(f"{b} ({n}): {fmt(m)}" for b, (n, m) in c["blocks"].items())
            lines.append(f"| {c['label']} | {c['n']} | {fmt(c['mean'])} [{fmt(c['ci'][0])}, {fmt(c['ci'][1])}] | "
                         f"{p_text(c['p'])} | {holm_text} | {fmt(c['mde']).lstrip('+')} | {read(c)} | {blocks} |")
    never = {n: s for n, s in result["od_never_switched"].items() if s}
    if never:
        lines += ["", "OD runs that never switched to state 1 (OD is not exercised there): " +
                  "; ".join(f"{n} seeds {', '.join(s)}" for n, s in never.items()) + "."]
    return "\n".join(lines).lstrip()


def arms_report(study: dict) -> str:
    """Per arm, over its finished seeds, what the verdicts rest on and what they do not judge: mean entropy, the
    shares of tokens in the beta regions, the steps that trained nothing (every group's answers alike: a run whose
    accuracy fell to 0 trains on nothing and logs no entropy), final avg@8 and the runs that ended below 10%."""
    lines = ["| arm | seeds | mean entropy [95% CI] | beta1 / beta2 region (% tokens) | steps with no trained group "
             "(per run) | avg@8 steps 100-200 | final avg@8 | runs ending below 10% |",
             "|---|---|---|---|---|---|---|---|"]

    def ci(values, scale=1.0, digits=4):
        values = [v for v in values if v is not None]
        if not values:
            return "n/a"
        if len(values) == 1:  # one seed: its value, no interval
            return f"{scale * values[0]:.{digits}f}"
        mean, (lo, hi) = mean_ci(values)
        return f"{scale * mean:.{digits}f} [{scale * lo:.{digits}f}, {scale * hi:.{digits}f}]"

    for name in [a for a in ARMS if a in study]:
        runs = list(study[name].values())
        idle = [sum(r.get("entropy") is None for r in step_rows(run)) for run in runs]
        finals = [evaluations(run).get(200) for run in runs]
        lines.append(f"| {name} | {len(runs)} | {ci([mean_entropy(r) for r in runs])} | "
                     f"{100 * sum(window(r, 'clip_frac_low_neg', 1, 200) or 0 for r in runs) / len(runs):.2f} / "
                     f"{100 * sum(window(r, 'clip_frac_high_pos', 1, 200) or 0 for r in runs) / len(runs):.2f} | "
                     f"{sum(idle) / len(idle):.1f} | {ci([accuracy_endpoint(r) for r in runs], 100, 1)} | "
                     f"{ci(finals, 100, 1)} | {sum(f is not None and f < 0.10 for f in finals)} of {len(runs)} |")
    lines += ["", para("Mean entropy: over the steps that logged it (train.py measures entropy on the tokens a step "
                       "trains on; a step whose every group scored alike trains on nothing). Accuracy intervals are "
                       "plain t-intervals. Shown, not judged: the verdicts are in verdicts.md.")]
    return "\n".join(lines)


# --- the figure -------------------------------------------------------------------------------------------------


def draw_entropy(study: dict, path: str, window_steps: int = 5) -> str | None:
    """Entropy against step per arm: the mean over seeds with its 95% t-band, step by step, smoothed over
    `window_steps`; left the beta arms, right dynamic clipping beside GRPO."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cegppo_utils import plot
    panels = [("CE-GPPO's betas", ["grpo", "ce_gppo_0_1", "ce_gppo_0.5_1", "ce_gppo_1_1", "ce_gppo_1_0.5"]),
              ("dynamic clipping", ["grpo", "grpo_dyn_id", "grpo_dyn_did", "grpo_dyn_od_h0.5", "grpo_dyn_od", "dapo"])]
    if not any(name in study for _, names in panels for name in names):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, (title, names) in zip(axes, panels):
        for c, name in enumerate(n for n in names if n in study):
            runs = [r for r in study[name].values() if r["steps_done"] >= 200]
            if not runs:
                continue
            logged = [[r for r in step_rows(run) if r.get("entropy") is not None] for run in runs]
            curves = [dict(zip([r["step"] for r in rows], plot.smooth([r["entropy"] for r in rows], window_steps)))
                      for rows in logged]
            x = sorted(set.intersection(*(set(k) for k in curves)))
            color = plt.get_cmap("tab10")(c % 10)
            ax.plot(x, [sum(k[t] for k in curves) / len(curves) for t in x], color=color,
                    label=f"{name} ({len(runs)})", linewidth=1.3)
            if len(runs) > 1:  # a band needs two runs or more
                bands = [mean_ci([k[t] for k in curves])[1] for t in x]
                ax.fill_between(x, [lo for lo, _ in bands], [hi for _, hi in bands], color=color, alpha=0.15)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("mean token entropy (nats)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("merge-active: entropy per step, mean over seeds (in brackets) with its 95% band", fontsize=10)
    fig.tight_layout()
    runfolder.save_figure(fig, path, dpi=100)  # never through a link planted at its name
    plt.close(fig)
    return path


def blocks_note(study: dict) -> str:
    """Which warm start and CPU each block's runs had."""
    parts = []
    for letter, sha in study["_blocks"].items():
        runs = [r for runs in finished(study).values() for s, r in runs.items() if block_of(s) == letter]
        cpus = sorted({h.get("cpu", "?") for r in runs for h in r.get("hardware") or []})
        grpo = [(s, rule_tests(r)) for s, r in sorted(study.get("grpo", {}).items(), key=lambda kv: seed_order(kv[0]))
                if block_of(s) == letter and r["steps_done"] >= 100]
        rule = ", ".join(f"seed {s} ({100 * t['share']:.2f}% outside, avg@8 {pct(t['start'])} -> {pct(t['end'])}, "
                         f"worst {pct(t['worst'])}: "
                         + ("passes)" if t["passes"] else "fails " + " and ".join(
                             test for test in ("binds", "learns", "stable") if not t[test]) + ")")
                         for s, t in grpo)
        parts.append(f"block {letter}: warm start `{sha}`, {len(runs)} finished runs, CPU {', '.join(cpus) or 'n/a'}; "
                     f"GRPO against stage 1's rule over steps 1-100 (described, not a gate): {rule or 'n/a'}")
    return para("Runs pair within a block (the same seed and warm start; seeds of block B onwards carry its letter); "
                "the pairs of all blocks form one sample (docs/study-protocol-active.md, amendment of 2026-11-26). "
                + "; ".join(parts) + ".")


def finished(study: dict, steps: int = 200) -> dict:
    """The arms' runs that reached `steps` (study_json.finished), the regime grid's left out."""
    return {name: runs for name, runs in study_json.finished(study, steps).items() if name not in REGIME_GRID}


def report(json_path: str = JSON, figures: str = FIGURES) -> None:
    """Every table of the second study, and its figure, from its JSON (tools/study.py calls this for merge-active)."""
    study = merge_blocks([load_study(path) for path in block_paths(json_path)])
    rows, chosen, _ = choose_regime(study)
    size = sizing(study, chosen)
    arms = finished(study)
    running = sorted(f"{name} seed {s} ({r['steps_done']} steps)" for name, runs in configurations(study).items()
                     if name not in REGIME_GRID for s, r in runs.items() if r["steps_done"] < 200)
    os.makedirs(figures, exist_ok=True)
    texts = {"regime.md": regime_report(study), "sizing.md": sizing_report(size, chosen), "arms.md": arms_report(arms),
             "verdicts.md": verdicts_report(arms) + "\n\n" + blocks_note(study) +
             (f"\n\nNot finished (left out above): {', '.join(running)}." if running else "")}
    for file, text in texts.items():  # never through a link
        runfolder.write_text_atomically(os.path.join(figures, file), text + "\n")
    runfolder.write_text_atomically(os.path.join(figures, "readings.json"), json.dumps(
        {"grid": rows, "chosen": chosen and chosen["name"], "sizing": size, "claims": claims(arms)}, indent=1))
    figure = draw_entropy(arms, os.path.join(figures, "entropy.png"))
    print("\n\n".join(texts.values()))
    print(f"[study_active] written to {figures}" + (f" (and {os.path.basename(figure)})" if figure else ""))


OUTPUTS = ("regime.md", "sizing.md", "arms.md", "verdicts.md", "readings.json", "entropy.png")  # what report writes


def main():
    """The command line: every bad input one line and exit code 2, before anything is read whole or written."""
    parser = cli.Parser("study_active.py", description=__doc__)
    parser.add_argument("--json", default=JSON, help="the study's JSON (block A; the further blocks' JSONs beside it, "
                        "<name>-b.json or <name>-b.json.gz, ..., are read with it)")
    parser.add_argument("--figures", default=FIGURES, help="where the tables and the figure go")
    args = parser.parse_args()
    json_path, figures = os.path.expanduser(args.json), os.path.expanduser(args.figures)
    problem = cli.input_problem(json_path, "--json")
    for i, path in enumerate(block_paths(json_path)):
        problem = problem or study_problem(path, "--json" if i == 0 else f"--json's block {block_letter(path)}")
    problem = problem or cli.folder_problem(figures, "--figures") or cli.outputs_problem(figures, OUTPUTS, "--figures")
    if problem:
        parser.error(problem)
    cli.guard("study_active.py", report, json_path, figures, refused=(ImpossibleInput,))


if __name__ == "__main__":
    main()
