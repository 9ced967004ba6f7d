"""Where a program writes: one check of an output path, made before any work, for every tool (tools/cli.py), and the
probe that asks the file system whether a folder takes a file."""

import os
import stat
import tempfile

from cegppo_utils.runfolder.process import short


def _kind(mode) -> str:
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "an unknown kind of file")



def _what(path: str) -> str:
    """What stands at path, for a message: a file, a symbolic link, a FIFO, ..."""
    mode = os.lstat(path).st_mode
    return "a file" if stat.S_ISREG(mode) else "a symbolic link" if stat.S_ISLNK(mode) else _kind(mode)



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

