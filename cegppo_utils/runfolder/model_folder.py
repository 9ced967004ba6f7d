"""Model folders (HF format): whole before a model loads from one."""

import json
import os

from cegppo_utils.data import UserError
from cegppo_utils.runfolder.reading import read_json_object


def _is_model_folder(folder, names) -> bool:
    weights = any(n.endswith((".safetensors", ".bin", ".safetensors.index.json")) or n == "model.pt" for n in names)
    return "config.json" in names and weights


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
    import stat
    import struct
    try:
        if not stat.S_ISREG(os.stat(file).st_mode):  # a FIFO there would block the read
            raise UserError(f"{flag} {file}: not a regular file")
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
