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
its message as one line and exit with code 2. JSON files are read one row at a time, a row at most MAX_ROW_CHARS
(8 MiB); a FIFO, device or socket is refused before any read; a row must be an object whose messages are objects
with a known role, its texts valid UTF-8 (no unpaired surrogates), its answer a string or a finite number (NaN,
Infinity, 1e400, 1e-400 and integers past 4300 digits are refused where the JSON is read).
"""

import json
import math
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


def first_line(error, limit: int | None = 200) -> str:
    """An exception's first line of text for a one-line message ("" when it has none), cut at `limit` characters."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else ""


# --- the offline tasks ---------------------------------------------------------------------------
# name -> (training rows, held-out rows): problems built in code by tiny.py, so CPU runs need no download.

def task_names() -> list[str]:
    from cegppo_utils import tiny
    return sorted(tiny.TASKS)


def _task_rows(name, split, seed):
    from cegppo_utils import tiny
    problems = tiny.TASKS[name].train(seed) if split == "train" else tiny.TASKS[name].held_out()
    return [make_row(i, p["problem"], p["answer"]) for i, p in enumerate(problems)]


# --- rows ---------------------------------------------------------------------------------------

def make_row(row_id, question, answer) -> dict:
    return {"id": row_id, "prompt": [{"role": "user", "content": question}], "answer": answer}


MAX_ANSWER_CHARS = 10_000  # a gold answer longer than this cannot be verified within reward.py's deadline
ROLES = ("system", "user", "assistant")


def _text(value, where, what):
    """A string that can leave this process as UTF-8 (to a tokenizer, a JSON file): JSON's "\\ud800" escapes give
    unpaired surrogates, which cannot."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{where}: {what} holds an unpaired surrogate ({value[e.start]!r} at character {e.start}), "
                        "which is not text") from None
    return value


def _check_answer(answer, where):
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise UserError(f"{where} has no answer (expected `reward_model.ground_truth` or an `answer` column)")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise UserError(f"{where}: the answer must be a string or a number, got {type(answer).__name__}")
    if isinstance(answer, float) and not math.isfinite(answer):
        raise UserError(f"{where}: the answer is {answer}, which no response can ever be verified against")
    if isinstance(answer, int) and answer.bit_length() > _INT_DIGITS * 3.33:
        raise UserError(f"{where}: the answer is an integer with more than {_INT_DIGITS} digits")
    if isinstance(answer, str):
        _text(answer, where, "the answer")
        if len(answer) > MAX_ANSWER_CHARS:
            raise UserError(f"{where}: the answer has {len(answer)} characters (more than {MAX_ANSWER_CHARS}), too "
                            "long to verify")
    return answer


def to_row(record, where: str, index: int, question_path: str | None = None, answer_path: str | None = None) -> dict:
    """One record (a dict) in any accepted layout -> a row; `where` names it in errors ("file.jsonl: line 3")."""
    if not isinstance(record, dict):
        raise UserError(f"{where} is not a JSON object (got {type(record).__name__})")
    if question_path:  # a named benchmark's own layout
        try:
            question, answer = _get(record, question_path), _get(record, answer_path)
        except (KeyError, IndexError, TypeError, ValueError):
            raise UserError(f"{where} lacks {question_path} or {answer_path}") from None
        if not isinstance(question, str) or not question.strip():
            raise UserError(f"{where} has an empty question ({question_path})")
        return make_row(_row_id(record.get("id"), index, where), _text(question, where, question_path),
                        _check_answer(answer, where))
    prompt = record.get("prompt")
    if isinstance(prompt, list) and prompt and any(isinstance(m, dict) for m in prompt):
        messages = []
        for k, m in enumerate(prompt):
            if not isinstance(m, dict):
                raise UserError(f"{where}: `prompt` message {k} is not an object (got {type(m).__name__})")
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str) or not isinstance(content, str) or not content.strip():
                raise UserError(f"{where}: `prompt` messages need a role and non-empty content (message {k})")
            if role not in ROLES:
                raise UserError(f"{where}: `prompt` message {k} has role {role[:40]!r}; expected one of {list(ROLES)}")
            messages.append({"role": role, "content": _text(content, where, f"`prompt` message {k}")})
        if messages[-1]["role"] != "user":
            raise UserError(f"{where}: the last `prompt` message must be the user's question "
                            f"(got {messages[-1]['role']!r})")
    else:
        question = record.get("problem") or record.get("question") or (prompt if isinstance(prompt, str) else None)
        if not isinstance(question, str) or not question.strip():
            raise UserError(f"{where} has no question (expected `prompt` messages or a `problem` column)")
        messages = [{"role": "user", "content": _text(question, where, "the question")}]
    reward_model = record.get("reward_model")
    answer = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if answer is None:
        answer = record.get("answer")
    return {"id": _row_id(record.get("id"), index, where), "prompt": messages, "answer": _check_answer(answer, where)}


def _row_id(row_id, index, where):
    """A row's own id if it is a string or a (short) integer, else its index."""
    if isinstance(row_id, str):
        return _text(row_id, where, "the id")
    if isinstance(row_id, int) and not isinstance(row_id, bool) and abs(row_id) < 2**63:
        return row_id
    return index


def _get(record, path):
    for key in path.split("."):
        record = record[int(key)] if isinstance(record, list) else record[key]
    return record


MAX_ROW_CHARS = 8 * 2**20  # one row (a JSON value) at most this long: a math problem is kilobytes
_CHUNK = 2**20  # characters read at a time
_INT_DIGITS = 4300  # Python's own int <-> str limit (sys.get_int_max_str_digits' default)


def open_regular_file(path: str):
    """A readable regular file opened for binary reading. A FIFO, a device or a socket is refused before any read:
    a read from one can block forever (a FIFO with no writer) or never end (/dev/zero)."""
    import stat
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO opens at once
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "not a file")
        raise UserError(f"{path}: {kind}, not a regular file; give a .json, .jsonl or .parquet file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _parse_int(text):
    if len(text.lstrip("-")) > _INT_DIGITS:
        raise ValueError(f"an integer with {len(text.lstrip('-'))} digits (more than {_INT_DIGITS})")
    return int(text)


def _parse_float(text):
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is beyond a float's range")
    if value == 0 and re.search(r"[1-9]", text.lower().split("e")[0]):
        raise ValueError(f"the number {text[:40]} is too small for a float (it would read as 0)")
    return value


def _no_constant(name):
    raise ValueError(f"{name} is not a number an answer can be checked against")


_WHITESPACE = re.compile(r"[ \t\r\n]*")
_DECODER = json.JSONDecoder(parse_float=_parse_float, parse_int=_parse_int, parse_constant=_no_constant)


class _JsonStream:
    """JSON values read one at a time from a text file, each bounded by MAX_ROW_CHARS: memory follows the largest
    row, not the file, and a huge row is refused once MAX_ROW_CHARS of it have been read."""

    def __init__(self, binary, path):
        import codecs
        self.file, self.path = binary, path
        self.utf8 = codecs.getincrementaldecoder("utf-8-sig")()  # a leading byte-order mark is dropped
        self.buf, self.pos, self.eof = "", 0, False
        self.line, self.base_col = 1, 1  # the line at self.pos; the column of buf[0]

    def fill(self) -> bool:
        """Read more; False at the end of the file."""
        if self.eof:
            return False
        chunk = self.file.read(_CHUNK)
        try:
            text = self.utf8.decode(chunk, final=not chunk)
        except UnicodeDecodeError:
            raise UserError(f"{self.path}: not a UTF-8 text file, so not JSON (near line {self.line})") from None
        self.eof = not chunk
        # drop what was read (its columns are kept for error messages), then append
        newline = self.buf.rfind("\n", 0, self.pos)
        self.base_col = self.pos - newline if newline >= 0 else self.base_col + self.pos
        self.buf, self.pos = self.buf[self.pos:] + text, 0
        return True

    def advance(self, to):
        self.line += self.buf.count("\n", self.pos, to)
        self.pos = to

    def peek(self) -> str:
        """The next character that is not whitespace ("" at the end), without consuming it."""
        while True:
            self.advance(_WHITESPACE.match(self.buf, self.pos).end())
            if self.pos < len(self.buf) or not self.fill():
                return self.buf[self.pos:self.pos + 1]

    def column(self, p) -> int:
        newline = self.buf.rfind("\n", 0, p)
        return p - newline if newline >= 0 else self.base_col + p

    def value(self, label):
        """The JSON value starting at the next non-whitespace character; label names it in errors ("line 3")."""
        self.peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buf, self.pos)
                if end < len(self.buf) or self.eof:  # a number at the end of the buffer may go on in the next chunk
                    self.advance(end)
                    return value
            except json.JSONDecodeError as e:
                # a value cut by the end of the buffer: read more; anything else is malformed
                if self.eof or (e.pos < len(self.buf) - 10 and not e.msg.startswith("Unterminated string")):
                    extra = self.buf.count("\n", self.pos, e.pos)
                    at = (f"line {self.line + extra} column {self.column(e.pos)}: "
                          if extra and label.startswith("row") else
                          "" if extra else f"column {self.column(e.pos)}: ")  # JSON lines: the row's line says it
                    raise UserError(f"{self.path}: {label} is not valid JSON ({at}{e.msg})") from None
            except RecursionError:
                raise UserError(f"{self.path}: {label} is nested too deeply (past Python's recursion limit)") from None
            except ValueError as e:  # from _parse_int / _parse_float / _no_constant
                raise UserError(f"{self.path}: {label}: {e}") from None
            if len(self.buf) - self.pos > MAX_ROW_CHARS:
                raise UserError(f"{self.path}: {label} is longer than {MAX_ROW_CHARS // 2**20} MiB (a row holds one "
                                "problem; is this the right file?)")
            self.fill()

    def expect(self, chars, where) -> str:
        got = self.peek()
        if got == "" or got not in chars:
            raise UserError(f"{self.path}: not valid JSON (line {self.line} column {self.column(self.pos)}: "
                            f"expected {' or '.join(repr(c) for c in chars)} after {where}, "
                            f"got {got or 'the end of the file'!r})")
        self.advance(self.pos + 1)
        return got


def read_records(path: str) -> list[tuple[str, dict]]:
    """(where, record) for every record of a local .json / .jsonl / .parquet file; where names the line or row.
    JSON is read one row at a time (a .json array, JSON lines, or values one after another), each row at most
    MAX_ROW_CHARS; anything but a regular file is refused before reading."""
    name = os.path.basename(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in FILE_TYPES:
        raise UserError(f"{path}: unsupported file type {ext!r}; use .json, .jsonl or .parquet")
    with open_regular_file(path) as f:
        try:
            if ext == ".parquet":
                return [(f"{name}: row {i}", r) for i, r in enumerate(_parquet_rows(f.read(), path))]
            return _json_records(_JsonStream(f, path), name, array=ext == ".json")
        except OSError as e:
            raise UserError(f"{path}: cannot read it ({e.strerror})") from None


def _parquet_rows(raw: bytes, path) -> list[dict]:
    """A parquet file's rows, decoded from its bytes in memory on this thread. Not from a Python file object: pyarrow
    reads one on its own I/O threads, which call back into Python, and one still running when a refused file ends
    the program stops at interpreter exit and aborts it (SIGABRT, "terminate called without an active exception",
    after the error line)."""
    if len(raw) < 12 or raw[:4] != b"PAR1" or raw[-4:] != b"PAR1":
        raise UserError(f"{path}: not a readable parquet file (it does not start and end with parquet's PAR1)")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
        return pq.ParquetFile(pa.BufferReader(raw)).read(use_threads=False).to_pylist()
    except Exception as e:  # truncated, damaged
        raise UserError(f"{path}: not a readable parquet file ({type(e).__name__}: {first_line(e, None)})") from None


def _json_records(stream, name, array):
    records = []
    if array and stream.peek() == "[":  # a JSON array of objects
        stream.advance(stream.pos + 1)
        if stream.peek() == "]":
            stream.advance(stream.pos + 1)
        else:
            while True:
                i = len(records)
                stream.peek()
                records.append((f"{name}: row {i}", stream.value(f"row {i} (line {stream.line})")))
                if stream.expect(",]", f"row {i}") == "]":
                    break
        if stream.peek():
            raise UserError(f"{stream.path}: not valid JSON (line {stream.line} column {stream.column(stream.pos)}: "
                            "extra data after the array)")
        return records
    while stream.peek():  # JSON lines (the official train_math_30K.json may be these), or one object
        line = stream.line
        records.append((f"{name}: line {line}", stream.value(f"line {line}")))
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
        raise UserError(f"{source}: could not load it as a hub dataset ({type(e).__name__}: {first_line(e)})") from None
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
        raise UserError(f"{source} is a folder; give a .json, .jsonl or .parquet file, a hub id or a task "
                        f"({task_names()})")
    if os.path.lexists(source):  # a dangling or looping link too: reading it says which
        records = read_records(source)
    elif (source.lower().endswith(FILE_TYPES) or source.startswith((".", "/", "~"))
          or os.path.isdir(source.split("/")[0])):
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
                   file="aime24.jsonl", file_question="messages.0.content", file_answer="meta.answer",
                   k=32, max_tokens=32768),
    "aime25": dict(hub="MathArena/aime_2025", split="train", question="problem", answer="answer", id="problem_idx",
                   file="aime25.jsonl", file_question="messages.0.content", file_answer="meta.solution",
                   k=32, max_tokens=32768),
    "hmmt25": dict(hub="MathArena/hmmt_feb_2025", split="train", question="problem", answer="answer", id="problem_idx",
                   file="hmmt25.jsonl", file_question="messages.0.content", file_answer="answer",
                   k=32, max_tokens=16384),
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
        from cegppo_utils import tiny
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
        if not os.path.lexists(name):
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
