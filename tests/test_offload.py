"""Host offload (`train.offload: optimizer`): the optimizer state lives in pinned host memory and
comes to the devices for each update; training, saving and resuming give the same numbers as
without it."""

import json

import jax
import numpy as np
from conftest import make_config

from jaxdist import loop
from jaxdist.train.trainer import Trainer


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_optimizer_state_lives_in_host_memory_and_trains_as_on_the_device(tmp_path):
    layout = {"mesh": {"data": 2, "fsdp": 2, "tensor": 2}, "rules": {"preset": "fsdp_tp"}}
    trainer = Trainer.from_config(make_config(tmp_path / "probe", **layout, train={"offload": "optimizer"}))
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(trainer.state.opt_state)}
    assert kinds == {"pinned_host"}
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(trainer.state.params)} == {"device"}

    plain, offloaded = tmp_path / "plain", tmp_path / "offloaded"
    loop.train(make_config(plain, **layout, train={"steps": 6}))
    # Saved at step 3 and resumed: the host-memory state goes through a checkpoint too.
    loop.train(make_config(offloaded, **layout, train={"steps": 3, "offload": "optimizer"}, checkpoint={"every": 3}))
    loop.train(make_config(offloaded, **layout, train={"steps": 6, "offload": "optimizer"}, checkpoint={"every": 3}))
    np.testing.assert_allclose(_losses(offloaded), _losses(plain), rtol=1e-6, atol=0)


def test_plan_counts_the_offloaded_optimizer_state_in_host_memory():
    from jaxdist.commands import plan

    cfg = make_config("/tmp/unused", mesh={"data": 1, "fsdp": 8, "tensor": 1}, rules={"preset": "fsdp"})
    on_device = plan.make_plan(cfg)
    offloaded = plan.make_plan(cfg.model_copy(update={"train": cfg.train.model_copy(update={"offload": "optimizer"})}))
    assert offloaded.opt_state == 0 and offloaded.host == on_device.opt_state > 0
    assert offloaded.params == on_device.params
    assert "in host memory: optimizer state" in offloaded.lines()[1]
