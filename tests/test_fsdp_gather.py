"""train.fsdp_gather=per_step (ZeRO-2): the compute-dtype copies gathered whole once per step, in
the forward, and kept for the backward; weights, copies and optimizer state stay sharded over `fsdp`."""

import jax
import numpy as np
import pytest
from conftest import make_config

from jaxdist.errors import UserError
from jaxdist.observe import hlo
from jaxdist.train.trainer import Trainer

from test_copies import _batches

pytestmark = pytest.mark.slow


def _specs(tree) -> dict[str, tuple]:
    """The partition spec of each leaf, by its path."""
    return {jax.tree_util.keystr(path): tuple(leaf.sharding.spec)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _copy_shard_bytes(trainer) -> int:
    # XLA on CPU gathers bf16 as float32: 4 bytes for each element of a copy's 1/fsdp shard.
    return sum(copy.addressable_shards[0].data.size for copy in jax.tree.leaves(trainer._copies)) * 4


def _train(tmp_path, gather: str, steps: int, **sections):
    sections = {"mesh": {"data": 2, "fsdp": 4, "tensor": 1}, "rules": {"preset": "fsdp"}, **sections}
    cfg = make_config(tmp_path / gather, train={"fsdp_gather": gather, **sections.pop("train", {})},
                      precision={"compute": "bfloat16"}, **sections)
    trainer = Trainer.from_config(cfg)
    losses = [float(trainer.step(batch)["loss"]) for batch in _batches(steps)]
    gathered = sum(hlo.bytes_per_call(trainer.compiled_text())["all-gather"].values())
    return trainer, losses, gathered


def test_per_step_gathers_the_copies_once_and_trains_like_fsdp(tmp_path):
    per_layer, per_layer_losses, per_layer_gathered = _train(tmp_path, "per_layer", 4)
    per_step, losses, gathered = _train(tmp_path, "per_step", 4)
    assert per_layer_losses[-1] < per_layer_losses[0]
    np.testing.assert_allclose(losses, per_layer_losses, rtol=2e-3)
    # Per layer gathers the matmul weights in the forward and again in the backward; per step once.
    assert per_layer_gathered - gathered == _copy_shard_bytes(per_step), (per_layer_gathered, gathered)
    copies, params = _specs(per_step._copies), _specs(per_step.params)
    assert copies and all("fsdp" in str(spec) for spec in copies.values()), copies  # split between steps
    assert all("fsdp" in str(params[name]) for name in copies), params
    opt_specs = {str(leaf.sharding.spec) for leaf in jax.tree.leaves(per_step.state.opt_state)
                 if getattr(leaf, "ndim", 0) == 2}
    assert opt_specs and all("fsdp" in spec for spec in opt_specs), opt_specs


def test_per_step_gathers_once_across_microbatches_beside_a_tensor_axis(tmp_path):
    """2 microbatches take the per-shard gradient path (vmapped, reduced once after the scan). The copies do not change inside the scan, so XLA gathers them once before it:
    per_layer gathers 2 microbatches x (forward + backward) = 4 copies' worth, per_step 1. The copies
    stay split over `tensor`."""
    sections = {"train": {"microbatches": 2},
                "mesh": {"data": 1, "fsdp": 4, "tensor": 2}, "rules": {"preset": "fsdp_tp"}}
    _, per_layer_losses, per_layer_gathered = _train(tmp_path, "per_layer", 3, **sections)
    per_step, losses, gathered = _train(tmp_path, "per_step", 3, **sections)
    np.testing.assert_allclose(losses, per_layer_losses, rtol=2e-3)
    assert per_layer_gathered - gathered == 3 * _copy_shard_bytes(per_step), (per_layer_gathered, gathered)
    assert any("tensor" in str(spec) for spec in _specs(per_step._copies).values())


def test_per_step_gather_needs_copies_to_gather(tmp_path):
    with pytest.raises(UserError, match="needs precision.compute_copies=true"):
        make_config(tmp_path, train={"fsdp_gather": "per_step"}, precision={"compute_copies": False})
    cfg = make_config(tmp_path, train={"fsdp_gather": "per_step"}, precision={"compute": "float32"},
                      mesh={"data": 1, "fsdp": 2, "tensor": 1}, rules={"preset": "fsdp"})
    with pytest.raises(UserError, match="compute float32, params float32"):
        Trainer.from_config(cfg, jax.devices()[:2])
