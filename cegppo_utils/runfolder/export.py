"""A checkpoint's policy as an HF model folder: exported beside it or into the export cache, and the command line
`python -m cegppo_utils.runfolder export CHECKPOINT OUT` / `cache [--clear]`."""

import contextlib
import os
import time

from cegppo_utils import lazy
from cegppo_utils.data import UserError, first_line
from cegppo_utils.runfolder.checkpoints import _dcp_load, check_finished, is_checkpoint, verify_checkpoint
from cegppo_utils.runfolder.files import _remove, writable, write_folder_atomically, write_json_atomically
from cegppo_utils.runfolder.model_folder import _is_model_folder, check_model_folder
from cegppo_utils.runfolder.paths import length_problem
from cegppo_utils.runfolder.process import one_line
from cegppo_utils.runfolder.reading import read_json_object
from cegppo_utils.runfolder.start import _has_marker

torch = lazy.module("torch", globals())


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
            record = read_json_object(os.path.join(path, EXPORT_RECORD))
        except UserError:  # none, or not the cache's own: the export is listed without its checkpoint
            record = {}
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


def check_export_target(out_dir, overwrite: bool):
    """Where `cegppo_utils.runfolder export` may write: a new or empty folder, or with --overwrite an earlier export
    (a model folder, replaced whole); never a file, a run folder, a checkpoint folder or the root."""
    real = os.path.realpath(out_dir)
    if os.path.dirname(real) == real:
        raise UserError(f"{out_dir} is the root of the file system")
    why = length_problem(out_dir)  # found before the checkpoint is verified and exported, not when it is written
    if why:
        raise UserError(f"{out_dir} {why}")
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"{out_dir} exists and is not a folder; name a new folder")
    if not os.path.isdir(os.path.dirname(real)):
        there = "is not a folder" if os.path.lexists(os.path.dirname(real)) else "does not exist"
        raise UserError(f"{out_dir}: its folder {os.path.dirname(real)} {there}")
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


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(prog="python -m cegppo_utils.runfolder", description="The run folder's tools.")
    parser.error = lambda message: parser.exit(2, f"runfolder.py: error: {one_line(message)}\n")
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
