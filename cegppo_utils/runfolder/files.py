"""Files written whole and never through a link, for the run and for the research tools (tools/, plot.py): a file
replaced by renaming a fresh temporary one over it, a line appended to a regular file of its own, a folder written
beside its place and renamed into it; and what a failed write says (a full disk, a read-only mount)."""

import contextlib
import errno
import json
import os
import shutil
import stat

from cegppo_utils import lazy
from cegppo_utils.data import UserError
from cegppo_utils.runfolder.process import _program

D = lazy.module("cegppo_utils.distributed", globals(), "D")


def open_for_writing(path, what, mode="w"):
    """The one way a file is opened in place for writing (a lock, a marker, a log): a file object on the regular file
    `path`, created if missing, never through a symbolic link (O_NOFOLLOW), never a FIFO or device (O_NONBLOCK, then
    checked), never a file with other hard links (writing it would write them); anything else is a UserError naming
    it, after `what` (the flag or file it is). mode: "w" empties it (once checked), "a" appends, "r+" keeps what it
    holds; "b" for binary. A file written whole goes through write_file_atomically instead."""
    fd = _open_regular(path, what, append="a" in mode)
    if "w" in mode:
        os.ftruncate(fd, 0)
    return os.fdopen(fd, mode.replace("w", "r+") if "w" in mode else mode,
                     encoding=None if "b" in mode else "utf-8")


def _open_regular(path, what, append=False):
    """A descriptor for open_for_writing (the rules it says)."""
    if os.path.islink(path):
        raise UserError(f"{what}: {path} is a symbolic link; refusing to follow it (remove it)")
    flags_ = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    flags_ |= os.O_APPEND if append else 0
    try:
        fd = os.open(path, flags_, 0o666)  # less the umask, as open() creates a file
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{what}: {path} is a symbolic link; refusing to follow it (remove it)") from None
        if e.errno == errno.EISDIR:
            raise UserError(f"{what}: {path} is a folder, not a regular file; refusing to write it") from None
        raise UserError(f"{what}: cannot write {path} ({e.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        kind = "not a regular file" if not stat.S_ISREG(info.st_mode) else f"a file with {info.st_nlink} hard links"
        raise UserError(f"{what}: {path} is {kind}; refusing to write it (remove it)")
    return fd


def _append(path, text):
    with open_for_writing(path, os.path.basename(path), "a") as f:
        f.write(text)


def write_json_atomically(path: str, obj):
    write_text_atomically(path, json.dumps(obj, indent=1, default=str))


def write_text_atomically(path: str, text: str):
    """path holds `text` (UTF-8), whole, or its old content (write_file_atomically); gzip'd where its name ends in .gz
    (gzip_bytes), as reading.gunzip and cli.read_json read it back."""
    data = text.encode("utf-8")
    data = gzip_bytes(data) if path.endswith(".gz") else data
    write_file_atomically(path, lambda f: f.write(data))


def gzip_bytes(data: bytes) -> bytes:
    """`data` as one gzip member that depends on the bytes alone: modification time 0 and no file name in the
    header, so the same JSON gives the same file (and an unchanged study an unchanged commit). GzipFile writes the
    same header on every Python the project supports; gzip.compress's differs between 3.11 and 3.12 (its OS byte)."""
    import gzip
    import io
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buffer, mtime=0) as f:
        f.write(data)
    return buffer.getvalue()


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


def writable(folder) -> bool:
    """Whether a folder can be created in `folder`, asked of the file system by creating one: os.access reads the
    modes, which root passes, and a FUSE mount without an access handler (sshfs, say) answers yes to anything."""
    import tempfile
    try:
        tempfile.TemporaryDirectory(dir=folder).cleanup()
        return True
    except OSError:
        return False


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
