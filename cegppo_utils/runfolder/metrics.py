"""A run's JSON-lines logs (metrics.jsonl, samples.jsonl, eval/step_N.jsonl): appended a row at a time, and on resume
cut back to the checkpoint being resumed."""

import json
import os

from cegppo_utils import lazy
from cegppo_utils.runfolder.files import _append, write_text_atomically
from cegppo_utils.runfolder.reading import jsonl_lines, read_jsonl

D = lazy.module("cegppo_utils.distributed", globals(), "D")


def append_jsonl(path: str, rows: list[dict]):
    """Append rows, one JSON object per line, in one write (rank 0 only), to a regular file of the run's own (never
    through a link: open_for_writing)."""
    if rows and D.is_main():
        _append(path, "".join(json.dumps(r) + "\n" for r in rows))


def write_jsonl(path: str, rows: list[dict]):
    """Write a whole JSON-lines file atomically (any rank; a step evaluated again after a resume replaces it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_text_atomically(path, "".join(json.dumps(r) + "\n" for r in rows))


def keep_rows_up_to(metrics_path: str, step: int, log=print):
    """On resume: rows after `step` (a crash came after them) and a torn last line move to metrics.discarded.jsonl.
    Any other line that is not a row was refused before anything loaded (reading.jsonl_lines, read at start)."""
    rows, torn = jsonl_lines(metrics_path)
    keep = [text + "\n" for text, row in rows if row["step"] <= step]
    drop = [text + "\n" for text, row in rows if row["step"] > step] + ([torn + "\n"] if torn is not None else [])
    if not drop:
        return
    _append(metrics_path.replace(".jsonl", ".discarded.jsonl"), "".join(drop))
    write_text_atomically(metrics_path, "".join(keep))
    log(f"moved {len(drop)} row(s) logged after step {step} (or torn) to "
        f"{os.path.basename(metrics_path).replace('.jsonl', '.discarded.jsonl')}")


def restore_row(metrics_path: str, row, log=print):
    """On resume: the checkpoint's own step's metrics row, saved in it because the checkpoint is written before that
    step's held-out evaluation and the row after it. A run stopped in between (a failed evaluation, a kill) left no
    row for that step: it is appended here, without the evaluation's numbers."""
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
        return
    rows = read_jsonl(metrics_path)
    if rows and isinstance(rows[-1].get("step"), int) and rows[-1]["step"] >= row["step"]:
        return
    append_jsonl(metrics_path, [{**row, "eval_lost": True}])
    log(f"step {row['step']}: its metrics row was not written (the run stopped during its evaluation); restored "
        "it from the checkpoint, without eval_acc")
