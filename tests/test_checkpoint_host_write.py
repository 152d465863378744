"""One process saves each array whole from host memory (the cheap save); it restores anywhere."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.checkpoint import Checkpoints, abstract_state
from jaxdist.parallel.mesh import make_mesh

BIG_SHAPE = (2048, 1024)  # 8 MiB of float32: 1 MiB per device shard on 8 devices


@pytest.fixture
def saved(tmp_path, devices):
    """Step 1 of a checkpoint directory holding a big and a small array split over 8 devices."""
    mesh = make_mesh(data=1, fsdp=8, tensor=1)
    split = NamedSharding(mesh, PartitionSpec("fsdp"))
    tree = {
        "big": jax.device_put(jnp.arange(math.prod(BIG_SHAPE), dtype=jnp.float32).reshape(BIG_SHAPE), split),
        "small": jax.device_put(jnp.arange(32.0).reshape(8, 4), split),
        "step": jax.device_put(jnp.array(7, jnp.int32), NamedSharding(mesh, PartitionSpec())),
    }
    with Checkpoints(tmp_path) as store:
        store.save(1, tree, {"step": 1})
    return tmp_path, tree


def test_one_process_writes_each_array_whole_from_host_memory(saved):
    directory, _ = saved
    written = json.loads((directory / "1" / "state" / "_METADATA").read_text())["tree_metadata"]
    # One numpy array per leaf (one write each), not one write per device shard (8 per array here).
    assert {key: leaf["value_metadata"]["value_type"] for key, leaf in written.items()} == {
        "('big',)": "np.ndarray", "('small',)": "np.ndarray", "('step',)": "np.ndarray"}
    assert not (directory / "1" / "state" / "_sharding").exists()


def test_large_arrays_are_chunked_no_larger_than_a_device_shard(saved):
    directory, _ = saved
    stored = ocp.PyTreeCheckpointer().metadata(directory / "1" / "state").item_metadata.tree
    big_chunk = stored["big"].storage.chunk_shape
    assert math.prod(big_chunk) * 4 == 2**20, big_chunk  # 8 chunks of one shard's size, not one of 8 MiB
    assert stored["small"].storage.chunk_shape == (8, 4)  # small arrays stay one chunk


def test_whole_array_checkpoint_restores_onto_another_mesh(saved, devices):
    directory, tree = saved
    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    target = abstract_state(tree)
    split_2d = NamedSharding(mesh, PartitionSpec("fsdp", "tensor"))
    target["big"] = jax.ShapeDtypeStruct(BIG_SHAPE, jnp.float32, sharding=split_2d)
    with Checkpoints(directory) as store:
        restored = store.restore(1, target)
    assert restored.state["big"].sharding.spec == PartitionSpec("fsdp", "tensor")
    for name in tree:
        np.testing.assert_array_equal(np.asarray(restored.state[name]), np.asarray(tree[name]))


def test_numpy_leaves_are_copied_before_save_returns(tmp_path, devices):
    host = np.arange(4.0, dtype=np.float32)
    with Checkpoints(tmp_path) as store:
        store.save(1, {"host": host}, {})
        host[:] = -1.0  # the caller's array changes while the write may still be going on
        store.wait()
        replicated = NamedSharding(make_mesh(data=1, fsdp=8, tensor=1), PartitionSpec())
        target = {"host": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=replicated)}
        restored = store.restore(1, target).state["host"]
    np.testing.assert_array_equal(np.asarray(restored), np.arange(4.0))
