"""Checkpoints: written whole with their manifest (each shard's size and SHA-256), verified before anything loads from
them, their DCP metadata read without running code; and final/, the policy with the step it holds."""

import os
import pickle
import random
import re
import shutil
import warnings

from cegppo_utils import lazy
from cegppo_utils.data import UserError, first_line
from cegppo_utils.runfolder.files import (
    _causes,
    _interrupt_in,
    _io_failure,
    write_folder_atomically,
    write_json_atomically,
)
from cegppo_utils.runfolder.process import crash_point
from cegppo_utils.runfolder.reading import read_bytes, read_json_object

torch = lazy.module("torch", globals())
D = lazy.module("cegppo_utils.distributed", globals(), "D")


# What the run itself names a checkpoint: step_ and digits. Anything else in checkpoints/ is the user's, never touched.
CHECKPOINT_NAME = re.compile(r"step_[0-9]+")

# torch.distributed.checkpoint warns on every single-process save/load that it assumes a single process: it is one.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# In final/ beside the policy: the step whose policy it is ({"step": N}), so that the finished-run answer is true.
FINAL_RECORD = "ce-gppo-final.json"


def final_step(output_dir: str) -> int | None:
    """The step whose policy output_dir/final holds (its FINAL_RECORD), or None: no final/, or one from before the
    record was kept, a record that is not a step, or not a regular file (read_bytes: a FIFO is never opened)."""
    try:
        step = read_json_object(os.path.join(output_dir, "final", FINAL_RECORD)).get("step")
    except UserError:
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


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
            write_manifest(folder, trainer_state.get("flags"))

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
    import io
    path = os.path.join(folder, ".metadata")
    raw = read_bytes(path)  # a regular file only: a FIFO there would block the read (reading.py)
    if raw is None:
        raise UserError(f"{folder} has no .metadata (an incomplete checkpoint); move that folder aside to resume "
                        "from the one before it")
    try:
        return _MetadataUnpickler(io.BytesIO(raw)).load()
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


def write_manifest(folder, flags: dict | None = None):
    """folder/MANIFEST (rank 0, after every rank's shards are written: dcp.save returns once they are), with the flags
    of the run that wrote it where given: trainer_state.pt holds them too, but is read with torch, and a resume
    compares them with config.json's before torch loads (checkpoint_flags)."""
    files = {name: {"bytes": os.path.getsize(os.path.join(folder, name)), "sha256": _sha256(os.path.join(folder, name))}
             for name in sorted(os.listdir(folder)) if name.endswith(".distcp") or name == ".metadata"}
    write_json_atomically(os.path.join(folder, MANIFEST), {"files": files, **({"flags": flags} if flags else {})})


def checkpoint_flags(folder) -> dict | None:
    """The flags a checkpoint was written with, as its MANIFEST records them (JSON: no torch needed); None where it
    records none (a checkpoint from before it did, or a damaged one: verify_checkpoint says which)."""
    try:
        flags = read_json_object(os.path.join(folder, MANIFEST)).get("flags")
    except UserError:
        return None
    return flags if isinstance(flags, dict) else None


def manifest_holds(folder) -> bool:
    """Whether a checkpoint folder's MANIFEST is one save_checkpoint wrote and its files are there at the sizes it
    records (.metadata and at least one shard): what makes a checkpoint a run's in start.holds_run. Their hashes are
    verified where anything loads from them (verify_checkpoint); sizes are what can be asked of a folder at once."""
    try:
        files = read_json_object(os.path.join(folder, MANIFEST)).get("files")
    except UserError:
        return False
    if not isinstance(files, dict) or ".metadata" not in files or not any(n.endswith(".distcp") for n in files):
        return False
    for name, record in files.items():
        path = os.path.join(folder, os.path.basename(str(name)))
        if not isinstance(record, dict) or not os.path.isfile(path) or os.path.getsize(path) != record.get("bytes"):
            return False
    return True


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


def check_finished(checkpoint_dir):
    """A checkpoint folder still named .tmp (or .old) is one whose write did not finish (or one being replaced)."""
    name = os.path.basename(os.path.normpath(checkpoint_dir))
    if name.endswith((".tmp", ".old")):
        raise UserError(f"{checkpoint_dir} is a checkpoint whose write did not finish (a {name[-4:]} folder); use a "
                        "completed one")


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
