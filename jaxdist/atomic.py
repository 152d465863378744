"""Files jaxdist replaces are written beside and renamed (atomically), never cut off.

`replacing(path)` hands out a new file in the same folder to write the new content into; once it is
written it is flushed to disk and renamed over `path` (`os.replace`, atomic on a POSIX file
system), so a kill at any moment leaves the old file or the new one. A write that fails (a full
disk) removes the new file, leaves the old one as it was, and is one line (`UserError`) naming
`path` and the reason. The rename replaces a symbolic link at `path` itself: nothing is ever written
through one.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from jaxdist.errors import UserError

# What a file being written beside its final name is called: `.NAME.<random>.partial`, hidden. One
# left behind by a killed process is a half-written copy that nothing reads; delete it at will.
PARTIAL_SUFFIX = ".partial"


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A new, empty file beside `path` (yielded) that becomes `path` when the block completes.

    Write the new content into it in the block; then it is flushed to disk and renamed over `path`.
    On any error it is removed and `path` is left as it was; an `OSError` (a full disk, a folder
    that cannot be written) is raised as a `UserError` naming `path`."""
    path = Path(path)
    with _reporting(path):
        partial = _new_file_beside(path)
    try:
        with _reporting(path):
            yield partial
            _flush_to_disk(partial)
            os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _flush_folder(path.parent)


def write_bytes(path: str | Path, data: bytes) -> None:
    """Replaces `path` with `data` (see `replacing`)."""
    with replacing(path) as partial:
        partial.write_bytes(data)


def write_text(path: str | Path, text: str) -> None:
    """Replaces `path` with `text`, UTF-8 encoded (see `replacing`)."""
    write_bytes(path, text.encode("utf-8"))


def set_aside_path(folder: Path, prefix: str) -> Path:
    """A name no file in `folder` has, for something set aside there: `<prefix><UTC time>`, with
    `-2`, `-3`, ... after it where that is taken."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    path = folder / f"{prefix}{stamp}"
    for copy in itertools.count(2):
        if not os.path.lexists(path):
            return path
        path = folder / f"{prefix}{stamp}-{copy}"


def _new_file_beside(path: Path) -> Path:
    """A new empty file in `path`'s folder, with the permissions a plain new file gets (the umask's)."""
    while True:
        partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}{PARTIAL_SUFFIX}")
        try:
            os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
            return partial
        except FileExistsError:
            continue


def _flush_to_disk(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _flush_folder(folder: Path) -> None:
    """Makes the rename itself durable where the file system can sync a folder (the file is whole either way)."""
    with contextlib.suppress(OSError):
        descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


@contextlib.contextmanager
def _reporting(path: Path) -> Iterator[None]:
    """An `OSError` inside is one line naming `path`: the old file, if any, is untouched."""
    try:
        yield
    except OSError as err:
        kept = "; the file there is left as it was" if path.exists() else ""
        raise UserError(f"could not write {path} ({err.strerror or err}){kept}; free space there or fix the folder, "
                        f"then run again") from None
