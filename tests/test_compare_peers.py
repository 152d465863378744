"""Every `jaxdist bench` run in benchmarks/compare_peers.py's suites has a config that loads.

GPU time is scarce: a misspelt override there would cost a GPU run to find out.
"""

import importlib.util
from pathlib import Path

import pytest

from jaxdist import config

spec = importlib.util.spec_from_file_location("compare_peers", Path(__file__).parents[1] / "benchmarks" / "compare_peers.py")
compare_peers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_peers)

# bench options that take a value (the rest of the arguments after the config are overrides).
VALUE_OPTIONS = {"--devices", "--profile", "--out", "--steps", "--warmup"}


def bench_runs():
    """Each distinct bench argument list of the suites, once."""
    seen = {}
    for suite, runs in compare_peers.suites("peers").items():
        for label, command in runs:
            if "jaxdist.cli" in command:
                seen.setdefault(tuple(command[command.index("bench") + 1:]), f"{suite}/{label}")
    return [pytest.param(list(args), id=name) for args, name in seen.items()]


def overrides_of(args: list[str]) -> list[str]:
    overrides, options = [], iter(args)
    for arg in options:
        if arg in VALUE_OPTIONS:
            next(options)
        else:
            overrides.append(arg)
    return overrides


@pytest.mark.parametrize("args", bench_runs())
def test_suite_configs_load(args):
    cfg = config.load(args[0], overrides_of(args[1:]))
    assert cfg.model.name == "gpt"


def test_every_suite_has_a_jaxdist_run():
    for suite, runs in compare_peers.suites("peers").items():
        assert any("jaxdist.cli" in command for _, command in runs), suite
