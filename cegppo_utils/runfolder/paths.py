"""Where a program writes: one check of an output path, made whole before any work (and before torch loads), for
train.py's run folder, evaluate.py's results and every tool's outputs (cegppo_utils/cli.py). It says, in one line, what
stands in the way: an empty path, a file's name that names a folder (a trailing /), a name longer than the file system
takes, a file (or a FIFO, a broken link, ...) where a folder must be, something other than what is meant at the name
itself, or a missing folder that cannot be made where it would go. It makes nothing: a program refused later leaves no
folder behind. The probes it writes (a file, a folder) are removed whatever happens, a signal included.
"""

import contextlib
import errno
import os
import signal
import stat
import sys
import threading

from cegppo_utils.runfolder.process import short

NAME_MAX, PATH_MAX = 255, 4096  # bytes, where the file system does not say (Linux's)
# linux/fs.h: the ioctl that reads a file's attributes (chattr's), and the two that stop a rename replacing it
FS_IOC_GETFLAGS, FS_IMMUTABLE_FL, FS_APPEND_FL = 0x80086601, 0x10, 0x20


@contextlib.contextmanager
def signals_held():
    """SIGINT and SIGTERM held while the block runs, then acted on as they would have been: a stop in the middle of a
    probe would leave its file, and a folder holding it is refused as the user's. In the main thread only (the only
    one whose handlers Python runs); elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for signum, frame in caught[:1]:
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


def _create_probe(path: str) -> int:
    """A fresh file at path (O_EXCL: never one that was there, never through a link)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)


def probe(folder: str) -> str | None:
    """Why no file can be created in the existing `folder` (None if one can), asked of the file system: a fresh file
    created and removed (os.access reads the modes, which root passes, and a FUSE mount may answer yes to anything).
    The file is removed in any case (a failure after it was made, a signal: signals_held)."""
    path = os.path.join(folder, f".write-test-{os.urandom(4).hex()}")
    failure = None
    with signals_held():
        try:
            os.close(_create_probe(path))
        except OSError as e:
            failure = e
        finally:
            if not (isinstance(failure, OSError) and failure.errno == errno.EEXIST):  # not ours: left as it was
                with contextlib.suppress(OSError):
                    os.remove(path)
    return None if failure is None else failure.strerror or type(failure).__name__


def _kind(mode) -> str:
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "an unknown kind of file")


def _what(path: str) -> str:
    """What stands at path, for a message: a file, a symbolic link, a FIFO, ..."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return "a symbolic link" if os.path.exists(path) else "a broken symbolic link"
    return "a file" if stat.S_ISREG(mode) else _kind(mode)


def _limits(path: str) -> tuple[int, int]:
    """(the longest name, the longest path) in bytes where path would go, asked of its nearest existing folder."""
    folder = os.path.abspath(path)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    limits = []
    for name, default in (("PC_NAME_MAX", NAME_MAX), ("PC_PATH_MAX", PATH_MAX)):
        try:
            limits.append(os.pathconf(folder, name) or default)
        except (OSError, ValueError):
            limits.append(default)
    return limits[0], limits[1]


def length_problem(path: str) -> str | None:
    """A name in path longer than the file system takes, or the whole path longer (None if neither)."""
    name_max, path_max = _limits(path)
    whole = os.fsencode(os.path.abspath(path))
    long = next((part for part in whole.split(b"/") if len(part) > name_max), None)
    if long is not None:
        return (f"has a name of {len(long)} bytes ({short(os.fsdecode(long), 40)}); the file system takes at most "
                f"{name_max}")
    if len(whole) >= path_max:
        return f"is {len(whole)} bytes long; the file system takes paths of fewer than {path_max}"
    return None


def _folder_reason(folder: str, create: bool) -> str | None:
    """Why no file can be written into `folder` (None if one can), said after its name. create: make it now if it
    is missing (a tool that writes at once); else nothing is made, and its nearest existing folder must take one."""
    why = length_problem(folder)
    if why:
        return why
    if os.path.lexists(folder) and not os.path.isdir(folder):
        return f"is {_what(folder)}, not a folder"
    base = os.path.abspath(folder)
    while not os.path.lexists(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    if not os.path.isdir(base):
        return f"cannot be created ({short(base)} is {_what(base)})"
    if not os.path.isdir(folder):
        if not create:  # whoever writes makes it, so that a program refused later leaves no folder behind
            why = probe(base)
            return f"cannot be created in {short(base)} ({why})" if why else None
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            return f"cannot be created ({e.strerror})"
    why = probe(folder)
    return f"takes no file ({why})" if why else None


def folder_problem(folder: str, flag: str, create: bool = False) -> str | None:
    """Why files cannot be written into the folder `folder` (None if they can): a name too long, a file where it or a
    folder above it should be, a missing folder that cannot be made, or one that takes no file. create: make a missing
    one now."""
    if not folder:
        return f"{flag}: an empty path"
    reason = _folder_reason(folder, create)
    return reason and f"{flag} {short(folder)} {reason}"


def output_problem(path: str, flag: str, create: bool = False) -> str | None:
    """Why the file `path` cannot be written (None if it can), found before the work that fills it: a link at its name
    (refused: not every program replaces it), a folder or anything but a regular file there, a path that names a
    folder (a trailing /, . or ..), a name too long, or a folder for it that is missing and cannot be made, or takes
    no file. create: make a missing folder now."""
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
    why = length_problem(path)
    if why:
        return f"{shown} {why}"
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


def replace_problem(path: str, flag: str) -> str | None:
    """Why a file renamed over the existing regular file `path` would fail (None if it would not), asked before the
    work and without touching the file: a fresh file renamed over another fresh one in its folder (the folder's
    permissions, a read-only mount), the file's own immutable or append-only attribute (chattr +i or +a: the kernel
    refuses to replace it), and a sticky folder (/tmp) where the file is another user's."""
    shown = f"{flag} {short(path)}"
    folder = os.path.dirname(os.path.abspath(path))
    why = _rename_trial(folder)
    if why:
        return f"{shown} cannot be replaced: a rename in its folder fails ({why})"
    attributes = _attributes(path)
    if attributes & (FS_IMMUTABLE_FL | FS_APPEND_FL):
        kind, letter = ("immutable", "i") if attributes & FS_IMMUTABLE_FL else ("append-only", "a")
        return f"{shown} is {kind} (chattr +{letter}): it cannot be replaced; chattr -{letter} it, or name another"
    folder_info, info, me = os.stat(folder), os.lstat(path), os.geteuid()
    if folder_info.st_mode & stat.S_ISVTX and me != 0 and me not in (folder_info.st_uid, info.st_uid):
        return f"{shown} is another user's file in a sticky folder ({short(folder)}); it cannot be replaced"
    return None


def _rename_trial(folder: str) -> str | None:
    """Why a rename over a file fails in `folder` (None if it does not): two fresh files made, one renamed over the
    other, both removed whatever happens (a signal included: signals_held)."""
    import tempfile
    made, failure = [], None
    with signals_held():
        try:
            for _ in range(2):
                fd, name = tempfile.mkstemp(dir=folder, prefix=".replace-test-")
                made.append(name)
                os.close(fd)
            os.replace(made[0], made[1])
            made.pop(0)
        except OSError as e:
            failure = e.strerror or type(e).__name__
        finally:
            for name in made:
                with contextlib.suppress(OSError):
                    os.remove(name)
    return failure


def _attributes(path: str) -> int:
    """The file's attributes (chattr's flags); 0 where they cannot be read (not Linux, a file system without them,
    a file this user cannot open)."""
    if not sys.platform.startswith("linux"):
        return 0
    import fcntl
    import struct
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return 0
    try:
        flags = bytearray(8)
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
        return struct.unpack_from("i", flags)[0]  # the kernel writes an int, whatever the ioctl's declared size
    except OSError:
        return 0
    finally:
        os.close(fd)
