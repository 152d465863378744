"""`profile.start_step` / `profile.steps`: the train loop traces those steps into run_dir/profile."""

import jax
import pytest
from conftest import make_config

from jaxdist import loop

pytestmark = pytest.mark.slow


def test_a_profiled_window_leaves_a_trace(tmp_path):
    cfg = make_config(tmp_path, train={"steps": 4, "global_batch": 8}, profile={"start_step": 2, "steps": 2})
    loop.train(cfg, devices=jax.devices()[:1])
    traces = tmp_path / "profile" / "process_0"
    assert list(traces.rglob("perfetto_trace.json.gz")), "no Perfetto trace"
    assert list(traces.rglob("*.xplane.pb")), "no TensorBoard profile"


def test_no_trace_by_default(tmp_path):
    loop.train(make_config(tmp_path, train={"steps": 2, "global_batch": 8}), devices=jax.devices()[:1])
    assert not (tmp_path / "profile").exists()


def test_a_window_past_the_last_step_is_a_warning(tmp_path, capsys):
    cfg = make_config(tmp_path, train={"steps": 2, "global_batch": 8}, profile={"start_step": 10, "steps": 2})
    loop.train(cfg, devices=jax.devices()[:1])
    warning = ("jaxdist: warning: nothing was profiled: profile.start_step=10 is past step 2, the last this run "
               "took\n")
    assert capsys.readouterr().err.count(warning) == 1
    assert not (tmp_path / "profile").exists()
