"""Compute-dtype copies of the matmul weights kept between steps (train/copies.py): the same
training as casting at every step, copies made anew by each step and after a restore."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_config

from jaxdist.train.trainer import Trainer

pytestmark = pytest.mark.slow


def _trainer(tmp_path, compute_copies: bool, **sections):
    cfg = make_config(tmp_path, precision={"compute": "bfloat16", "compute_copies": compute_copies},
                      mesh={"data": 2, "fsdp": 1, "tensor": 1}, rules={"preset": "dp"}, **sections)
    return Trainer.from_config(cfg, devices=jax.devices()[:2])


def _batches(count: int):
    tokens = np.random.default_rng(0).integers(0, 256, (count, 16, 33))
    return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


def _copied_names(trainer) -> set[str]:
    paths = jax.tree_util.tree_flatten_with_path(trainer._copies)[0]
    return {str(path[-1].key) for path, _ in paths}


@pytest.mark.parametrize("microbatches", [1, 2])
def test_copies_train_exactly_like_casting_each_step(tmp_path, microbatches):
    batches = _batches(4)
    runs = {}
    for copies in (False, True):
        trainer = _trainer(tmp_path / str(copies), copies, train={"microbatches": microbatches})
        runs[copies] = [float(trainer.step(batch)["loss"]) for batch in batches]
        if copies:
            assert _copied_names(trainer) == {"qkv", "out", "up", "down"}  # not embed, positions, norms, head
            # The copies the last step wrote are its updated weights, cast.
            copied_params = jax.tree.map(lambda p, c: None if c is None else p, trainer.params, trainer._copies)
            for copy, param in zip(jax.tree.leaves(trainer._copies), jax.tree.leaves(copied_params), strict=True):
                assert copy.dtype == jnp.bfloat16
                np.testing.assert_array_equal(copy, param.astype(jnp.bfloat16))
        else:
            assert trainer._copies is None
    assert runs[False][-1] < runs[False][0]
    np.testing.assert_array_equal(runs[True], runs[False])


def test_copies_follow_a_replaced_state(tmp_path):
    """Assigning `trainer.state` (as a restore does) makes the next step cast that state's weights,
    not reuse the copies of the state it replaced."""
    batches = _batches(3)
    trainer = _trainer(tmp_path / "a", True)
    trainer.step(batches[0])
    after_one = jax.tree.map(jnp.copy, trainer.state)
    want = [float(trainer.step(batch)["loss"]) for batch in batches[1:]]
    trainer.state = after_one
    got = [float(trainer.step(batch)["loss"]) for batch in batches[1:]]
    assert got == want
