"""A run directory has one live run at a time, and a new start never overwrites what an earlier run wrote.

`RunDirLock` holds an exclusive lock on `run_dir/jaxdist.lock` for the life of a run: process 0
takes it (an `flock`, which NFS and most shared file systems carry across hosts and the kernel drops
when the process dies, so a crashed run leaves no stale lock), every process learns the outcome, and
a second run on the same directory stops with one line naming the holder. Where the file system
has no locks (ENOLCK, EOPNOTSUPP: Lustre without `-o flock`, some FUSE mounts), the holder recorded
in the file decides: a live process on this host, or one on another host that has not released it,
holds the directory; a dead process on this host does not.

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


class RunDirLock:
    """Context manager: the exclusive lock on a run directory (see the module docstring).

    Collective: every process enters it; process 0 takes the lock, and all raise the same
    `UserError` if another run holds it."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._file = None

    def __enter__(self) -> RunDirLock:
        holder, failure = None, None
        if jax.process_index() == 0:
            try:
                holder = self._take()
            except OSError as err:
                failure = UserError(f"run_dir={self.path.parent}: cannot lock {self.path} ({err.strerror}); "
                                    f"pick a writable run_dir")
        if jax.process_count() > 1:  # every process stops if process 0 could not take it
            taken = np.asarray(multihost_utils.process_allgather(np.int32(holder is None and failure is None)))
            if not taken.reshape(-1)[0] and jax.process_index() != 0:
                holder = _read_holder(self.path) or {}
        if failure is not None:
            raise failure
        if holder is not None:
            raise UserError(f"run_dir={self.path.parent} is in use by another run ({_describe(holder)}); wait for "
                            f"it to end, or use another run_dir")
        return self

    def _take(self) -> dict[str, Any] | None:
        """Takes the lock; returns the holder instead where another run has it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a+")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            return _read_holder(self.path) or {}
        except OSError as err:
            if err.errno not in _NO_LOCKS:
                file.close()
                raise
            holder = _read_holder(self.path)
            if holder is not None and _holds(holder):
                file.close()
                return holder
        self._file = file
        _write_holder(file, {**_me(), "released": False})
        return None

    def __exit__(self, *exc) -> None:
        if self._file is None:
            return
        try:
            _write_holder(self._file, {**_me(), "released": True})
        except OSError:
            pass  # the lock itself goes with the file; a full disk must not hide the run's own error
        finally:
            self._file.close()  # drops the flock
            self._file = None


def _me() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _write_holder(file, holder: dict[str, Any]) -> None:
    file.seek(0)
    file.truncate()
    file.write(json.dumps(holder) + "\n")
    file.flush()


def _read_holder(path: Path) -> dict[str, Any] | None:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _holds(holder: dict[str, Any]) -> bool:
    """Whether the run a lock file names still holds it (where the file system has no locks)."""
    if holder.get("released"):
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
        return "its lock file could not be read"
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
