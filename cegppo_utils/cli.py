"""The research tools' edges, one rule for all of them (study, study_active, mechanism, bench, gpu_check, configs, and
cegppo_utils/plot.py, which is why it sits among the helpers: a helper imports nothing from tools/): bad input is one
line on stderr and exit code 2, found before the work (the usage is shown only with --help); an empty value is refused
for every flag that takes one (an unset shell variable is not a choice); a value shown in a message has its control
characters escaped and is cut, so that a newline in a path or a 100,000-character value leaves one readable line. A file
a tool reads is checked before it is opened (a FIFO would block the read); a file or folder it writes is checked before
the work that fills it, and written whole, never through a link (runfolder.write_text_atomically, save_figure,
append_line).
"""

import argparse
import json
import os
import re
import stat
import sys
import tempfile

from cegppo_utils import flags
from cegppo_utils.data import UserError, first_line
from cegppo_utils.runfolder import one_line  # the one rule train.py's and evaluate.py's messages follow too

LIMIT = 200  # characters of one value in a message: a long path fits, a 100,000-character value does not
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape(text) -> str:
    """Control characters written as their escapes (a newline as \\n), so that the text stays on one line."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))


def short(value, limit: int = LIMIT) -> str:
    """A value for a message: escaped, and cut to `limit` characters with its length said."""
    text = escape(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


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

def _kind(mode) -> str:
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "an unknown kind of file")


def _what(path: str) -> str:
    """What stands at path, for a message: a file, a symbolic link, a FIFO, ..."""
    mode = os.lstat(path).st_mode
    return "a file" if stat.S_ISREG(mode) else "a symbolic link" if stat.S_ISLNK(mode) else _kind(mode)


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
    UserError naming the flag, the file and what it holds instead of `what`."""
    problem = input_problem(path, flag)
    if problem:
        raise UserError(problem)
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UserError(f"{flag} {short(path)}: not {what} ({type(e).__name__}: {first_line(e)})") from None
    if not isinstance(value, want):
        raise UserError(f"{flag} {short(path)}: not {what} (it holds {_JSON_TYPES.get(type(value), 'null')})")
    return value


def _probe(folder: str) -> str | None:
    """Why no file can be created in the existing folder (None if one can): a fresh file made (O_EXCL) and removed."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def _folder_reason(folder: str, create: bool) -> str | None:
    """Why no file can be written into `folder` (None if one can), said after its name."""
    if os.path.lexists(folder) and not os.path.isdir(folder):
        return f"is {_what(folder)}, not a folder"
    base = os.path.abspath(folder)
    while not os.path.lexists(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    if not os.path.isdir(base):
        return f"cannot be created ({short(base)} is {_what(base)})"
    if not os.path.isdir(folder):
        if not create:  # whoever writes makes it, so that a tool refused later leaves no folder behind
            writable = os.access(base, os.W_OK | os.X_OK)
            return None if writable else f"cannot be created in {short(base)} (permission denied)"
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            return f"cannot be created ({e.strerror})"
    why = _probe(folder)
    return f"takes no file ({why})" if why else None


def folder_problem(folder: str, flag: str, create: bool = False) -> str | None:
    """Why files cannot be written into the folder `folder` (None if they can): a file where it or a folder above it
    should be, a missing folder that cannot be made, or one that takes no file. create: make a missing one now."""
    if not folder:
        return f"{flag}: an empty path"
    reason = _folder_reason(folder, create)
    return reason and f"{flag} {short(folder)} {reason}"


def output_problem(path: str, flag: str, create: bool = False) -> str | None:
    """Why the file `path` cannot be written (None if it can), found before the work that fills it: a link at its name
    (refused: not every tool replaces it), a folder or anything but a regular file there, or a folder for it that
    is missing and cannot be made, or takes no file. create: make a missing folder now."""
    shown = f"{flag} {short(path)}"
    if not path:
        return f"{flag}: an empty path"
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = None  # missing, or a file stands where a folder above it should be (said below)
    if mode is not None and stat.S_ISLNK(mode):
        return f"{shown} is a symbolic link; refusing to write through it (remove it)"
    if mode is not None and stat.S_ISDIR(mode):
        return f"{shown} is a folder; name a file in it"
    if mode is not None and not stat.S_ISREG(mode):
        return f"{shown} is {_kind(mode)}, not a regular file"
    if path.endswith(os.sep) or os.path.basename(path) in (".", ".."):  # a folder's path, made or not yet
        return f"{shown} names a folder; name a file"
    folder = os.path.dirname(os.path.abspath(path))
    reason = _folder_reason(folder, create)
    return reason and f"{shown}: its folder {short(folder)} {reason}"


def outputs_problem(folder: str, names, flag: str) -> str | None:
    """Why the files `names` cannot be written into `folder` (None if they can): a folder standing at one's name. Each
    is written whole by replacing its name (os.replace), which a folder there stops only once the work is done; a
    link there is replaced, never written through."""
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            return f"{flag} {short(folder)}: {name} in it is a folder; move it aside"
    return None
