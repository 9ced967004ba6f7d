"""A run's JSON files and JSON-lines files, read by one rule, for train.py, evaluate.py and the tools alike:
  - only a regular file is opened: a FIFO, a device or a folder is refused from its stat, before any open (opening a
    FIFO waits for a writer), and the file opened is checked again (one swapped in between is refused too);
  - a JSON-lines row is a JSON object in UTF-8 with an integer `step` (hardware.jsonl's rows have none: step=False);
    any other line is one UserError naming the file and the line. The one exception is a torn last line (no newline
    at its end, and not a whole row: a crash or a full disk in the middle of an append), which readers leave out and
    a resume moves aside (metrics.keep_rows_up_to);
  - a JSON file holds an object, and a run's config.json (read_run_record) holds what a run writes there, each key
    of its own type (a hand edit that breaks one is named, not met later as a traceback);
  - a file stored gzip'd (a name ending in .gz: the studies' JSONs, files.write_text_atomically) is unpacked by
    gunzip, to at most MAX_BYTES.
"""

import json
import os
import stat
import zlib

from cegppo_utils.data import UserError, first_line

MAX_BYTES = 1 << 30  # a run's log of 100,000 steps is about 200 MB; a larger file is not one (or is a trap)


def _kind(mode) -> str:
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device")


def read_bytes(path: str, what: str = "") -> bytes | None:
    """The bytes of the regular file at path, None where nothing is there. Anything but a regular file (after links)
    is refused before it is opened; one line names it (what: a prefix, such as "--resume: ")."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UserError(f"{what}{path} is not readable ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise UserError(f"{what}{path} is {_kind(mode)}, not a regular file; move it aside")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise UserError(f"{what}{path} is not readable ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # swapped for a FIFO since the stat: opened without waiting, refused
            raise UserError(f"{what}{path} is {_kind(info.st_mode)}, not a regular file; move it aside")
        if info.st_size > MAX_BYTES:
            raise UserError(f"{what}{path} has {info.st_size} bytes, more than a run writes there ({MAX_BYTES})")
        chunks = []
        while chunk := os.read(fd, 1 << 24):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as e:
        raise UserError(f"{what}{path} is not readable ({e.strerror})") from None
    finally:
        os.close(fd)


def gunzip(data: bytes) -> bytes:
    """The content of one gzip member (what write_text_atomically stores under a .gz name); a stream that is not
    gzip, ends early, has bytes after its end, or unpacks to more than MAX_BYTES (a small file can unpack to a huge
    one) is a ValueError saying which."""
    unpack = zlib.decompressobj(wbits=31)  # 31: a gzip header and trailer around the deflate stream, both checked
    try:
        content = unpack.decompress(data, MAX_BYTES + 1)
    except zlib.error as e:
        raise ValueError(f"not gzip: {e}") from None
    if len(content) > MAX_BYTES:
        raise ValueError(f"it unpacks to more than {MAX_BYTES} bytes")
    if not unpack.eof:
        raise ValueError("its gzip stream ends early (a torn or partly copied file)")
    if unpack.unused_data:
        raise ValueError(f"{len(unpack.unused_data)} bytes follow its gzip stream")
    return content


def row_problem(row, step: bool = True) -> str | None:
    """What keeps a parsed JSON-lines value from being a run's row (None if nothing): not an object, or (step) no
    integer `step` of 0 or more."""
    if not isinstance(row, dict):
        return f"is not a JSON object (got {type(row).__name__})"
    value = row.get("step")
    if step and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        return "has no step (an integer >= 0)" if "step" not in row else "has a step that is not an integer >= 0"
    return None


def jsonl_lines(path: str, step: bool = True, what: str = "") -> tuple[list[tuple[str, dict]], str | None]:
    """([(line, row)] for each row of the file, its torn last line or None); ([], None) where there is no file. A
    line that is not a row is one UserError: "PATH: line N is not ..."."""
    raw = read_bytes(path, what)
    if raw is None:
        return [], None
    pieces = raw.split(b"\n")
    last = pieces.pop()  # b"" where the file ends in a newline; else a line with none, perhaps torn
    found = []
    for number, piece in enumerate(pieces + ([last] if last else []), 1):
        torn = number == len(pieces) + 1
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError:
            if torn:  # cut inside a character
                return found, piece.decode("utf-8", "replace")
            raise UserError(f"{what}{path}: line {number} is not UTF-8 text") from None
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except (ValueError, RecursionError) as e:
            if torn:
                return found, text
            raise UserError(f"{what}{path}: line {number} is not valid JSON ({first_line(e, 80)})") from None
        problem = row_problem(row, step)
        if problem:
            raise UserError(f"{what}{path}: line {number} {problem}")
        found.append((text, row))
    return found, None


def read_jsonl(path: str, step: bool = True, what: str = "") -> list[dict]:
    """The rows of a run's JSON-lines file ([] where there is none), its torn last line left out (jsonl_lines)."""
    return [row for _, row in jsonl_lines(str(path), step, what)[0]]


def read_json_object(path, prefix="", suffix="") -> dict:
    """A JSON file that must hold an object (config.json): anything else is one line naming the file."""
    try:
        raw = read_bytes(path, prefix)
    except UserError as e:
        raise UserError(f"{e}{suffix}") from None
    if raw is None:
        raise UserError(f"{prefix}{path} is missing{suffix}")
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UserError(f"{prefix}{path} is not readable (not valid JSON: {first_line(e)}){suffix}") from None
    if not isinstance(value, dict):
        raise UserError(f"{prefix}{path} is not a JSON object{suffix}")
    return value


# What a run's config.json holds beside its flags, each of its own type: {key: (check, what it must be)}.
_RECORD_TYPES = {
    "flags": (lambda v: isinstance(v, dict), "an object of the run's flags"),
    "resumes": (lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v), "a list of objects"),
    "world_size": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
    "preset": (lambda v: isinstance(v, str), "a preset's name"),
    "model_sha256": (lambda v: v is None or isinstance(v, str), "a hash (text)"),
}


def read_run_record(path: str, prefix: str = "") -> dict:
    """A run's config.json: an object whose `flags` is an object and whose other keys train.py writes (resumes,
    world_size, preset, ...) each have its type, a resume's world_size too; anything else is one line naming the file
    and the key."""
    record = read_json_object(path, prefix)
    for key, (good, want) in _RECORD_TYPES.items():
        if (key in record or key == "flags") and not good(record.get(key)):
            raise UserError(f"{prefix}{path}: its {key} is {_shown(record.get(key))}, not {want} (edited by hand?); "
                            "restore the run's own config.json")
    for i, segment in enumerate(record.get("resumes", [])):
        size = segment.get("world_size", 1)
        if not _RECORD_TYPES["world_size"][0](size):
            raise UserError(f"{prefix}{path}: its resumes[{i}].world_size is {_shown(size)}, not an integer >= 1 "
                            "(edited by hand?); restore the run's own config.json")
    return record


def _shown(value) -> str:
    text = json.dumps(value) if not isinstance(value, float) or value == value else "NaN"
    return text if len(text) <= 60 else text[:60] + f"... ({len(text)} characters)"
