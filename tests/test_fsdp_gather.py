"""train.fsdp_gather=per_step (ZeRO-2): the compute-dtype copies whole on every device, gathered
once per step by the update; the float32 weights and optimizer state stay sharded over `fsdp`."""

import jax
import numpy as np
import pytest
from conftest import make_config

from jaxdist.errors import UserError
from jaxdist.observe import hlo
from jaxdist.train import loop

from test_copies import _batches


def _trainer(tmp_path, gather: str):
    cfg = make_config(tmp_path, precision={"compute": "bfloat16"}, train={"fsdp_gather": gather},
                      mesh={"data": 2, "fsdp": 4, "tensor": 1}, rules={"preset": "fsdp"})
    return loop.build_trainer(cfg)


def _specs(tree) -> dict[str, tuple]:
    """The partition spec of each leaf, by its path."""
    return {jax.tree_util.keystr(path): tuple(leaf.sharding.spec)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_per_step_gather_trains_like_fsdp_with_whole_copies_and_sharded_weights(tmp_path):
    batches = _batches(4)
    losses, gathered = {}, {}
    for gather in ("per_layer", "per_step"):
        trainer = _trainer(tmp_path / gather, gather)
        losses[gather] = [float(trainer.step(batch)["loss"]) for batch in batches]
        gathered[gather] = sum(hlo.bytes_per_call(trainer.compiled_text())["all-gather"].values())
        if gather == "per_step":
            # XLA on CPU gathers bf16 as float32: 4 bytes for each element of a copy's 1/fsdp shard.
            copy_shard_bytes = sum(copy.size for copy in jax.tree.leaves(trainer._copies)) // 4 * 4
            copies, params = _specs(trainer._copies), _specs(trainer.params)
            assert copies and all("fsdp" not in str(spec) for spec in copies.values()), copies
            assert all("fsdp" in str(params[name]) for name in copies), params  # the weights stay split
            opt_specs = {str(leaf.sharding.spec) for leaf in jax.tree.leaves(trainer.state.opt_state)
                         if getattr(leaf, "ndim", 0) == 2}
            assert opt_specs and all("fsdp" in spec for spec in opt_specs), opt_specs
    assert losses["per_layer"][-1] < losses["per_layer"][0]
    np.testing.assert_allclose(losses["per_step"], losses["per_layer"], rtol=2e-3)
    # Per layer gathers the matmul weights in the forward and again in the backward; per step once.
    assert gathered["per_layer"] - gathered["per_step"] == copy_shard_bytes, (gathered, copy_shard_bytes)


def test_per_step_gather_needs_copies_to_gather(tmp_path):
    with pytest.raises(UserError, match="needs precision.compute_copies=true"):
        make_config(tmp_path, train={"fsdp_gather": "per_step"}, precision={"compute_copies": False})
    cfg = make_config(tmp_path, train={"fsdp_gather": "per_step"}, precision={"compute": "float32"},
                      mesh={"data": 1, "fsdp": 2, "tensor": 1}, rules={"preset": "fsdp"})
    with pytest.raises(UserError, match="compute float32, params float32"):
        loop.build_trainer(cfg, jax.devices()[:2])
