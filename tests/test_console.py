"""What process 0 shows: its versions first, a line per checkpoint, plain step lines off a terminal (a live
bar on one), a summary."""

import io
import re
import sys

import pytest
from conftest import make_config
from rich.console import Console

from jaxdist import loop
from jaxdist.observe import console

pytestmark = pytest.mark.slow


def test_plain_lines_when_stdout_is_not_a_terminal(tmp_path, capsys):
    loop.train(make_config(tmp_path / "run", train={"steps": 3}, checkpoint={"every": 2}))
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"jaxdist \S.*, jax \S+; 1 process\(es\), 8 cpu devices", out[0]), out  # the versions first
    assert any(re.match(r"[\d,]+ parameters, [\d.]+ MB of them per device; global batch 16, 2 per device", line)
               for line in out), out  # fsdp=8: 8 batch shards
    assert [int(line.split()[1]) for line in out if re.match(r"step +\d+ +loss", line)] == [1, 2, 3]
    saved = [line for line in out if line.startswith("saved checkpoint step")]
    assert saved == [f"saved checkpoint step {s} in {tmp_path / 'run' / 'checkpoints' / str(s)}" for s in (2, 3)]
    assert any(re.fullmatch(r"trained 3 steps; steady [\d,.]+ ms a step, [\d,]+ tokens/s; last loss [\d.]+", line)
               for line in out), out  # no MFU where the device's peak is unknown (CPU)
    assert any(re.match(r"goodput \d+\.\d% \([\d.]+ s of steps in [\d.]+ s; \d+\.\d% from the first step to the last, "
                        r"start-up and the last checkpoint's write left out\); the rest: ", line) for line in out), out
    assert f"last checkpoint: step 3 in {tmp_path / 'run' / 'checkpoints'}" in out


def test_live_progress_on_a_terminal(tmp_path, capsys, monkeypatch):
    screen = io.StringIO()
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(console, "Console", lambda: Console(file=screen, force_terminal=True, width=120))
    loop.train(make_config(tmp_path / "run", train={"steps": 4}, log={"every": 2}))
    shown = screen.getvalue()
    assert "step 4/4" in shown and "loss" in shown and "tokens/s" in shown
    assert not re.search(r"^step +\d+ +loss", capsys.readouterr().out, re.MULTILINE)  # the bar replaces the lines


def test_the_version_line_of_a_source_tree_that_is_not_installed(monkeypatch):
    # PYTHONPATH=. on a checkout: no package metadata, and the run still starts.
    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    line = console.version_line(processes=1, devices=8, platform="cpu")
    assert re.fullmatch(r"jaxdist \(not installed, from .+\), jax \S+; 1 process\(es\), 8 cpu devices", line), line
