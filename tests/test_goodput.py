"""Principle 11: a save costs the loop only its copy off the devices, and a run's summary and metrics
keep the steady step rate apart from what start-up, saves, evaluation and input cost."""

import json
import re
import time

import jax
import numpy as np
import pytest
from conftest import make_config, undocumented_metrics

from jaxdist import cli, loop
from jaxdist.checkpoint import Checkpoints, abstract_state
from jaxdist.checkpoint.store import HOST_COPIES
from jaxdist.observe.goodput import RunTime
from jaxdist.parallel.mesh import make_mesh
from jax.sharding import NamedSharding, PartitionSpec

pytestmark = pytest.mark.slow

ONE_DEVICE = {"mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "rules": {"preset": "fsdp"}}
SLOW_WRITE_S = 2.0


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_slow_write_does_not_hold_up_the_steps(tmp_path, monkeypatch, capsys):
    """A file system that takes 2 s per checkpoint: the loop goes on stepping while each is written,
    says "saved" only once it is complete, and its step times and goodput do not count the writes."""
    write = Checkpoints._write

    def slow_write(self, *args):
        time.sleep(SLOW_WRITE_S)
        return write(self, *args)

    monkeypatch.setattr(Checkpoints, "_write", slow_write)
    run_dir = tmp_path / "run"
    started = time.perf_counter()
    loop.train(make_config(run_dir, **ONE_DEVICE, train={"steps": 12}, checkpoint={"every": 6}),
               devices=jax.devices()[:1])
    wall = time.perf_counter() - started
    out = capsys.readouterr().out.splitlines()
    logged = [r for r in records(run_dir)]
    blocked = [r["save_blocked_s"] for r in logged if "save_blocked_s" in r]
    assert len(blocked) == 1 and blocked[0] < SLOW_WRITE_S / 4, blocked  # the save at 6 (12 is the last)
    assert max(r["step_time_s"] for r in logged[1:]) < SLOW_WRITE_S / 4
    # The "saved" line comes once the write is complete: after the steps that ran beside it.
    saved_at = next(i for i, line in enumerate(out) if line.startswith("saved checkpoint step 6 "))
    stepped = [int(line.split()[1]) for line in out[:saved_at] if re.match(r"step +\d+ +loss", line)]
    assert max(stepped) > 6, out
    with Checkpoints(run_dir / "checkpoints", create=False) as store:
        assert store.steps() == [6, 12]
    summary = next(line for line in out if line.startswith("goodput "))
    last_write = float(re.search(r"the last checkpoint's write ([\d.]+) s", summary).group(1))
    assert last_write >= SLOW_WRITE_S * 0.9 and wall > 2 * SLOW_WRITE_S


def test_metrics_keep_the_steps_apart_from_saves_evaluation_and_start_up(tmp_path, monkeypatch, capsys):
    save = loop.RunCheckpoints.save

    def blocking_save(self, *args, **kwargs):
        time.sleep(1.0)  # the loop's part of a save, as a slow host copy would make it
        return save(self, *args, **kwargs)

    monkeypatch.setattr(loop.RunCheckpoints, "save", blocking_save)
    run_dir = tmp_path / "run"
    loop.train(make_config(run_dir, **ONE_DEVICE, train={"steps": 6}, log={"every": 2}, eval={"every": 4},
                           checkpoint={"every": 2}), devices=jax.devices()[:1])
    logged = records(run_dir)
    assert [r["step"] for r in logged] == [1, 2, 4, 6]
    first = logged[0]
    assert {"startup_compile_s", "startup_trace_s", "startup_init_s", "startup_warm_up_s"} <= set(first)
    assert all(0 < r["goodput"] <= 1 for r in logged)
    for r in logged[2:]:  # intervals with a save of 1 s in them: counted apart, not as step time
        assert r["save_blocked_s"] >= 1.0 and r["step_time_s"] < 0.5, r
    assert "eval_time_s" in logged[2] and "eval_loss" in logged[2]
    assert undocumented_metrics({key for record in logged for key in record}) == set()
    out = capsys.readouterr().out
    summary = next(line for line in out.splitlines() if line.startswith("goodput "))
    saves = float(re.search(r", saves ([\d.]+) s", summary).group(1))
    assert saves >= 2.0  # the saves at steps 2 and 4 (6 is the last, whose save waits too)
    steady = next(line for line in out.splitlines() if line.startswith("trained 6 steps; steady "))
    assert float(re.search(r"steady ([\d,.]+) ms", steady).group(1).replace(",", "")) < 500


def test_goodput_accounts_the_wall_time_by_cause():
    clock = RunTime(started=100.0)
    clock.add("compile", 5.0)
    clock.add("last_write", 2.0)
    clock.add("saves", 1.0)
    clock.interval(1, 1.5, 0.0, first=True)  # the first step: 0.5 s over the steady 1 s
    clock.interval(5, 1.0, 0.0)
    clock.interval(5, 1.2, 0.8)
    assert clock.steps == 11 and clock.steady_step_s() == pytest.approx(1.1)  # the median of 1.0 and 1.2
    summary = clock.summary(now=120.0)
    # Steps at 1.1 s, the first 5 at their own 1.0 s: 1.1 + 5 x 1.0 + 5 x 1.1 = 11.6 s; 12.6 s after start-up.
    assert re.match(r"goodput 58\.0% \(11\.6 s of steps in 20\.0 s; 92\.1% from the first step to the last", summary)
    assert "compile 5.0 s" in summary and "first step 0.4 s" in summary and "saves 1.0 s" in summary
    assert "steps slower than steady (input waits 0.8 s) 0.5 s" in summary  # the last 5, 0.1 s over steady each


def test_goodput_from_the_first_step_to_the_last_is_at_most_all_of_that_time():
    """A 30-step run's numbers (log.every=20): its two intervals' median, 1.458 s, lies above their
    mean, so 30 steps at it made 43.7 s of steps in the 41.6 s from the first step to the last (105.1%).
    Each interval counts at most the time it took."""
    clock = RunTime(started=100.0)
    for part, seconds in {"process": 9.1, "data": 0.6, "checks": 0.1, "init": 1.0, "trace": 0.6, "compile": 10.4,
                          "warm_up": 0.4, "logging": 0.5}.items():
        clock.add(part, seconds)
    clock.interval(1, 2.336, 0.0, first=True)
    clock.interval(19, 1.142, 0.0)
    clock.interval(10, 1.773, 0.0)
    assert clock.steady_step_s() == pytest.approx(1.4575)
    summary = clock.summary(now=164.7)
    # 1.4575 + 19 x 1.142 + 10 x 1.4575 = 37.7 s of steps; the last 10 took 3.2 s beyond steady.
    assert re.match(r"goodput 58\.3% \(37\.7 s of steps in 64\.7 s; 90\.7% from the first step to the last", summary)
    assert "steps slower than steady (input waits 0.0 s) 3.2 s" in summary
    assert clock.goodput(164.7) == pytest.approx(37.7 / 64.7, abs=1e-3)


@pytest.mark.parametrize("host_copy", HOST_COPIES)
def test_every_host_copy_writes_the_state_that_restores(tmp_path, devices, host_copy):
    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    split = NamedSharding(mesh, PartitionSpec("fsdp", "tensor"))
    state = {"w": jax.device_put(np.arange(64 * 16, dtype=np.float32).reshape(64, 16), split),
             "key": jax.random.key(3), "host": np.arange(3, dtype=np.float32)}
    target = {**abstract_state({k: v for k, v in state.items() if k != "host"}),
              "host": jax.ShapeDtypeStruct((3,), np.float32, sharding=NamedSharding(mesh, PartitionSpec()))}
    with Checkpoints(tmp_path, host_copy=host_copy) as store:
        store.warm_up(state)
        store.save(1, state, {"step": 1})
        assert store.host_copy == host_copy
        store.wait()
        restored = store.restore(1, target).state
    np.testing.assert_array_equal(np.asarray(restored["host"]), np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))
    np.testing.assert_array_equal(jax.random.key_data(restored["key"]), jax.random.key_data(state["key"]))
    assert restored["w"].sharding.is_equivalent_to(split, 2)


def test_bench_checkpoint_reports_what_a_save_costs(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(make_config(tmp_path / "run", **ONE_DEVICE).model_dump_json())
    assert cli.main(["bench", str(config), "--steps", "2", "--warmup", "1", "--devices", "1",
                     "--checkpoint", str(tmp_path / "bench")]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])["checkpoint"]
    assert result["host_copy"] == "numpy" and result["checkpoint_bytes"] > 1e6
    assert 0 <= result["save_blocked_s"] < 5 and 0 < result["write_s"] and 0 < result["restore_s"]
    assert set(result) >= {"first_save_loop_cost_s", "save_loop_cost_s", "step_s", "synced_step_during_write_s"}


def test_a_warmup_longer_than_the_run_is_a_warning(tmp_path, capsys):
    loop.train(make_config(tmp_path / "run", **ONE_DEVICE, train={"steps": 3},
                           optim={"warmup_steps": 5, "schedule": "cosine"}), devices=jax.devices()[:1])
    assert ("jaxdist: warning: optim.warmup_steps=5 is not shorter than train.steps=3: the learning rate only ramps "
            "up, to 60% of optim.lr at the last step and optim.schedule=cosine never decays; lower "
            "optim.warmup_steps\n") in capsys.readouterr().err


def test_a_loop_that_waits_on_input_says_so(tmp_path, monkeypatch, capsys):
    train_iterator = loop.loader.train_iterator

    def slow(*args, **kwargs):
        batches = train_iterator(*args, **kwargs)

        class Slow:
            def __next__(self):
                time.sleep(0.5)
                return next(batches)

            def close(self):
                batches.close()

        return Slow()

    monkeypatch.setattr(loop.loader, "train_iterator", slow)
    loop.train(make_config(tmp_path / "run", **ONE_DEVICE, train={"steps": 5}, log={"every": 2}),
               devices=jax.devices()[:1])
    err = capsys.readouterr().err
    assert re.search(r"jaxdist: warning: input is the bottleneck: up to step \d the loop waited [\d.]+ ms of each "
                     r"[\d.]+ ms step for data; raise data.workers \(now 0\)", err), err
