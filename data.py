"""Rows of problems, one layout for training data and benchmarks: {"id", "prompt": chat messages, "answer"}.

    rows = data.load_rows("Kwai-Klear/KlearReasoner-MathSub-30K")   # a hub dataset id
    rows = data.load_rows("train.jsonl")                              # a local .json / .jsonl / .parquet file
    rows = data.load_rows("arith")                                    # an offline task built in code (tiny.py)
    problems = data.load_benchmark("aime24", data_dir="benchmarks")   # a named benchmark (hub, or local files)
    problems = data.load_benchmark("my_eval.jsonl")                   # or any file in a layout below

Row layouts a file or dataset may use:
  KlearReasoner / verl  {"prompt": [{"role": "user", "content": ...}], "reward_model": {"ground_truth": ...}}
  plain                 {"problem" or "question": ..., "answer": ...}      (an "id" column is kept if present)
The named benchmarks read their own public layouts (BENCHMARKS). The question becomes the single user message,
rendered later with the model's chat template (rollout.py); the answer is what reward.py verifies against.

Bad input raises UserError naming the file and the row (the line, for .jsonl); train.py and evaluate.py print
its message as one line and exit with code 2.
"""

import json
import os
import random
import re

FILE_TYPES = (".json", ".jsonl", ".parquet")


class UserError(SystemExit):
    """Something the user gave is wrong (a file, a row, a flag, a folder): its message names it. Entry points print
    the message as one line; uncaught, it ends the program with exit code 2 like an argparse error."""

    def __init__(self, message):
        super().__init__(message)
        self.code = 2


# --- the offline tasks ---------------------------------------------------------------------------
# name -> (training rows, held-out rows): problems built in code by tiny.py, so CPU runs need no download.

def task_names() -> list[str]:
    import tiny
    return sorted(tiny.TASKS)


def _task_rows(name, split, seed):
    import tiny
    problems = tiny.TASKS[name].train(seed) if split == "train" else tiny.TASKS[name].held_out()
    return [make_row(i, p["problem"], p["answer"]) for i, p in enumerate(problems)]


# --- rows ---------------------------------------------------------------------------------------

def make_row(row_id, question, answer) -> dict:
    return {"id": row_id, "prompt": [{"role": "user", "content": question}], "answer": answer}


def _check_answer(answer, where):
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise UserError(f"{where} has no answer (expected `reward_model.ground_truth` or an `answer` column)")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise UserError(f"{where}: the answer must be a string or a number, got {type(answer).__name__}")
    return answer


def to_row(record, where: str, index: int, question_path: str | None = None, answer_path: str | None = None) -> dict:
    """One record (a dict) in any accepted layout -> a row; `where` names it in errors ("file.jsonl: line 3")."""
    if not isinstance(record, dict):
        raise UserError(f"{where} is not a JSON object (got {type(record).__name__})")
    if question_path:  # a named benchmark's own layout
        try:
            question, answer = _get(record, question_path), _get(record, answer_path)
        except (KeyError, IndexError, TypeError):
            raise UserError(f"{where} lacks {question_path} or {answer_path}") from None
        if not isinstance(question, str) or not question.strip():
            raise UserError(f"{where} has an empty question ({question_path})")
        return make_row(record.get("id", index), question, _check_answer(answer, where))
    prompt = record.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        messages = [{"role": m.get("role"), "content": m.get("content")} for m in prompt]
        if not all(isinstance(m["role"], str) and isinstance(m["content"], str) and m["content"].strip() for m in messages):
            raise UserError(f"{where}: `prompt` messages need a role and non-empty content")
    else:
        question = record.get("problem") or record.get("question") or (prompt if isinstance(prompt, str) else None)
        if not isinstance(question, str) or not question.strip():
            raise UserError(f"{where} has no question (expected `prompt` messages or a `problem` column)")
        messages = [{"role": "user", "content": question}]
    reward_model = record.get("reward_model")
    answer = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if answer is None:
        answer = record.get("answer")
    row_id = record.get("id", index)
    return {"id": row_id if isinstance(row_id, (str, int)) else index, "prompt": messages,
            "answer": _check_answer(answer, where)}


def _get(record, path):
    for key in path.split("."):
        record = record[int(key)] if isinstance(record, list) else record[key]
    return record


def read_records(path: str) -> list[tuple[str, dict]]:
    """(where, record) for every record of a local .json / .jsonl / .parquet file; where names the line or row."""
    name = os.path.basename(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in FILE_TYPES:
        raise UserError(f"{path}: unsupported file type {ext!r}; use .json, .jsonl or .parquet")
    if ext == ".parquet":
        try:
            import pyarrow.parquet as pq
            table = pq.read_table(path).to_pylist()
        except Exception as e:  # not parquet, truncated, unreadable
            raise UserError(f"{path}: not a readable parquet file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        return [(f"{name}: row {i}", r) for i, r in enumerate(table)]
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a UTF-8 text file, so not JSON") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror})") from None
    if ext == ".json":  # a JSON array of objects (or JSON lines, as the official train_math_30K.json may be)
        try:
            whole = json.loads(text)
            if isinstance(whole, list):
                return [(f"{name}: row {i}", r) for i, r in enumerate(whole)]
            if isinstance(whole, dict):
                return [(f"{name}: row 0", whole)]
        except json.JSONDecodeError as e:
            if e.msg != "Extra data":  # anything but several objects one after the other
                raise UserError(f"{path}: not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):  # JSON lines
        if not line.strip():
            continue
        try:
            records.append((f"{name}: line {number}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: line {number} is not valid JSON (column {e.colno}: {e.msg})") from None
    return records


def hub_unreachable(what: str) -> str | None:
    """None when the hub answers within 3 s (or HF_HUB_OFFLINE is set: the cache alone is used); otherwise the line
    to show instead of the libraries' own minute of retries, with the ways to work offline."""
    import socket
    import urllib.parse

    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return None
    url = urllib.parse.urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=3).close()
        return None
    except OSError:
        return (f"{what}: the hub cannot be reached and it is not in the local cache; give a local path, "
                "set HF_HUB_OFFLINE=1 to use what is cached, or for benchmarks pass --data-dir")


def _hub_records(source, split):
    try:
        import datasets
        if not _dataset_cached(source):
            problem = hub_unreachable(source)
            if problem:
                raise UserError(problem)
        data = datasets.load_dataset(source, split=split)
    except UserError:
        raise
    except Exception as e:  # a mistyped id, no network, no such split
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"{source}: could not load it as a hub dataset ({type(e).__name__}: {first[:200]})") from None
    return data, [(f"{source}: row {i}", r) for i, r in enumerate(data)]


def _dataset_cached(source) -> bool:
    """Whether datasets has a copy of this hub dataset on disk (its cache folder names the owner and dataset)."""
    from datasets import config
    folder = os.path.join(config.HF_DATASETS_CACHE, source.replace("/", "___"))
    return os.path.isdir(folder)


def load_rows(source: str, *, split: str = "train", seed: int = 0) -> list[dict]:
    """Rows from an offline task name, a local file, or a hub dataset id (see the module docstring)."""
    if source in task_names():
        return _task_rows(source, "train" if split == "train" else "test", seed)
    if os.path.isdir(source):
        raise UserError(f"{source} is a folder; give a .json, .jsonl or .parquet file, a hub id or a task ({task_names()})")
    if os.path.exists(source):
        records = read_records(source)
    elif source.lower().endswith(FILE_TYPES) or source.startswith((".", "/", "~")) or os.path.isdir(source.split("/")[0]):
        raise UserError(f"{source}: no such file")  # a path (its folder exists here), not a hub id
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", source):
        records = _hub_records(source, split)[1]
    else:
        raise UserError(f"{source}: no such file, not a hub dataset id (owner/name), not a task ({task_names()})")
    rows = [to_row(record, where, i) for i, (where, record) in enumerate(records)]
    if not rows:
        raise UserError(f"{source}: no rows")
    return rows


# --- benchmarks -------------------------------------------------------------------------------
# name -> hub id, split, fields (dotted paths), local file in its public layout and its fields, and the paper's
# k and max tokens (§4.1: avg@32 on AIME24/AIME25/HMMT25/AMC23, avg@4 on MATH500; 32k tokens AIME, 16k others).

BENCHMARKS = {
    "aime24": dict(hub="HuggingFaceH4/aime_2024", split="train", question="problem", answer="answer", id="id",
                   file="aime24.jsonl", file_question="messages.0.content", file_answer="meta.answer", k=32, max_tokens=32768),
    "aime25": dict(hub="MathArena/aime_2025", split="train", question="problem", answer="answer", id="problem_idx",
                   file="aime25.jsonl", file_question="messages.0.content", file_answer="meta.solution", k=32, max_tokens=32768),
    "hmmt25": dict(hub="MathArena/hmmt_feb_2025", split="train", question="problem", answer="answer", id="problem_idx",
                   file="hmmt25.jsonl", file_question="messages.0.content", file_answer="answer", k=32, max_tokens=16384),
    "math500": dict(hub="HuggingFaceH4/MATH-500", split="test", question="problem", answer="answer", id="unique_id",
                    file="math500.jsonl", file_question="problem", file_answer="answer", k=4, max_tokens=16384),
    # field names of math-ai/amc23 not checked against its card; --data-dir reads the public file layout instead
    "amc23": dict(hub="math-ai/amc23", split="test", question="question", answer="answer", id="id",
                  file="amc23.jsonl", file_question="problem", file_answer="answer", k=32, max_tokens=16384),
}
USER_FILE_DEFAULTS = dict(k=8, max_tokens=16384)  # a benchmark given as a file path


def benchmark_defaults(name: str) -> dict:
    """The paper's k and max tokens for a named benchmark; an offline task's own budget; USER_FILE_DEFAULTS else."""
    if name in BENCHMARKS:
        return {k: BENCHMARKS[name][k] for k in ("k", "max_tokens")}
    if name in task_names():
        import tiny
        return dict(k=tiny.TASKS[name].k, max_tokens=tiny.TASKS[name].max_response_len)
    return dict(USER_FILE_DEFAULTS)


def is_benchmark(name: str) -> bool:
    """A name load_benchmark knows, or a path to a data file."""
    return name in BENCHMARKS or name in task_names() or name.lower().endswith(FILE_TYPES)


def load_benchmark(name: str, data_dir: str | None = None, limit: int | None = None) -> list[dict]:
    """Problems of one benchmark as rows: a named benchmark (local file in its public layout under data_dir, or
    the hub), an offline task's held-out set, or any data file (.json/.jsonl/.parquet) in a layout above."""
    if name in task_names():
        rows = _task_rows(name, "test", 0)
    elif name in BENCHMARKS:
        spec = BENCHMARKS[name]
        if data_dir is not None:
            path = os.path.join(data_dir, spec["file"])
            if not os.path.exists(path):
                raise UserError(f"{name}: {path} not found (--data-dir holds the public files, e.g. {spec['file']})")
            rows = [to_row(r, where, i, spec["file_question"], spec["file_answer"])
                    for i, (where, r) in enumerate(read_records(path))]
        else:
            data, records = _hub_records(spec["hub"], spec["split"])
            missing = [f for f in (spec["question"], spec["answer"]) if f not in data.column_names]
            if missing:
                raise UserError(f"{name}: {spec['hub']} has no column(s) {missing}; it has {data.column_names}")
            rows = [{**to_row(r, where, i, spec["question"], spec["answer"]), "id": r.get(spec["id"], i)}
                    for i, (where, r) in enumerate(records)]
    elif name.lower().endswith(FILE_TYPES):
        if not os.path.exists(name):
            raise UserError(f"{name}: no such file")
        rows = [to_row(r, where, i) for i, (where, r) in enumerate(read_records(name))]
    else:
        raise UserError(f"unknown benchmark {name!r}: give a file path (.json/.jsonl/.parquet) or one of "
                        f"{sorted(BENCHMARKS) + task_names()}")
    if not rows:
        raise UserError(f"{name}: no problems")
    return rows[:limit] if limit else rows


def question_of(row) -> str:
    """The text of a row's (last) user message."""
    return row["prompt"][-1]["content"]


# --- the training stream ----------------------------------------------------------------------

class PromptStream:
    """Endless shuffled passes over the rows; `state()` (epoch, index) is checkpointed for exact resume."""

    def __init__(self, rows, seed):
        self.rows, self.seed = rows, seed
        self.epoch, self.index = 0, 0
        self._order = self._permutation()

    def _permutation(self):
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        return order

    def next_batch(self, size):
        batch = []
        while len(batch) < size:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation()
            batch.append(self.rows[self._order[self.index]])
            self.index += 1
        return batch

    def state(self):
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state):
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._permutation()
