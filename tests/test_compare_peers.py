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
    assert cfg.model.name in ("gpt", "resnet")


def test_every_suite_has_a_jaxdist_run():
    for suite, runs in compare_peers.suites("peers").items():
        assert any("jaxdist.cli" in command for _, command in runs), suite


def test_the_table_holds_a_peer_that_reports_no_mfu():
    # torch_resnet.py's line and jaxdist bench's for the ResNet: images per second, MFU on one side only.
    results = [{"label": "torch resnet50 b256", "step_ms": 37.8, "images_per_s_per_gpu": 6778, "peak_mem_GiB": 10.56},
               {"label": "jaxdist resnet50", "step_ms": 36.1, "examples_per_sec_per_device": 7091, "mfu": 0.351,
                "peak_mem_gib": 11.52}]
    rows = compare_peers.table(results).splitlines()
    assert rows[1].split() == ["torch", "resnet50", "b256", "37.8", "6,778", "10.56", "1.000"]
    assert rows[2].split() == ["jaxdist", "resnet50", "36.1", "7,091", "0.351", "11.52", "1.046"]
