"""A study's JSON, as tools/study.py writes it and tools/study_active.py reads it: {config: {seed: {"steps_done",
"steps": [one row per step], ...}}}, beside keys that start with "_" and are not configurations. Both tools import
it, so neither imports the other to read it.

The committed studies are stored gzip'd, `docs/figures/study-<name>.json.gz` (a 30 MB JSON packs to 6 MB): a name
ending in .gz is read unpacked (cli.read_json) and written packed (runfolder.write_text_atomically), any other name as
plain JSON. A study's runs may write the plain name until its JSON is packed and committed; `stored` finds either.
"""

import math
import os
import textwrap

from cegppo_utils import cli
from cegppo_utils.data import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Keys of the study's JSON that are not configurations: the warm start every run started from (its weights' hash,
# models.weights_hash, and the machine that rebuilt it identically), and runs made by code since corrected, kept
# for the record ({config: {seed: record with "superseded_because"}}) and never tabulated.
WARM_START, SUPERSEDED = "_warm_start", "_superseded"
WHAT = "a study's JSON"  # what a file given as one must be


def twin(path: str) -> str:
    """The other name of a study's JSON: `X.json.gz` for `X.json`, `X.json` for `X.json.gz` (path itself otherwise)."""
    if path.endswith(".json.gz"):
        return path[:-len(".gz")]
    return path + ".gz" if path.endswith(".json") else path


def stored(path: str) -> str:
    """The file that holds the study's JSON named `path`: path where it exists, else its twin (`X.json.gz` for
    `X.json` and back) where that exists, else path. So a default name finds a study still stored plain, and an older
    command naming `X.json` updates the packed `X.json.gz` rather than starting a second JSON beside it."""
    if os.path.lexists(path) or not os.path.lexists(twin(path)):
        return path
    return twin(path)


# How many significant digits a study's JSON keeps of a number (compact): 9, the digits that give back any float32
# exactly (the runs compute their metrics in float32); the wall-clock readings, which no page tests, keep 4.
DIGITS, CLOCK_DIGITS = 9, 4
CLOCK_KEYS = ("time_rollout_s", "time_reward_s", "time_update_s", "tokens_per_s", "seconds")


def compact(value, key: str | None = None):
    """A study's JSON with every float rounded to DIGITS significant digits (CLOCK_DIGITS for CLOCK_KEYS), so the
    stored study stays small (about a third less packed) without a digit any page prints or any test reads moving."""
    if isinstance(value, float):
        return float(f"{value:.{CLOCK_DIGITS if key in CLOCK_KEYS else DIGITS}g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: compact(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [compact(v, key) for v in value]
    return value


def para(text: str) -> str:
    """A markdown paragraph wrapped at 120 characters, as the docs are."""
    return textwrap.fill(text, 120, break_long_words=False, break_on_hyphens=False)


def dedupe_steps(rows: list[dict]) -> list[dict]:
    """Metrics rows with one row per step, the last one logged for it (a resume can log a step twice), in step
    order; rows without a step are dropped."""
    last = {}
    for r in rows:
        if isinstance(r.get("step"), int):
            last[r["step"]] = r
    return [last[s] for s in sorted(last)]


def configurations(study: dict) -> dict:
    """The study's configurations: its JSON without the warm start and the superseded runs."""
    return {name: runs for name, runs in study.items() if not name.startswith("_")}


def finished_runs(runs: dict, steps: int) -> dict:
    """A configuration's runs that reached `steps`, by seed (a run still going is recorded with what it has logged so
    far, and its last evaluation is not its final one)."""
    return {seed: run for seed, run in runs.items() if run["steps_done"] >= steps}


def finished(study: dict, steps: int) -> dict:
    """Every configuration's finished_runs; a configuration with none is left out."""
    done = {name: finished_runs(runs, steps) for name, runs in configurations(study).items()}
    return {name: runs for name, runs in done.items() if runs}


def mean_entropy(run, until: int | None = None) -> float | None:
    """A run's mean token entropy over the steps that logged it (a step whose every group scored alike trains on
    nothing and logs none), those before step `until` when given; None where none did. The second study's primary
    endpoint (all steps) and the third's secondary one (before a pair's collapse)."""
    values = [r["entropy"] for r in run["steps"]
              if r.get("entropy") is not None and (until is None or r["step"] < until)]
    return sum(values) / len(values) if values else None


def pct(x, unit: str = "") -> str:
    """A share as a percentage with one decimal (and `unit` after it: "%" where no column head says it is one)."""
    return "n/a" if x is None else f"{100 * x:.1f}{unit}"


def load_study(path: str, flag: str = "--json") -> dict:
    """The study's JSON ({} where there is none yet), each run's steps read with one row per step (dedupe_steps); a
    file that is not a study's JSON is a one-line UserError naming `flag` and the file (study_problem)."""
    study = {}
    if os.path.lexists(path):
        study = cli.read_json(path, flag, what=WHAT)
        shape = shape_problem(study)
        if shape:
            raise UserError(f"{flag} {cli.short(path)}: not {WHAT} ({shape})")
    for runs in configurations(study).values():
        for run in runs.values():
            run["steps"] = dedupe_steps(run["steps"])
    return study


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def shape_problem(study: dict) -> str | None:
    """Where `study` does not have a study's shape (None if it does): every configuration an object of runs by seed,
    every run an object with a whole steps_done and a list of rows as its steps, the warm start an object."""
    if not isinstance(study.get(WARM_START, {}), dict):
        return f"{WARM_START} is not an object"
    for name, runs in configurations(study).items():
        if not isinstance(runs, dict):
            return f"configuration {cli.short(name, 60)} is not an object of runs by seed"
        for seed, run in runs.items():
            where = f"configuration {cli.short(name, 60)} seed {cli.short(seed, 20)}"
            if not isinstance(run, dict) or not _whole(run.get("steps_done")):
                return f"{where} is not a run's record (an object with a whole steps_done)"
            if not isinstance(run.get("steps"), list) or not all(isinstance(r, dict) for r in run["steps"]):
                return f"{where}: its steps are not a list of objects"
    return None


def study_problem(path: str, flag: str) -> str | None:
    """Why `path` cannot be read as a study's JSON (None if it can, or if there is none yet): a folder, a FIFO, not
    JSON, or not a study's shape; one line naming the flag and the file."""
    if os.path.isdir(path):
        return f"{flag} {cli.short(path)} is a folder; name the study's JSON file"
    try:
        load_study(path, flag)
    except UserError as e:
        return str(e)
    return None
