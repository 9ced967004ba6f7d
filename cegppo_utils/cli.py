"""The research tools' edges, one rule for all of them (study, study_active, mechanism, bench, gpu_check, configs, and
cegppo_utils/plot.py, which is why it sits among the helpers: a helper imports nothing from tools/): bad input is one
line on stderr and exit code 2, found before the work (the usage is shown only with --help); an empty value is refused
for every flag that takes one (an unset shell variable is not a choice); a value shown in a message has its control
characters escaped and is cut, so that a newline in a path or a 100,000-character value leaves one readable line. A file
a tool reads is checked before it is opened (a FIFO would block the read); a file or folder it writes is checked before
the work that fills it, and written whole, never through a link (runfolder/paths.py checks,
runfolder.write_text_atomically, save_figure, append_line write; a file written in place, a log, is opened by
runfolder.open_for_writing alone).
"""

import argparse
import json
import os
import stat
import sys

from cegppo_utils import flags
from cegppo_utils.command_line import NUMBER, bounded_int
from cegppo_utils.data import UserError, first_line
from cegppo_utils.runfolder import one_line  # the one rule train.py's and evaluate.py's messages follow too
from cegppo_utils.runfolder.paths import _kind, folder_problem, output_problem, outputs_problem  # noqa: F401
from cegppo_utils.runfolder.process import LIMIT, escape, short  # noqa: F401 (the tools' cli.short, cli.escape)
from cegppo_utils.runfolder.reading import gunzip, read_bytes


def fail(prog: str, message) -> None:
    """End the program with `prog: error: message` as one line on stderr and exit code 2."""
    sys.stderr.write(f"{prog}: error: {one_line(message)}\n")
    sys.stderr.flush()
    raise SystemExit(2)


def guard(prog: str, main, *args, refused=()):
    """main(*args), where a UserError (bad input found once the work began: a damaged file, a planted link) ends the
    program as one line and exit code 2, as argparse's errors do; uncaught, Python would print nothing. refused: the
    other exceptions that say the input was bad (stats.ImpossibleInput: numbers no study gives), ended alike."""
    try:
        return main(*args)
    except (UserError, *refused) as e:
        fail(prog, str(e))


def _nonempty(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty value (an unset shell variable?): give one, or leave the flag out")
    return value


class Parser(argparse.ArgumentParser):
    """argparse for the tools: every error one line with exit code 2 (fail), an empty value refused for every flag
    that takes a string, the first few unknown flags named with the closest known ones."""

    def __init__(self, prog: str, **kwargs):
        kwargs.setdefault("formatter_class", flags.HelpFormatter)
        super().__init__(prog=prog, allow_abbrev=False, **kwargs)

    def add_argument(self, *args, **kwargs):
        if kwargs.get("action", "store") == "store" and kwargs.get("type", str) is str:
            kwargs["type"] = _nonempty
        if kwargs.get("type") in NUMBER:  # one reading of a number for every program (loss.parse_int, parse_float)
            kwargs["type"] = bounded_int if kwargs["type"] is int else NUMBER[kwargs["type"]]
        return super().add_argument(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        values, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(self.unknown(unknown))
        return values

    def unknown(self, tokens) -> str:
        """The first three unknown arguments (and how many more), with the known flags they most likely mean."""
        names = {o.lstrip("-").replace("-", "_"): o for a in self._actions for o in a.option_strings
                 if o.startswith("--") and a.help != argparse.SUPPRESS}
        shown = tokens[:3]
        hints = [f"{short(t, 60)} -> {names[close]}" for t in shown if t.startswith("--")
                 for close in [flags.closest_flag(t.split("=", 1)[0], names)] if close]
        text = "unrecognized arguments: " + " ".join(short(t, 60) for t in shown)
        text += f" and {len(tokens) - 3} more" if len(tokens) > 3 else ""
        return text + (f" (did you mean: {', '.join(hints)}?)" if hints else "")

    def error(self, message):
        fail(self.prog, message)


def choices(parser, value: str, known, flag: str, what: str = "name") -> list[str]:
    """The comma-separated names of `value`, each from `known`, at least one, each once in the order first given (a
    name given twice would run twice: two trainers on one run folder); else parser.error, one line."""
    names = list(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"{flag}: unknown {what}(s) {short(unknown)}; choose from {list(known)}")
    if not names:
        parser.error(f"{flag} {short(repr(value))}: no {what} given; choose from {list(known)}")
    return names


# --- the files a tool reads and writes -----------------------------------------------------------------------------

def input_problem(path: str, flag: str) -> str | None:
    """Why `path` cannot be read as a file (None if it can): missing, a folder, a FIFO or device (a read would block or
    never end), or unreadable. Checked before the file is opened."""
    shown = f"{flag} {short(path)}"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"{shown}: no such file"
    except OSError as e:
        return f"{shown}: cannot read it ({e.strerror})"
    if stat.S_ISDIR(mode):
        return f"{shown} is a folder; name a file"
    if not stat.S_ISREG(mode):
        return f"{shown} is {_kind(mode)}, not a regular file"
    if not os.access(path, os.R_OK):
        return f"{shown}: cannot read it (permission denied)"
    return None


_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "a boolean"}


def read_json(path: str, flag: str, want=dict, what: str = "a JSON object"):
    """The JSON value of the file `path` (given by `flag`), which must be a `want`: anything else is a one-line
    UserError naming the flag, the file and what it holds instead of `what`. A name ending in .gz is read gzip'd (the
    committed studies' JSONs), any other as plain UTF-8."""
    problem = input_problem(path, flag)
    if problem:
        raise UserError(problem)
    try:  # the run's own reader: a file swapped for a FIFO since the check is refused, not opened
        data = read_bytes(path, f"{flag} ")
        value = json.loads((gunzip(data) if path.endswith(".gz") else data).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UserError(f"{flag} {short(path)}: not {what} ({type(e).__name__}: {first_line(e)})") from None
    if not isinstance(value, want):
        raise UserError(f"{flag} {short(path)}: not {what} (it holds {_JSON_TYPES.get(type(value), 'null')})")
    return value


