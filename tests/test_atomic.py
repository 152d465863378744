"""A file jaxdist replaces is the old one or the new one, never one cut off; a full disk is one line."""

import errno
import os
import stat

import pytest

from jaxdist import atomic
from jaxdist.errors import UserError


def test_a_disk_full_at_the_flush_leaves_the_old_file_and_nothing_beside_it(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    path.write_text("old\n")

    def full(descriptor):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UserError) as raised:
        atomic.write_text(path, "new\n" * 1000)
    assert str(raised.value) == (f"could not write {path} (No space left on device); the file there is left as it "
                                 f"was; free space there or fix the folder, then run again")
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["config.yaml"]


def test_an_error_while_writing_leaves_the_old_file(tmp_path):
    path = tmp_path / "model.npz"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic.replacing(path) as partial:
        partial.write_bytes(b"half of the new")
        raise RuntimeError("the writer failed")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["model.npz"]


def test_a_link_in_the_way_is_replaced_never_written_through(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("not jaxdist's\n")
    path = tmp_path / "metrics.jsonl"
    path.symlink_to(target)
    atomic.write_text(path, "new\n")
    assert not path.is_symlink() and path.read_text() == "new\n"
    assert target.read_text() == "not jaxdist's\n"


def test_a_new_file_gets_the_permissions_the_umask_gives(tmp_path):
    previous = os.umask(0o027)
    try:
        atomic.write_text(tmp_path / "config.yaml", "seed: 0\n")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "config.yaml").stat().st_mode) == 0o640
