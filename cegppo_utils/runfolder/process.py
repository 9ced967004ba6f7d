"""This process as a run sees it: the script the user ran, its messages in one line, the command it was started with
and the one that goes on, and the points where the tests stop it (fault injection)."""

import os
import re
import signal
import sys
import time


def crash_point(name: str):
    """Fault injection for tests: TRAIN_CRASH_AT=<name> (e.g. "update:3") kills this process right here, as kill -9
    would; TRAIN_INTERRUPT_AT=<name> sends it SIGINT; TRAIN_CTRL_C_AT=<name> sends SIGINT to its whole process group
    (its reward workers and fork server too), as Ctrl-C in a terminal does. Does nothing otherwise."""
    if os.environ.get("TRAIN_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("TRAIN_INTERRUPT_AT") == name:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)  # the KeyboardInterrupt lands here, at the next bytecode
    if os.environ.get("TRAIN_CTRL_C_AT") == name:
        os.killpg(os.getpgrp(), signal.SIGINT)
        time.sleep(1.0)
    if os.environ.get("TRAIN_TERMINATE_AT") == name:  # as `kill` or a scheduler's preemption would
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)


def _program() -> str:
    """The script the user ran (train.py, evaluate.py, runfolder.py), for messages that name it."""
    path = sys.argv[0] if sys.argv and sys.argv[0] else ""
    name = os.path.basename(path)
    if name == "__main__.py" and os.path.basename(os.path.dirname(path)) == "runfolder":  # python -m its package
        return "runfolder.py"
    return name if name.endswith(".py") and name != "__main__.py" else "train.py"


def one_line(message: str, longest: int = 400, total: int = 4000) -> str:
    """An error message as one readable line: control characters escaped, C0, DEL and C1 (U+0085 is a newline to some
    readers) and the line and paragraph separators U+2028 and U+2029 (a newline in a path would split it), a word
    longer than `longest` characters cut to its start and its length (a 100,000-character value), and the whole cut in
    its middle to `total` characters (the way out is said last)."""
    text = re.sub(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]", lambda m: m.group().encode("unicode_escape").decode("ascii"),
                  str(message))
    def cut(word):  # its punctuation kept: "--model X: no such" stays readable as such
        body = word.rstrip(":;,.)'\"")
        return f"{body[:80]}... ({len(body)} characters){word[len(body):]}"
    text = re.sub(r"\S{%d,}" % (longest + 1), lambda m: cut(m.group()), text)
    if len(text) > total:
        text = f"{text[:total // 2]} ... ({len(text) - total} characters left out) ... {text[-total // 2:]}"
    return text


def resume_command(output_dir: str) -> str:
    """The command that continues the run in output_dir, as this process was started: its python and train.py as
    typed (under torchrun, its launch on one node). The run reads its own config.json, so no other flag is needed."""
    import shlex
    return f"{_launch()} --resume {shlex.quote(output_dir)}"


def start_command() -> str:
    """The command this process was started with (its launch, then its flags as typed), quoted for a shell."""
    import shlex
    return " ".join([_launch()] + [shlex.quote(a) for a in sys.argv[1:]])


def _launch() -> str:
    """This process's python and train.py as typed, or under torchrun its launch on one node."""
    import shlex
    script = sys.argv[0] if sys.argv and os.path.basename(sys.argv[0]) == "train.py" else "train.py"
    inside = os.path.abspath(sys.executable).startswith(os.getcwd() + os.sep)
    python = os.path.relpath(sys.executable) if inside else sys.executable
    world, local = os.environ.get("WORLD_SIZE", "1"), os.environ.get("LOCAL_WORLD_SIZE", "1")
    if world == "1":
        return f"{shlex.quote(python)} {shlex.quote(script)}"
    if world == local:  # one node
        return f"torchrun --nproc-per-node={world} {shlex.quote(script)}"
    return f"torchrun <this run's launch flags> {shlex.quote(script)}"


LIMIT = 200  # characters of one value in a message: a long path fits, a 100,000-character value does not

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")



def escape(text) -> str:
    """Control characters written as their escapes (a newline as \\n), so that the text stays on one line."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))



def short(value, limit: int = LIMIT) -> str:
    """A value for a message: escaped, and cut to `limit` characters with its length said."""
    text = escape(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"

