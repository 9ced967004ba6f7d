"""One run per output folder: the lock a run holds for its life, and the question whether a live run holds one."""

import errno
import json
import os
import socket
import stat
import sys
import time

from cegppo_utils.data import UserError
from cegppo_utils.runfolder.files import _identity, _missing_folders, open_for_writing
from cegppo_utils.runfolder.paths import folder_problem
from cegppo_utils.runfolder.start import RUN_MARKER, _has_marker, check_output_folder


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
    problem = folder_problem(output_dir, "--output-dir")  # a name too long, a file in the way: before anything is made
    if problem:
        raise UserError(problem)
    path = os.path.join(output_dir, ".lock")
    created = _missing_folders(output_dir)
    try:
        os.makedirs(output_dir, exist_ok=True)
        created += [] if os.path.lexists(path) else [path]
        handle = open_for_writing(path, flag, "r+")  # not emptied: the holder's note is read first
    except (OSError, UserError) as e:
        OutputLock(path, None, created).undo()  # the folders made for it go too
        raise e if isinstance(e, UserError) else UserError(f"{flag}: cannot write there ({e.strerror})") from None
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
            with open_for_writing(os.path.join(output_dir, RUN_MARKER), flag) as f:
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


def _lock_note(text) -> str:
    try:
        note = json.loads(text)
        return f"pid {note['pid']} on {note['host']}, started {note['started']}"
    except (ValueError, KeyError, TypeError):
        return text.strip()[:200]
