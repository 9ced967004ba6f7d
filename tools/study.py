"""The long-run study: each configuration trained with a preset for several seeds; then every run's per-step numbers
(every metric it logged) in one JSON, a Table-1 analog with 95% intervals (paired against GRPO, seed by seed), and
the paper's figures.

    python -m tools.study --preset tiny --steps 50                 # the original CPU study on the arithmetic task
    python -m tools.study --preset sums --steps 150                # the study on the longer-response task (README)
    python -m tools.study --preset tiny --plot-only                # collect, tabulate and draw what has run so far
    python -m tools.study --preset merge --steps 200 --plot-only   # the report of the merge study from its JSON
    python -m tools.study --preset sums --steps 150 --parallel 18  # a machine with many cores (or a GPU): runs at once

Any flag that is not study.py's own is a train.py flag, passed to every run (and part of the run's identity: a
resumed run must be given the same ones).

study.py owns each run's --seed, --max-steps, --output-dir and --save-every (from --seeds, --steps, --root); passing
one of them through is an error (exit 2), as is a bad --seeds, --steps or config name, before any run starts.

Runs go to runs/study/<preset>/<config>-s<seed>/ and keep checkpoints, so an interrupted study resumes: a finished
run is skipped, an unfinished one continues from its last checkpoint (train.py --resume), exactly, or from step 0
when it has none (its earlier rows then go to metrics.discarded.jsonl, so step 0 is logged once). Each run's
hardware.jsonl says which machine ran which steps: a segment is noted when it starts (beside the run folder) and
recorded when it ends, so a segment whose study was killed is kept too, marked interrupted. A study may run in parts
and on several machines: the JSON (docs/figures/study-<preset>.json.gz, gzip'd by its name, {config: {seed:
{start_acc, final_acc, best_acc, ..., steps: [...]}}}) is updated with the runs found, never emptied, so results
accumulate (--json X.json updates X.json.gz where only that exists: study_json.stored); a run whose
metrics.jsonl is missing or ends before its newest checkpoint is refused with a line and leaves its record as it was.
Table, figures, what the study could detect (detectability.md), the planned evaluations a run lacks, and the verdict
on each of the paper's claims, read by the rules of docs/study-protocol.md (verdicts.md), go to
docs/figures/study-<preset>/.
"""

import concurrent.futures
import json
import math
import os
import queue
import stat
import subprocess
import sys
import time

from cegppo_utils import cli, runfolder
from cegppo_utils.data import UserError
from tools import study_active, study_json
from tools.configs import CONFIGS, STUDY_DEFAULT
from tools.stats import ImpossibleInput, holm, logit_mean_ci, mean_ci, min_detectable, paired_power, t_test_p
from tools.study_json import ROOT, SUPERSEDED, WARM_START, configurations, dedupe_steps, load_study, para, study_problem  # noqa: F401

# The flags study.py sets for every run (from --seeds, --steps, --root and the save cadence): never passed through.
OWNED = {"--seed": "--seeds", "--max-steps": "--steps", "--output-dir": "--root", "--save-every": None}


def refusal(out: str, rows: list[dict] | None = None, resuming: bool = False) -> str | None:
    """Why a run folder's metrics cannot be recorded (None if they can): its metrics.jsonl is missing or empty, ends
    before its newest checkpoint (or before the final step, once final/ is written), or lacks a step in between.
    resuming: before train.py --resume, which restores the row of a run stopped between its checkpoint and that
    step's row (runfolder.restore_row), so a log ending one step before the checkpoint is not refused then."""
    from cegppo_utils import runfolder as RF
    if rows is None:
        rows = dedupe_steps(RF.read_jsonl(os.path.join(out, "metrics.jsonl")))
    found = RF.checkpoint_dirs(out)
    reached = RF.step_of(found[-1]) if found else 0
    if os.path.exists(os.path.join(out, "final", "config.json")):  # a finished run: its metrics must reach max_steps
        steps = _config(out).get("flags", {}).get("max_steps")
        reached = max(reached, steps) if isinstance(steps, int) and not isinstance(steps, bool) else reached
    logged = {r["step"] for r in rows}
    last = max(logged, default=None)
    if last is None:
        return f"metrics.jsonl is missing or empty, but the run reached step {reached}" if reached else None
    if last < reached and not (resuming and last == reached - 1):
        return f"metrics.jsonl ends at step {last}, but the run reached step {reached}"
    lacking = [s for s in range(1, last + 1) if s not in logged]
    if lacking:
        return f"metrics.jsonl lacks {len(lacking)} step(s) between 1 and {last} (the first: {lacking[0]})"
    return None


def folder_refusal(out: str) -> str | None:
    """What train.py refuses in a run folder it would resume (a symbolic link, a FIFO where the run keeps a file), found
    before any run starts: the study writes into it too (its hardware.jsonl), by the same rule (None if nothing)."""
    try:
        runfolder.check_output_folder(out, resume=_is_run(out))
    except UserError as e:
        return str(e)
    return None


def prepare_resume(out: str, log=print) -> tuple[int, int | None]:
    """Before (re)starting a run: (the step it trains from, its last logged step or None). A resume with no checkpoint
    starts again from step 0: its earlier rows go to metrics.discarded.jsonl here, so that train.py's step-0
    evaluation is logged once (train.py --resume keeps rows up to step 0 and would log step 0 a second time)."""
    from cegppo_utils import runfolder as RF
    metrics = os.path.join(out, "metrics.jsonl")
    rows = RF.read_jsonl(metrics)
    logged = max((r["step"] for r in rows if isinstance(r.get("step"), int)), default=None)
    found = RF.checkpoint_dirs(out)
    if found:
        return RF.step_of(found[-1]), logged
    if rows:
        RF.keep_rows_up_to(metrics, -1, log)
    return 0, logged


def pending_segment(out: str) -> str:
    """Where the segment now running is noted: beside the run folder, not in it (the folder is train.py's to create;
    a run writes only into a new or empty folder, or its own)."""
    return os.path.normpath(out) + ".segment.json"


def _is_run(out: str) -> bool:
    return runfolder.holds_run(out)  # the one rule train.py's --resume follows


def _append_segment(out: str, segment: dict) -> None:
    """A segment appended to the run's hardware.jsonl by train.py's rule: never through a link planted there (a
    UserError says so, as train.py refuses the folder), never to a FIFO."""
    runfolder.append_line(os.path.join(out, "hardware.jsonl"), json.dumps(segment))


def _read_segment(path: str) -> dict | None:
    """The noted segment at path; None where there is none, or no regular file holding a JSON object (a FIFO would
    block the read, a link is not the study's)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        return runfolder.read_json_object(path)  # the one reader: a file swapped for a FIFO is refused, not opened
    except (OSError, UserError):
        return None


def settle_segment(out: str, to_step) -> None:
    """A noted segment that was never completed (its study was killed) goes into the run's hardware.jsonl, marked
    interrupted and ending at `to_step` (the last step logged before the next segment); none is kept for a folder
    that never became a run (nothing was trained)."""
    path = pending_segment(out)
    if not os.path.lexists(path):
        return
    segment = _read_segment(path)
    if segment is not None and _is_run(out):
        _append_segment(out, {**segment, "to_step": to_step, "seconds": None, "exit_code": None, "interrupted": True})
    os.remove(path)


def open_segment(out: str, threads: int, from_step: int, logged_before) -> None:
    """Note a run segment as it starts (which machine, from which step), so that a study killed mid-run still leaves
    a record of it: close_segment completes it into the run's hardware.jsonl; one never completed is settled there,
    as interrupted, when the run next starts (and shown so by hardware_segments until then)."""
    from tools.bench import cpu_model
    settle_segment(out, logged_before)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    runfolder.write_json_atomically(pending_segment(out), {  # never through a link planted at its name
        "cpu": cpu_model(), "threads": threads, "from_step": from_step, "logged_before": logged_before,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def close_segment(out: str, to_step, seconds: float, exit_code) -> None:
    """Complete the noted segment into the run's hardware.jsonl: where it ended, its time and exit code."""
    path = pending_segment(out)
    if not os.path.lexists(path):
        return
    segment = _read_segment(path)
    if segment is not None and _is_run(out):
        _append_segment(out, {**segment, "to_step": to_step, "seconds": round(seconds, 1), "exit_code": exit_code})
    os.remove(path)


def hardware_segments(out: str, rows: list[dict]) -> list[dict]:
    """Every segment of a run, in order: its hardware.jsonl, and a noted segment not yet completed (its study was
    killed), shown as interrupted at the log's last step."""
    from cegppo_utils import runfolder as RF
    segments = RF.read_jsonl(os.path.join(out, "hardware.jsonl"), step=False)
    pending = _read_segment(pending_segment(out))
    if pending is not None:
        segments.append({**pending, "to_step": rows[-1]["step"] if rows else None, "interrupted": True})
    return segments


def core_groups(parallel: int) -> list[list[int]]:
    """The cores this process may use (its affinity: `taskset -c 1 python -m tools.study` keeps the study on core 1), in
    `parallel` disjoint groups, one per run at once. Each run is pinned to its group with one torch thread per core:
    two torch processes spinning threads on the same cores slow each other many times over, and a run's numbers
    depend on its thread count, which the run's hardware.jsonl records."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < parallel:
        raise UserError(f"--parallel {parallel} needs as many cores; this process may use {len(cores)}")
    size = len(cores) // parallel
    return [cores[i * size:(i + 1) * size] for i in range(parallel)]


def run_one(preset, name, seed, steps, out, extra, cores=None):
    """Train one configuration and seed to `steps`, resuming it if a checkpoint exists, pinned to `cores` (default:
    all this process may use) with one torch thread each; returns seconds taken."""
    cores = cores or sorted(os.sched_getaffinity(0))
    from cegppo_utils import runfolder as RF
    done = dedupe_steps(RF.read_jsonl(os.path.join(out, "metrics.jsonl")))
    if os.path.exists(os.path.join(out, "final", "config.json")) and done and done[-1]["step"] >= steps:
        print(f"[study] {name} seed {seed}: done already", flush=True)
        return 0.0
    why = refusal(out, done, resuming=True) if os.path.isdir(out) else None
    if why:
        raise RuntimeError(f"[study] {name} seed {seed}: refused ({out}): {why}")
    flags = ["--preset", preset, *CONFIGS[name], "--seed", str(seed), "--max-steps", str(steps),
             "--save-every", str(max(1, min(25, steps))), "--output-dir", out, *extra]
    first, logged = 0, None
    if _is_run(out):
        flags.append("--resume")  # from its last checkpoint, or from step 0 if it died before the first
        first, logged = prepare_resume(out, log=lambda line: print(f"[study] {name} seed {seed}: {line}", flush=True))
    open_segment(out, len(cores), first, logged)  # which machine runs which steps, kept even if this process is killed
    start, code = time.time(), None
    print(f"[study] {name} seed {seed} ...", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cores))}
    try:
        run = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *flags], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: os.sched_setaffinity(0, cores))  # the engine binds to these too
        code = run.returncode
    finally:
        rows = dedupe_steps(RF.read_jsonl(os.path.join(out, "metrics.jsonl")))
        close_segment(out, rows[-1]["step"] if rows else 0, time.time() - start, code)
    if run.returncode:
        raise RuntimeError(f"[study] {name} seed {seed} failed:\n{run.stderr[-3000:]}")
    print(f"[study] {name} seed {seed}: {time.time() - start:.0f}s", flush=True)
    return time.time() - start


# --- what the runs say ----------------------------------------------------------------------------

# What the tables and verdicts read of every run's record (run_record writes them all).
RECORD = ("steps_done", "start_acc", "final_acc", "best_acc", "entropy_first10", "entropy_last10", "steps")


def run_record(out: str) -> dict | None:
    """One run's summary and per-step numbers, from its run folder (None if it logged nothing)."""
    from cegppo_utils import runfolder as RF
    from cegppo_utils.plot import window_mean
    rows = dedupe_steps(RF.read_jsonl(os.path.join(out, "metrics.jsonl")))
    steps = [r for r in rows if "reward_mean" in r]
    if not steps:
        return None
    evals = [(r["step"], r["eval_acc"]) for r in rows if "eval_acc" in r]
    trained = [(s, a) for s, a in evals if s > 0]
    best = max(trained, key=lambda e: e[1]) if trained else (None, None)
    return {"steps_done": steps[-1]["step"], "start_acc": next((a for s, a in evals if s == 0), None),
            "final_acc": trained[-1][1] if trained else None, "final_step": trained[-1][0] if trained else None,
            "best_acc": best[1], "best_step": best[0],
            "entropy_first10": window_mean(rows, "entropy", True),
            "entropy_last10": window_mean(rows, "entropy", False),
            "reward_first10": window_mean(rows, "reward_mean", True),
            "reward_last10": window_mean(rows, "reward_mean", False),
            "hardware": hardware_segments(out, rows), "model_sha256": _config(out).get("model_sha256"),
            "steps": rows}  # every number each step logged (metrics.jsonl, one row per step)


def _config(out: str) -> dict:
    """A run folder's config.json ({} where it has none; a damaged one, or a FIFO there, is a UserError: the one
    reader of a run's files, runfolder.read_run_record)."""
    path = os.path.join(out, "config.json")
    return runfolder.read_run_record(path) if os.path.lexists(path) else {}


def check_warm_start(study: dict, model_path: str, json_path: str) -> str | None:
    """The runs of a study pair only if they start from the same weights: a cached warm start whose hash differs from
    the one the study recorded stops the study before any run (SystemExit, one line). Returns the hash."""
    from cegppo_utils import models
    have = models.weights_hash(model_path)
    want = study.get(WARM_START, {}).get("sha256")
    if want and have != want:
        sys.exit(f"study.py: error: the warm start {model_path} has weights hash {have}, but the runs of {json_path} "
                 f"started from {want} ({study[WARM_START].get('machine', 'machine unknown')}); its runs would not "
                 "pair with them. The warm start is deterministic on one machine type but not across CPU instruction "
                 "sets: run the study where it was built, or start a new one with --json")
    return have


def collect(path: str, root: str, names, seeds, log=print, warm_start: str | None = None) -> dict:
    """The study's JSON at `path`, updated with every run found under root (runs not found are left as they were).
    A run folder whose metrics are refused (see refusal), or hold fewer steps than the run's record, is not recorded:
    a line says so and the record stays. The file is rewritten only when a record changed. warm_start: the hash of
    the weights the runs started from, recorded where the study has none yet."""
    study = load_study(path)
    changed = not os.path.exists(path)
    if warm_start and WARM_START not in study:
        study[WARM_START], changed = {"sha256": warm_start}, True
    for name in names:
        for seed in seeds:
            out = os.path.join(root, f"{name}-s{seed}")
            if not os.path.isdir(out):
                continue
            why = refusal(out)
            record = None if why else study_json.compact(run_record(out))  # as stored: unchanged runs stay unwritten
            old = study.get(name, {}).get(str(seed))
            if record and old and record["steps_done"] < old.get("steps_done", 0):
                why = f"it has {record['steps_done']} steps, the study's record {old['steps_done']}"
            if why:
                log(f"[study] {name} seed {seed}: not recorded ({out}): {why}")
                continue
            if record and record != old:
                study.setdefault(name, {})[str(seed)] = record
                changed = True
    if changed:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # never through a link planted at a fixed name; floats at float32's digits (study_json.compact)
        runfolder.write_text_atomically(path, json.dumps(study_json.compact(study)))
    return study


def planned_evaluations(steps_done: int, every: int, before_train: bool) -> list[int]:
    """The steps a run of `steps_done` steps evaluates at: 0 (with an evaluation before training), every `every`
    steps, and the last step."""
    planned = [0] if before_train else []
    if every:
        planned += list(range(every, steps_done + 1, every))
        if steps_done % every:
            planned.append(steps_done)
    return planned


def missing_evaluations(study: dict, every: int, before_train: bool) -> list[str]:
    """Each run's planned evaluations that have no eval_acc, as 'config seed s: step N, ...'."""
    out = []
    for name, runs in study.items():
        for seed, run in sorted(runs.items(), key=lambda kv: int(kv[0])):
            have = {r["step"] for r in run.get("steps", []) if r.get("eval_acc") is not None}
            lost = [s for s in planned_evaluations(run["steps_done"], every, before_train) if s not in have]
            if lost:
                out.append(f"{name} seed {seed}: step {', '.join(map(str, lost))}")
    return out


def seed_list(seeds) -> str:
    """'0-4' for consecutive seeds, else '0, 2, 3'."""
    seeds = sorted(int(s) for s in seeds)
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds))


def chance_of_at_least(k: int, n: int, p: float = 0.05) -> float:
    """P(at least k of n independent tests at level p reject) when no null hypothesis is false."""
    return 1 - sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k))


def table1(study: dict, baseline: str = "grpo", primary=STUDY_DEFAULT) -> str:
    """The Table-1 analog: held-out avg@k at the start, the end and the best step (mean [95% CI] over seeds, the
    interval on the logit scale so that it stays within 0-100%), and the final paired difference against the
    baseline on the seeds both have (mean [95% t-interval]); the seeds each row averages, with any cell that averages
    fewer named in it. Below the table: how to read its intervals, and the multiple-comparison arithmetic over the
    paired column (`primary`: the protocol's configurations, the family the claims draw on)."""
    def cell(values, seeds, row_seeds, paired=False, scale=100.0):
        values, seeds = zip(*[(v, s) for v, s in zip(values, seeds) if v is not None]) if any(
            v is not None for v in values) else ((), ())
        if not values:
            return "n/a"
        def num(x):  # one decimal, or two where one would round a nonzero end to 0.0 and hide its side
            return f"{x:.2f}" if x and round(x, 1) == 0 else f"{x:.1f}"
        if len(values) > 1:
            mean, (lo, hi) = (mean_ci if paired else logit_mean_ci)(list(values))
            text = f"{num(scale * mean)} [{num(scale * lo)}, {num(scale * hi)}]"
        else:  # one seed: its value, no interval
            text = num(scale * values[0])
        return text + (f" (seeds {seed_list(seeds)})" if list(seeds) != list(row_seeds) else "")

    lines = [f"| config | seeds | steps | start | final avg@k | best avg@k | final - {baseline} (paired) | "
             "entropy, first 10 -> last 10 steps | which seeds |", "|---|---|---|---|---|---|---|---|---|"]
    base = study.get(baseline, {})
    tests = {}  # name: its paired differences from the baseline
    for name, runs in study.items():
        seeds = sorted(runs, key=int)
        both = [s for s in seeds
                if s in base and runs[s]["final_acc"] is not None and base[s].get("final_acc") is not None]
        pairs = [runs[s]["final_acc"] - base[s]["final_acc"] for s in both]
        if name != baseline and len(pairs) > 1:
            tests[name] = pairs
        first = [runs[s]["entropy_first10"] for s in seeds]
        last = [runs[s]["entropy_last10"] for s in seeds]
        entropy = f"{sum(first) / len(first):.3f} -> {sum(last) / len(last):.3f}" if None not in first + last else "n/a"
        lines.append(f"| {name} | {len(seeds)} | {min(runs[s]['steps_done'] for s in seeds)} | "
                     f"{cell([runs[s]['start_acc'] for s in seeds], seeds, seeds)} | "
                     f"{cell([runs[s]['final_acc'] for s in seeds], seeds, seeds)} | "
                     f"{cell([runs[s]['best_acc'] for s in seeds], seeds, seeds)} | "
                     f"{cell(pairs, both, seeds, paired=True) if name != baseline else '-'} | {entropy} | "
                     f"{seed_list(seeds)} |")
    lines += ["", para("Start, final and best: mean over seeds [95% t-interval on the logit scale, mapped back: it "
                       "cannot pass 0 or 100%]. The paired column: mean [95% t-interval] of the per-seed differences.")]
    if tests:
        family = [n for n in tests if n in primary]
        among = " among the protocol's configurations" if family else ""
        family = family or list(tests)
        p = {n: t_test_p(tests[n]) for n in family}
        off = [n for n in family if p[n] < 0.05]
        kept = [n for n, r in zip(family, holm([p[n] for n in family])) if r]
        k = len(family)
        lines += ["", para(f"Multiple comparisons: the paired column holds {k} comparisons with {baseline}{among}"
                  f"{f' ({len(tests)} with the others)' if len(tests) > k else ''}, none corrected. If no "
                  f"configuration differed from {baseline}, {0.05 * k:.2f} of those {k} intervals would exclude 0 by "
                  f"chance on average, and at least 2 would with probability {chance_of_at_least(2, k):.2f} (treating "
                  f"them as independent; they share {baseline}'s seeds). Excluding 0: "
                  f"{', '.join(f'{n} (p = {p[n]:.3f}, {len(tests[n]) - 1} degrees of freedom)' for n in off) or 'none'}"
                  f"; after Holm's correction over the {k}: {', '.join(kept) or 'none'}.")]
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
    values = [r["entropy"] for r in run["steps"]
              if lo * T < r.get("step", 0) <= hi * T and r.get("entropy") is not None]
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
        finals = [study[name][s]["final_acc"] for s in seeds
                  if s in study.get(name, {}) and study[name][s].get("final_acc") is not None]
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
    ("2: (1, 0.5) lowers accuracy", "(1, 0.5) - (0.5, 1), final avg@k", "ce_gppo_1_0.5", "ce_gppo_0.5_1", final,
     "below"),
    ("2: (0.5, 1) keeps entropy stable", "(0.5, 1): last-10 - first-10 entropy", "ce_gppo_0.5_1", None, entropy_change,
     "not below"),
    *[("3: CE-GPPO (0.5, 1) ends above " + b, f"(0.5, 1) - {b}, final avg@k", "ce_gppo_0.5_1", b, final, "above")
      for b in ("grpo", "dapo", "cispo", "gspo", "entropy_0.001", "entropy_0.003")],
    ("4: an entropy bonus of 0.001 does not stop the fall", "entropy_0.001: last-10 - first-10 entropy",
     "entropy_0.001", None, entropy_change, "below"),
    *[(f"5: {n} keeps entropy higher than GRPO", f"{n} - grpo, last-10 entropy", n, "grpo", last10, "above")
      for n in ("grpo_dyn_id", "grpo_dyn_did", "grpo_dyn_od")],
    *[(f"5: {n} without losing accuracy", f"{n} - grpo, final avg@k", n, "grpo", final, "not below")
      for n in ("grpo_dyn_id", "grpo_dyn_did", "grpo_dyn_od")],
]
# What the reader of a rule must know beside its verdict: where it is not the protocol's own rule (added after the
# protocol was fixed; docs/study-protocol.md lists these in its dated amendment), or does not test what it names.
NOTES = {
    "(1, 0.5) - (0.5, 1)": "changes both betas at once (beta1 0.5 -> 1 and beta2 1 -> 0.5), so it does not isolate "
                           "beta1",
    "(1, 0.5) - (0.5, 1), final avg@k": "added: the protocol names no comparator for 'lowers accuracy'",
    "entropy_0.001: last-10 - first-10 entropy": "added: the protocol states no rule for 'does not stop the fall'; it "
                                                 "holds trivially, as entropy falls under every configuration",
    "(0.5, 1): last-10 - first-10 entropy": "an absolute rule: where entropy falls under every configuration, GRPO's "
                                            "included, it does not tell (0.5, 1) apart; docs/cpu-reproduction.md reads "
                                            "the change against GRPO's",
    "explodes": "one step of a bonus this small moves entropy by about 1e-4 nats on these tasks, so an explosion was "
                "out of reach: not a test of the paper's observation",
}
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
    return all(windows[x] is not None and windows[y] is not None
               and (windows[x] > windows[y] if op == ">" else windows[x] < windows[y])
               for x, op, y in checks)


def od_switches(run) -> int:
    states = [r["od_state"] for r in run["steps"] if r.get("od_state") is not None]
    return sum(a != b for a, b in zip(states, states[1:]))


def rule_rows(study: dict, rules) -> list[str]:
    """One verdicts.md row per rule (claim, what, a, b, key, want): a - b paired by seed, or a alone over its seeds."""
    def cell(result, scale):
        if result is None:
            return "n/a", "-"
        n, mean, (lo, hi) = result
        return (f"{scale * mean:+.{1 if scale == 100 else 4}f} [{scale * lo:+.{1 if scale == 100 else 4}f}, "
                f"{scale * hi:+.{1 if scale == 100 else 4}f}]", str(n))

    out = []
    for claim, what, a, b, key, want in rules:
        result = paired(study, a, b, key) if b else over_seeds(study, a, key)
        text, n = cell(result, 100 if key is final else 1)
        note = f" ({NOTES[what]})" if what in NOTES else ""
        verdict = judge(result, want)
        if key is final and verdict == "holds" and want == "not below":  # an interval that admits a loss
            verdict = "no loss detected, none excluded"
        out.append(f"| {claim}{note} | {what} | {n} | {text} | {want} 0 | **{verdict}** |")
    return out


def shape_rows(study: dict) -> list[str]:
    """The verdicts.md rows read from the shape of the entropy curves, not from a paired interval: the bonus of 0.003
    explodes, each dynamic-clip schedule follows its designed trajectory, grpo_dyn_od oscillates."""
    lines = []
    runs = study.get("entropy_0.003", {}).values()
    first = [r["entropy_first10"] for r in runs if r.get("entropy_first10") is not None]
    last = [r["entropy_last10"] for r in runs if r.get("entropy_last10") is not None]
    if first and last:
        ratio = (sum(last) / len(last)) / (sum(first) / len(first))
        lines.append(f"| 4: an entropy bonus of 0.003 explodes ({NOTES['explodes']}) | entropy_0.003: mean last-10 / "
                     f"first-10 entropy | {len(last)} | {ratio:.2f} | > 1.5 | "
                     f"**{'holds' if ratio > 1.5 else 'not seen'}** |")
    for name, checks in TRAJECTORIES.items():
        runs = list(study.get(name, {}).values())
        if not runs:
            continue
        each = [{w: window_entropy(r, *W[w]) for w in W} for r in runs]
        mean = {w: None if any(e[w] is None for e in each) else sum(e[w] for e in each) / len(each) for w in W}
        per_run = sum(follows(e, checks) for e in each)
        shape = ", ".join(f"{w} {mean[w]:.4f}" for w in W if mean[w] is not None)
        lines.append(f"| 5: {name} follows its designed trajectory | seed-mean entropy of steps {shape} | "
                     f"{len(runs)} | {per_run} of {len(runs)} runs alone | "
                     f"{'; '.join(f'{x} {op} {y}' for x, op, y in checks)} | "
                     f"**{'holds' if follows(mean, checks) else 'shape not seen'}** |")
    od = list(study.get("grpo_dyn_od", {}).values())
    if od:
        switches = [od_switches(r) for r in od]
        verdict = ("holds" if all(s >= 2 for s in switches) else "does not hold" if any(switches)
                   else "not exercised (it never switched)")
        lines.append(f"| 5: grpo_dyn_od oscillates | switches of od_state per run: {switches} | {len(od)} | "
                     f"{sum(s >= 2 for s in switches)} of {len(od)} runs | >= 2 switches | **{verdict}** |")
    return lines


def verdicts(study: dict, mechanism: dict | None = None) -> str:
    """Every claim's comparison as the protocol reads it, as a markdown page; with the one-step experiment's JSON,
    also whether its signs predict the runs' (step_vs_run)."""
    head = ["| claim | comparison (accuracy in points, entropy in nats/token) | seeds | mean [95% CI] | predicted "
            "| verdict |", "|---|---|---|---|---|---|"]
    lines = ["Paired by seed; 95% t-intervals over seeds; no correction for multiple comparisons. A claim marked "
             "'added' is read by a rule the protocol did not state (docs/study-protocol.md lists them in its amendment "
             "of 2026-11-25).", "", *head, *rule_rows(study, RULES), *shape_rows(study)]
    best = best_dynamic(study)
    lines += ["", f"The best dynamic-clip schedule (highest mean final avg@k over seeds 0-2): "
                  f"{best or 'not yet known'}.",
              "", "Also reported, not part of the protocol's claims:", "", *head, *rule_rows(study, EXPLORATORY)]
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
        lines.append(f"| {name} | {cell(mean, lo, hi)} ({step['n']}) | {cell(run_mean, run_lo, run_hi)} ({n}) | "
                     f"{agree} | {'yes' if resolved else 'no'} |")
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
     ["ppo_clip", "ce_gppo_0_1", "ce_gppo_0.5_1", "ce_gppo_1_0.5", "gppo"],
     ["clip_frac_low_neg", "clip_frac_high_pos"]),
    ("kl.png", "KL(pi_old || pi) per step (k3)", None, ["approx_kl"]),
]


def draw_figures(study: dict, out_dir: str, window: int = 5) -> list[str]:
    """FIGURES, plus dynamic clipping against the same algorithm with fixed clipping; each a mean over seeds
    (shaded: min-max), smoothed over `window` steps (held-out accuracy unsmoothed), at the steps every seed logged
    (a run's missing evaluation leaves its step out of that configuration's curve rather than shifting the rest)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cegppo_utils import plot
    dynamic = [n for n in study if "_dyn_" in n]
    figures = FIGURES + ([("dynamic-clip.png", "dynamic clipping (arXiv 2602.09782) against fixed clipping; dashed: "
                          "T/2, where ID and DID change phase",
                          dynamic + sorted({n.split("_dyn_")[0] for n in dynamic}),
                          ["entropy", "eval_acc"])] if dynamic else [])
    written = []
    for file, title, names, keys in figures:
        names = [n for n in (names or list(study)) if n in study]
        if not names:
            continue
        fig, axes = plt.subplots(1, len(keys), figsize=(6.5 * len(keys), 4), squeeze=False)
        for ax, key in zip(axes[0], keys):
            for c, name in enumerate(names):
                curves = []  # per run, {step: value}: seeds are averaged step by step, at the steps every run logged
                for run in study[name].values():
                    points = [(r["step"], r[key]) for r in dedupe_steps(run["steps"]) if r.get(key) is not None]
                    if points:
                        x, y = zip(*points)
                        curves.append(dict(zip(x, plot.smooth(list(y), 1 if key == "eval_acc" else window))))
                if not curves:
                    continue
                x = sorted(set.intersection(*(set(curve) for curve in curves)))
                ax.plot(x, [sum(curve[t] for curve in curves) / len(curves) for t in x],
                        color=plt.get_cmap("tab10")(c % 10), label=f"{name} ({len(curves)})",
                        marker="o" if key == "eval_acc" else None, linewidth=1.3)
                if len(curves) > 1:
                    ax.fill_between(x, [min(curve[t] for curve in curves) for t in x],
                                    [max(curve[t] for curve in curves) for t in x],
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
        runfolder.save_figure(fig, os.path.join(out_dir, file), dpi=100)  # never through a link at its name
        plt.close(fig)
        written.append(os.path.join(out_dir, file))
    return written


# --- what the study could detect --------------------------------------------------------------------------------

# The paper's Table 1, R1-Distill-Qwen-1.5B, avg@k in %: AIME24, AIME25, HMMT25, MATH500, AMC23.
PAPER_BENCHMARKS = ("AIME24", "AIME25", "HMMT25", "MATH500", "AMC23")
PAPER_TABLE1 = {"grpo": (33.4, 28.1, 16.6, 88.3, 79.3), "dapo": (40.0, 28.4, 19.2, 90.0, 84.4),
                "ce_gppo_0.5_1": (42.0, 33.9, 21.6, 91.0, 85.9)}
REGIONS = ("clip_frac_low_neg", "clip_frac_high_pos", "clip_frac_low_pos", "clip_frac_high_neg")
Z_975, Z_80 = 1.959964, 0.841621  # standard normal quantiles: two-sided 5%, 80% power


def pooled_sd(groups) -> tuple[float, int]:
    """(pooled SD, degrees of freedom) of several samples (each a list of numbers), each weighted by n - 1."""
    dof = sum(len(g) - 1 for g in groups)
    ss = sum(sum((v - sum(g) / len(g)) ** 2 for v in g) for g in groups)
    return (math.sqrt(ss / dof) if dof else math.nan), dof


def paper_gains(study: dict, ours: str = "ce_gppo_0.5_1") -> list[dict]:
    """The paper's 1.5B gains of CE-GPPO (0.5, 1) over GRPO and DAPO, as points on its 5-benchmark average and as the
    relative cut in error rate (of the average, and the mean of the per-benchmark cuts), carried to this task: the
    same cut applied to the baseline's final error here (100 - its mean final avg@k)."""
    out = []
    ce = PAPER_TABLE1[ours]
    for base in ("grpo", "dapo"):
        b = PAPER_TABLE1[base]
        finals = [r["final_acc"] for r in study.get(base, {}).values() if r.get("final_acc") is not None]
        if not finals:
            continue
        error_here = 100 - 100 * sum(finals) / len(finals)
        avg_b, avg_ce = sum(b) / len(b), sum(ce) / len(ce)
        for how, cut in (("cut of the average error", (avg_ce - avg_b) / (100 - avg_b)),
                         ("mean of the per-benchmark cuts", sum((c - x) / (100 - x) for c, x in zip(ce, b)) / len(b))):
            out.append({"baseline": base, "gain": avg_ce - avg_b, "how": how, "cut": cut, "error_here": error_here,
                        "here": cut * error_here})
    return out


def region_fractions(study: dict) -> dict:
    """Per configuration, the share of response tokens (in %, mean over its runs' steps) in each clip region, and
    outside the clip interval (the four summed); also the beta1 and beta2 regions over steps 1-10 alone."""
    out = {}
    for name, runs in study.items():
        rows = [r for run in runs.values() for r in run.get("steps", []) if all(r.get(k) is not None for k in REGIONS)]
        if not rows:
            continue
        mean = {k: 100 * sum(r[k] for r in rows) / len(rows) for k in REGIONS}
        early = [r for r in rows if r["step"] <= 10]
        out[name] = {**mean, "outside": sum(mean.values()),
                     **{f"{k}_first10": 100 * sum(r[k] for r in early) / len(early) for k in REGIONS[:2] if early}}
    return out


def gains_lines(gains: list[dict], main_sd: float) -> list[str]:
    """detectability's section on the paper's gains carried to this task, with their power at the pooled SD."""
    return ["", "**The paper's gains, carried to this task.** The paper's Table 1 (R1-Distill-Qwen-1.5B, avg@k "
            f"on {', '.join(PAPER_BENCHMARKS)}): GRPO {', '.join(map(str, PAPER_TABLE1['grpo']))}; "
            f"DAPO {', '.join(map(str, PAPER_TABLE1['dapo']))}; CE-GPPO (0.5, 1) "
            f"{', '.join(map(str, PAPER_TABLE1['ce_gppo_0.5_1']))}. "
            "Taken as the same relative cut in error rate, applied to the baseline's final error here:", "",
            f"| CE-GPPO (0.5, 1) over | paper: gain in points (mean of 5) | read as | cut in error | "
            f"error here | gain here (points) | power, 3 / 5 seeds (SD {main_sd:.2f}) | seeds for 80% power |",
            "|---|---|---|---|---|---|---|---|",
            *[f"| {g['baseline']} | +{g['gain']:.2f} | {g['how']} | {100 * g['cut']:.1f}% | "
              f"{g['error_here']:.1f} | +{g['here']:.2f} | {100 * g['power'][3]:.0f}% / "
              f"{100 * g['power'][5]:.0f}% | about {g['seeds_needed']} |"
              for g in gains]]


def regions_lines(regions: dict) -> list[str]:
    """detectability's section on where the betas act: each configuration's token shares of the clip regions."""
    lines = ["", "**Where the betas act.** Share of response tokens per step (%, mean over the run's steps and "
             "seeds) in CE-GPPO's beta1 region (ratio below 1 - eps, A < 0: `clip_frac_low_neg`), its beta2 "
             "region (above 1 + eps, A > 0: `clip_frac_high_pos`), and outside the clip interval at all (the four "
             "regions summed); each counted against the objective's own interval:", "",
             "| config | beta1 region | beta2 region | outside the interval | beta1 / beta2 region, steps 1-10 |",
             "|---|---|---|---|---|",
             *[f"| {n} | {r['clip_frac_low_neg']:.3f} | {r['clip_frac_high_pos']:.3f} | {r['outside']:.3f} | "
               f"{r.get('clip_frac_low_neg_first10', math.nan):.3f} / "
               f"{r.get('clip_frac_high_pos_first10', math.nan):.3f} |"
               for n, r in regions.items()]]
    notes = {"gspo": "GSPO's interval is on its sequence-level ratio (eps 3e-4 / 4e-4), so its regions count "
                     "whole responses", "cispo": "CISPO has no lower bound (eps_low 1.0), so nothing is below it"}
    lines += ["", "; ".join(text for name, text in notes.items() if name in regions) + "."] if any(
        n in regions for n in notes) else []
    return lines


def detectability(study: dict, baseline: str = "grpo", primary=STUDY_DEFAULT,
                  seed_counts=range(2, 11)) -> tuple[str, dict]:
    """What the study could detect, as markdown, and the numbers behind its figure: the SD of the final paired
    differences against the baseline (pooled over the comparisons with 5 seeds, over all of the protocol's, and
    over those with 3), the minimum detectable difference at 80% power (two-sided paired t-test at 5%) per seed
    count, the paper's gains carried to this task with their power, and per configuration the token shares of the
    clip regions over the run."""
    base = study.get(baseline, {})
    diffs = {}
    for name in study:
        if name == baseline or name not in primary:
            continue
        pairs = [100 * (run["final_acc"] - base[s]["final_acc"]) for s, run in study[name].items()
                 if s in base and run.get("final_acc") is not None and base[s].get("final_acc") is not None]
        if len(pairs) > 1:
            diffs[name] = pairs
    if not diffs:
        return "", {}
    counts = sorted({len(v) for v in diffs.values()}, reverse=True)
    sds = [(f"the {sum(len(v) == n for v in diffs.values())} with {n} seeds",
            *pooled_sd([v for v in diffs.values() if len(v) == n]))
           for n in counts]
    sds.insert(1 if len(counts) > 1 else 0, (f"all {len(diffs)} of the protocol's", *pooled_sd(list(diffs.values()))))
    sds = sds if len(counts) > 1 else sds[:1]
    main_sd = next(sd for label, sd, _ in sds if label.startswith("all"))
    mde = {n: [min_detectable(sd, n) for _, sd, _ in sds] for n in seed_counts}
    gains = paper_gains(study)
    for g in gains:
        g["power"] = {n: paired_power(g["here"], main_sd, n) for n in (3, 5)}
        g["seeds_needed"] = math.ceil(((Z_975 + Z_80) * main_sd / g["here"]) ** 2) + 1 if g["here"] > 0 else None
    regions = region_fractions(study)

    lines = [f"Final avg@k, each configuration minus {baseline} on the same seed, in points.", "",
             f"**The noise.** The per-seed differences from {baseline} scatter with these SDs (pooled, each comparison "
             "weighted by its degrees of freedom):", "",
             "| comparisons | pooled SD of the paired differences | degrees of freedom |",
             "|---|---|---|", *[f"| {label} | {sd:.2f} | {dof} |" for label, sd, dof in sds], "",
             "Per comparison: " + ", ".join(f"{n} {pooled_sd([v])[0]:.2f} ({len(v)})" for n, v in diffs.items()) + ".",
             "",
             "**The smallest true difference found with 80% power** (two-sided paired t-test at 5%, per number of "
             "seeds):",
             "", "| seeds | " + " | ".join(f"SD {sd:.2f}" for _, sd, _ in sds) + " |", "|---" * (len(sds) + 1) + "|",
             *[f"| {n} | " + " | ".join(f"{m:.1f}" for m in mde[n]) + " |" for n in seed_counts]]
    if gains:
        lines += gains_lines(gains, main_sd)
    if regions:
        lines += regions_lines(regions)
    if gains and 5 in mde:
        here = [g["here"] for g in gains]
        power5 = [g["power"][5] for g in gains]
        lines += ["", f"**In short:** with 5 seeds a true difference of {min(mde[5]):.1f}-{max(mde[5]):.1f} points is "
                  f"found 4 times in 5; the paper's gains, carried to this task, are {min(here):.2f}-{max(here):.2f} "
                  f"points and would be found {100 * min(power5):.0f}-{100 * max(power5):.0f}% of the time. A null "
                  "result here was expected whether or not the paper is right."]
    data = {"sds": sds, "main_sd": main_sd, "mde": mde, "gains": gains, "regions": regions}
    return "\n".join(line if line.startswith("|") else para(line) for line in lines), data


def draw_detectability(data: dict, path: str) -> str | None:
    """Power against the true difference (3, 5 and 10 seeds), the minimum detectable difference per seed count, and
    the clip regions' token shares per configuration, with the paper's gains carried to this task marked."""
    if not data:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.6))
    sd, here = data["main_sd"], [g["here"] for g in data["gains"]]
    ax = axes[0]
    deltas = [0.1 * i for i in range(0, 101)]
    for n, c in ((3, "C0"), (5, "C1"), (10, "C2")):
        ax.plot(deltas, [paired_power(d, sd, n) for d in deltas], color=c, label=f"{n} seeds")
    ax.axhline(0.8, color="k", linestyle=":", linewidth=0.8)
    if here:
        ax.axvspan(min(here), max(here), color="C3", alpha=0.25, label="the paper's gains, carried here")
    ax.set(xlabel="true difference in final avg@8 (points)", ylabel="power (paired t-test, two-sided 5%)",
           title=f"power at the pooled paired SD {sd:.2f}", ylim=(0, 1))
    ax.legend(fontsize=8)
    ax = axes[1]
    ns = sorted(data["mde"])
    for i, (label, s, _) in enumerate(data["sds"]):
        ax.plot(ns, [data["mde"][n][i] for n in ns], marker="o", label=f"SD {s:.2f}: {label}")
    if here:
        ax.axhspan(min(here), max(here), color="C3", alpha=0.25, label="the paper's gains, carried here")
    ax.set_yscale("log")
    ax.set(xlabel="seeds", ylabel="points (log scale)", title="smallest difference found with 80% power")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax = axes[2]
    regions = {n: r for n, r in data["regions"].items() if r["outside"] < 5}  # GSPO's sequence-level interval is apart
    names = list(regions)[::-1]
    left = [0.0] * len(names)
    for key, label in ((REGIONS[0], "beta1 region"), (REGIONS[1], "beta2 region"), (REGIONS[2], "below, A > 0"),
                       (REGIONS[3], "above, A < 0")):
        values = [regions[n][key] for n in names]
        ax.barh(names, values, left=left, label=label)
        left = [a + b for a, b in zip(left, values)]
    left_out = ", ".join(f"{n}: {r['outside']:.0f}%" for n, r in data["regions"].items() if n not in regions)
    ax.set(xlabel="% of response tokens per step, mean over the run",
           title="tokens outside the clip interval" + (f" (left out, {left_out})" if left_out else ""))
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    runfolder.save_figure(fig, path, dpi=100)
    plt.close(fig)
    return path


# What the report writes into --figures (study_active.OUTPUTS for merge-active).
OUTPUTS = ("table1.md", "verdicts.md", "detectability.md", "detectability.png", "dynamic-clip.png",
           *(file for file, *_ in FIGURES))


def path_problem(args, root, figures, json_path, mechanism_path) -> str | None:
    """What is wrong with the study's paths, found before any run: --root or --figures naming a file or a folder that
    cannot be made or written, a folder at the name of a file the report writes, --json naming a folder or holding
    what is not a study's JSON, the one-step experiment's JSON (--mechanism, or its default where it exists) not a
    JSON object, or the JSON's folder not writable."""
    for flag, path, written in (("--root", args.root, not args.plot_only), ("--root", root, not args.plot_only),
                                ("--figures", figures, not args.no_plot)):
        if os.path.lexists(path) and not os.path.isdir(path):
            return f"{flag} {cli.short(path)} is a file; it names the folder the study writes into"
        problem = written and cli.folder_problem(path, flag)
        if problem:
            return problem
    outputs = study_active.OUTPUTS if args.preset == "merge-active" else OUTPUTS
    problem = not args.no_plot and cli.outputs_problem(figures, outputs, "--figures")
    if problem:
        return problem
    if os.path.lexists(mechanism_path):
        try:
            cli.read_json(mechanism_path, "--mechanism", what="a JSON object")
        except UserError as e:
            return str(e)
    if not os.path.lexists(json_path):
        return cli.output_problem(json_path, "--json")
    blocks = study_active.block_paths(json_path)[1:] if args.preset == "merge-active" else []  # read by its report
    for path in [json_path, *blocks]:
        problem = study_problem(path, "--json" if path == json_path else f"--json's block "
                                f"{study_active.block_letter(path)}")
        if problem:
            return problem
    lacking = [(name, seed, sorted(set(RECORD) - set(run)))
               for name, runs in configurations(load_study(json_path)).items()
               for seed, run in runs.items() if not set(RECORD) <= set(run)]
    if lacking:
        name, seed, keys = lacking[0]
        return (f"--json {cli.short(json_path)}: not a study's JSON ({cli.short(name, 60)} seed {cli.short(seed, 20)} "
                f"lacks {', '.join(keys)}, of what run_record writes)")
    folder = os.path.dirname(os.path.abspath(json_path))  # the JSON is rewritten beside itself (never in place)
    return cli.folder_problem(folder, f"--json {cli.short(json_path)}: its folder")


def make_parser() -> cli.Parser:
    parser = cli.Parser("study.py", description=__doc__)
    parser.add_argument("--preset", default="tiny", help="train.py preset: task, model and the update's settings")
    parser.add_argument("--steps", type=int, default=50, help="RL steps per run")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--configs", default=",".join(STUDY_DEFAULT), help=f"comma-separated, from {list(CONFIGS)}")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="held-out evaluation every N steps (default: the preset's)")
    parser.add_argument("--root", default=os.path.join(ROOT, "runs", "study"), help="where the runs go")
    parser.add_argument("--figures", default=None,
                        help="where figures and the table go (default: docs/figures/study-<preset>)")
    parser.add_argument("--json", default=None, help="the study's JSON, updated with the runs found, gzip'd where "
                        "its name ends in .gz (default: docs/figures/study-<preset>.json.gz)")
    parser.add_argument("--mechanism", default=None, help="the one-step experiment's JSON, set beside the runs "
                        "(default: docs/figures/mechanism-<preset>-warm.json.gz, where it exists)")
    parser.add_argument("--plot-only", action="store_true", help="only redraw from existing runs (the report mode)")
    parser.add_argument("--no-plot", action="store_true", help="only run, do not draw")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once, each pinned to cores / parallel cores")
    return parser


def argument_checks(parser, args, train_flags):
    """Every error of the command line itself, one line with exit code 2 before any run starts: (seeds, names, the
    core groups the runs take, the train.py flags every run gets, train.py's settings of them)."""
    from cegppo_utils import flags  # train.py's command line, which checks the flags passed through
    for token in flags.dash_flags(train_flags):
        name = token.split("=", 1)[0]
        if name in OWNED:
            parser.error(f"{name} is set by study.py for every run{f' (use {OWNED[name]})' if OWNED[name] else ''}; "
                         "it cannot be passed through to train.py")
    try:
        seeds = list(dict.fromkeys(int(s) for s in args.seeds.split(",") if s.strip()))
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: expected comma-separated integers, e.g. 0,1,2")
    if not seeds:
        parser.error("--seeds: no seed given")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be >= 1")
    if args.parallel < 1:
        parser.error("--parallel must be >= 1")
    try:
        groups = core_groups(args.parallel)
    except UserError as e:
        parser.error(str(e))
    names = cli.choices(parser, args.configs, CONFIGS, "--configs", "config")
    if args.mechanism and not os.path.lexists(args.mechanism):
        parser.error(f"--mechanism: no such file {cli.short(args.mechanism)}")
    extra = train_flags + (["--eval-every", str(args.eval_every)] if args.eval_every is not None else [])
    settings = flags.parse_args(["--preset", args.preset, *extra], prog="study.py")  # a bad train.py flag ends here
    if not args.plot_only:
        for name in names:  # each configuration's flags with the passed ones, as its runs will get them
            flags.parse_args(["--preset", args.preset, *CONFIGS[name], "--seed", str(seeds[0]), "--max-steps",
                              str(args.steps), *extra], prog="study.py")
    return seeds, names, groups, extra, settings


def resume_refusals(parser, args, root, names, seeds) -> None:
    """A run the study could not resume (run_one's refusal) ends the study, one line, before any run starts."""
    from cegppo_utils import runfolder as RF
    for name, seed in [(name, seed) for seed in seeds for name in names]:
        out = os.path.join(root, f"{name}-s{seed}")
        if not os.path.isdir(out):
            continue
        why = folder_refusal(out)  # before anything in the folder is read: a FIFO there would block the read
        if not why:
            done = dedupe_steps(RF.read_jsonl(os.path.join(out, "metrics.jsonl")))
            final = os.path.join(out, "final", "config.json")
            ended = done and done[-1]["step"] >= args.steps and os.path.exists(final)
            why = None if ended else refusal(out, done, resuming=True)
        if why:
            parser.error(f"{name} seed {seed}: refused ({out}): {why}; move that run folder aside to run it again")


def run_all(args, root, names, seeds, extra, groups) -> None:
    """Every run, seed-major (an interrupted study has whole seeds first), len(groups) at once, each pinned to a free
    group of cores; a failed run is named when all have ended (exit code 1)."""
    free = queue.Queue()
    for group in groups:
        free.put(group)

    def pinned(name, seed):  # a run takes a free group of cores and gives it back when it ends
        cores = free.get()
        try:
            return run_one(args.preset, name, seed, args.steps, os.path.join(root, f"{name}-s{seed}"), extra, cores)
        finally:
            free.put(cores)

    with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
        futures = [pool.submit(pinned, name, seed) for seed in seeds for name in names]
        failed = [str(f.exception()) for f in futures if f.exception()]
    if failed:
        sys.exit("\n".join(failed))


def write_report(args, study: dict, figures: str, mechanism_path: str, missing: list[str]) -> list[str]:
    """The table, the verdicts and the figures of the finished runs (an unfinished run's last evaluation is not its
    final one); the files written."""
    finished = study_json.finished(study, args.steps)
    unfinished = [f"{n} seed {s} ({r['steps_done']} steps)" for n, runs in study.items() for s, r in runs.items()
                  if r["steps_done"] < args.steps]
    mechanism = cli.read_json(mechanism_path, "--mechanism") if os.path.lexists(mechanism_path) else None
    os.makedirs(figures, exist_ok=True)
    table = table1(finished)
    if unfinished:
        table += f"\n\nNot finished (left out above): {', '.join(unfinished)}."
    if missing:
        table += (f"\n\nPlanned evaluations missing (their runs' best avg@k is over the others): {'; '.join(missing)}.")
    runfolder.write_text_atomically(os.path.join(figures, "table1.md"), table + "\n")
    runfolder.write_text_atomically(os.path.join(figures, "verdicts.md"), verdicts(finished, mechanism) + "\n")
    written = draw_figures(finished, figures)  # means over whole runs only
    text, data = detectability(finished)
    if text:
        runfolder.write_text_atomically(os.path.join(figures, "detectability.md"), text + "\n")
        written.append(draw_detectability(data, os.path.join(figures, "detectability.png")))
    print(table)
    return written


def main():
    parser = make_parser()
    args, train_flags = parser.parse_known_args()  # any other flag is a train.py flag, for every run
    for key in ("root", "figures", "json", "mechanism"):  # a leading ~ is the home folder, also after --root=
        setattr(args, key, getattr(args, key) and os.path.expanduser(getattr(args, key)))
    seeds, names, groups, extra, settings = argument_checks(parser, args, train_flags)
    root = os.path.join(args.root, args.preset)
    figures = args.figures or os.path.join(ROOT, "docs", "figures", f"study-{args.preset}")
    json_path = study_json.stored(args.json or os.path.join(ROOT, "docs", "figures", f"study-{args.preset}.json.gz"))
    mechanism_path = args.mechanism or study_json.stored(
        os.path.join(ROOT, "docs", "figures", f"mechanism-{args.preset}-warm.json.gz"))
    problem = path_problem(args, root, figures, json_path, mechanism_path)
    if problem:
        parser.error(problem)
    if not args.plot_only:
        resume_refusals(parser, args, root, names, seeds)
    start, warm_start = time.time(), None
    if not args.plot_only:
        from cegppo_utils import models  # the runs start from the study's warm start (built here if not cached)
        warm_start = check_warm_start(load_study(json_path), models.resolve_model(settings.model), json_path)
        run_all(args, root, names, seeds, extra, groups)
    study = configurations(collect(json_path, root, names, seeds, warm_start=warm_start))
    missing = missing_evaluations(study, settings.eval_every, settings.eval_before_train)
    for line in missing:
        print(f"[study] planned evaluation missing: {line}")
    if args.no_plot:
        return
    if args.preset == "merge-active":  # the second study reads its claims by its own protocol
        return study_active.report(json_path, figures)
    written = write_report(args, study, figures, mechanism_path, missing)
    print(f"[study] total {time.time() - start:.0f}s; table and figures in {figures}: "
          f"{', '.join(map(os.path.basename, written))}")


if __name__ == "__main__":
    cli.guard("study.py", main, refused=(ImpossibleInput,))
