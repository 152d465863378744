"""A run directory has one live run at a time, and a new start never overwrites what an earlier run wrote.

`RunDirLock` holds the run directory for the life of a run: process 0 takes it, every process
learns the outcome, and a second run on the same directory stops with one line naming the holder.
It holds two `flock`s, which the kernel drops when the process dies (a killed run leaves nothing
held): one on the directory itself, which no file deleted or swapped inside it can sidestep, and one
on `run_dir/jaxdist.lock`, which NFS and most shared file systems carry across hosts (a directory's
lock there is only seen on its own host). The lock file is opened without following a symbolic
link (one is refused), checked after locking to be the file at that name (not one deleted or
replaced meanwhile), records the holder (pid, host, start time, command) and is removed when the
run ends. Where the file system has no locks (ENOLCK, EOPNOTSUPP: Lustre without `-o flock`, some
FUSE mounts), the holder recorded in the file decides: a live process on this host, or one on
another host that has not released it, holds the directory; a dead process on this host does not.

`check_history` refuses a fresh start (nothing to resume from) in a directory that holds an earlier
run's metrics, TensorBoard events or set-aside checkpoints; `set_history_aside` moves them into
`run_dir/replaced-<time>/` when the user asks to start over (`jaxdist train --restart`).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import stat
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxdist import atomic
from jaxdist.checkpoint.store import SET_ASIDE_PREFIXES
from jaxdist.errors import UserError
from jaxdist.observe.metrics import METRICS_SET_ASIDE

LOCK_FILE = "jaxdist.lock"
# What a start moves aside with --restart (with the metrics lines set aside: METRICS_SET_ASIDE), and
# what makes a directory hold history.
HISTORY = ("metrics.jsonl", "tb", "checkpoints", "config.yaml", "wandb")
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
# How many times a start opens the lock file again when it was replaced between its open and its lock.
_LOCK_ATTEMPTS = 10
_HOLDER_BYTES = 65536  # at most what a lock file's record is read of


class RunDirLock:
    """Context manager: the exclusive lock on a run directory (see the module docstring).

    Collective: every process enters it; process 0 takes the lock, and all raise the same
    `UserError` if another run holds it."""

    def __init__(self, run_dir: str | Path):
        self.directory = Path(run_dir)
        self.path = self.directory / LOCK_FILE
        self._descriptors: list[int] = []  # held: the directory's, then the lock file's

    def __enter__(self) -> RunDirLock:
        holder, failure = None, None
        if jax.process_index() == 0:
            try:
                holder = self._take()
            except UserError as err:
                failure = err
            except OSError as err:
                failure = UserError(f"run_dir={self.directory}: cannot lock {self.path} ({err.strerror}); "
                                    f"pick a writable run_dir")
        if jax.process_count() > 1:  # every process stops if process 0 could not take it
            taken = np.asarray(multihost_utils.process_allgather(np.int32(holder is None and failure is None)))
            if not taken.reshape(-1)[0] and jax.process_index() != 0:
                holder = _read_holder(self.path) or {}
        if failure is not None:
            raise failure
        if holder is not None:
            raise UserError(f"run_dir={self.directory} is in use by another run ({_describe(holder)}); wait for "
                            f"it to end, or use another run_dir")
        return self

    def _take(self) -> dict[str, Any] | None:
        """Takes the lock; returns the holder instead where another run has it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            directory = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            if _lock(directory, ignore=(*_NO_LOCKS, errno.EBADF)) is False:  # None: held by the file alone
                os.close(directory)
                return _read_holder(self.path) or {}
            self._descriptors.append(directory)
            holder = self._take_file()
        except BaseException:
            self._release()
            raise
        if holder is not None:
            self._release()
        return holder

    def _take_file(self) -> dict[str, Any] | None:
        """Locks the lock file (the holder instead where another run has it) and records this run in it."""
        for _ in range(_LOCK_ATTEMPTS):
            file = self._open_file()
            try:
                locked = _lock(file, ignore=_NO_LOCKS)
            except BaseException:
                os.close(file)
                raise
            if locked is None:  # no locks on this file system: the recorded holder decides
                holder = _read_holder(self.path)
                if holder is not None and _holds(holder):
                    os.close(file)
                    return holder
            elif not locked:
                os.close(file)
                return _read_holder(self.path) or {}
            if _same_file(file, self.path):
                self._descriptors.append(file)
                _write_holder(file, _me())
                return None
            os.close(file)  # deleted or replaced between the open and the lock: open the one there now
        raise UserError(f"run_dir={self.directory}: {self.path} keeps being replaced while it is locked; is "
                        f"something deleting it in a loop?")

    def _open_file(self) -> int:
        try:
            file = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise UserError(f"run_dir={self.directory}: {self.path} is a symbolic link, and jaxdist never writes "
                                f"through one; remove it (a run makes its own lock file)") from None
            raise
        if not stat.S_ISREG(os.fstat(file).st_mode):
            os.close(file)
            raise UserError(f"run_dir={self.directory}: {self.path} is not a regular file; remove it (a run makes "
                            f"its own lock file)")
        return file

    def __exit__(self, *exc) -> None:
        if len(self._descriptors) == 2 and _same_file(self._descriptors[1], self.path):
            try:
                self.path.unlink()  # still locked: a start that opened it meanwhile finds it gone, and retries
            except OSError:
                pass  # the lock goes with the process; a failed cleanup must not hide the run's own error
        self._release()

    def _release(self) -> None:
        while self._descriptors:
            os.close(self._descriptors.pop())  # drops its flock


def _lock(descriptor: int, ignore: tuple[int, ...]) -> bool | None:
    """Takes an exclusive flock: True, False where another holds it, None where the file system has
    none (an error in `ignore`)."""
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno not in ignore:
            raise
        return None
    return True


def _same_file(descriptor: int, path: Path) -> bool:
    """Whether `path` names the file open as `descriptor` (not one that replaced it, nor nothing)."""
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(descriptor)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def _me() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _write_holder(descriptor: int, holder: dict[str, Any]) -> None:
    """Records the holder in the lock file, in place: the lock is that file, so it is never replaced."""
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, (json.dumps(holder) + "\n").encode(), 0)


def _read_holder(path: Path) -> dict[str, Any] | None:
    """The holder a lock file records; None where there is none to read (never through a link)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            holder = json.loads(os.read(descriptor, _HOLDER_BYTES))
        finally:
            os.close(descriptor)
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _holds(holder: dict[str, Any]) -> bool:
    """Whether the run a lock file names still holds it (where the file system has no locks)."""
    if holder.get("released"):  # a run removes its lock file as it ends; earlier versions marked it released
        return False
    if holder.get("host") != socket.gethostname():
        return True  # no way to tell from here: the other host must release it (or the file be deleted)
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return False  # a dead process's lock
    except (KeyError, ValueError, PermissionError):
        return True
    return True


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return f"{LOCK_FILE}, which names it, is missing or unreadable"
    return (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}: "
            f"{holder.get('command')}")


def history(run_dir: Path) -> list[str]:
    """What an earlier run left in `run_dir` that a fresh start would overwrite, in words."""
    found = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and (lines := sum(1 for line in metrics.read_bytes().split(b"\n") if line.strip())):
        found.append(f"metrics.jsonl with {lines} logged steps")
    if (run_dir / "tb").is_dir() and any((run_dir / "tb").glob("events.out.tfevents.*")):
        found.append("TensorBoard events in tb/")
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        aside = sorted(path.name for path in checkpoints.iterdir() if path.name.startswith(SET_ASIDE_PREFIXES))
        if aside:
            found.append(f"set-aside checkpoints ({', '.join(aside)})")
    return found


def check_history(run_dir: Path) -> None:
    """Raises `UserError` where a fresh start in `run_dir` would overwrite an earlier run's files."""
    if found := history(run_dir):
        raise UserError(f"run_dir={run_dir} holds an earlier run's {' and '.join(found)}, and no checkpoint to "
                        f"resume from; a fresh start would overwrite them: pass --restart to move them to "
                        f"{run_dir}/replaced-<time>/ and start over, or use another run_dir")


def set_history_aside(run_dir: Path) -> Path | None:
    """Moves an earlier run's files (`HISTORY`) into `run_dir/replaced-<UTC time>/`; returns that
    folder (None where there was nothing to move). Process 0 moves; call it from process 0 only."""
    present = [run_dir / name for name in HISTORY if (run_dir / name).exists()]
    present += sorted(run_dir.glob(f"{METRICS_SET_ASIDE}*"))
    if not present:
        return None
    folder = atomic.set_aside_path(run_dir, "replaced-")
    folder.mkdir()
    for path in present:
        path.rename(folder / path.name)
    return folder
