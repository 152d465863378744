"""Principle 2: a layout is not a math change. Every layout trains like one device, on packed rows
of documents of very different lengths (their shards hold different numbers of counted tokens)."""

import json
import math

import jax
import numpy as np
import pytest
from conftest import TINY_GPT, make_config

from jaxdist import loop
from jaxdist.train.trainer import Trainer, state_bytes_per_device

pytestmark = pytest.mark.slow


def _packed_model(**keys):
    return {"model": {**TINY_GPT["model"], "vocab": "auto"}, **keys}


@pytest.fixture(scope="module")
def single_device_run(tmp_path_factory, packed_corpus):
    run_dir = tmp_path_factory.mktemp("single")
    cfg = make_config(run_dir, mesh={"data": 1, "fsdp": 1, "tensor": 1}, rules={"preset": "dp"},
                      **_packed_model(data=packed_corpus))
    loop.train(cfg, devices=jax.devices()[:1])
    result = logged(run_dir)
    assert len(result["loss"]) == 10 and result["loss"][-1] < result["loss"][0] - 0.5, result
    return result


def logged(run_dir) -> dict[str, list[float]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {key: [line[key] for line in lines] for key in ("loss", "grad_norm")}


@pytest.mark.parametrize(
    "mesh, preset",
    [
        ({"data": 8, "fsdp": 1}, "dp"),
        ({"data": 1, "fsdp": 8}, "fsdp"),
        ({"data": 2, "fsdp": 1, "tensor": 4}, "tp"),
        ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp"),
        ({"data": 2, "fsdp": 1, "tensor": 4}, {"preset": "tp", "activations": {"seq": "tensor"}}),
    ],
    ids=["data8", "fsdp8", "data2_tensor4", "data2_fsdp2_tensor2", "data2_tensor4_sequence_parallel"],
)
def test_layout_matches_single_device(tmp_path, single_device_run, packed_corpus, mesh, preset):
    rules = preset if isinstance(preset, dict) else {"preset": preset}
    cfg = make_config(tmp_path, mesh=mesh, rules=rules, **_packed_model(data=packed_corpus))
    loop.train(cfg)
    got = logged(tmp_path)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], single_device_run[key], rtol=1e-5, atol=0, err_msg=key)


def test_shards_follow_rules_and_fsdp_divides_memory(tmp_path):
    cfg = make_config(tmp_path, mesh={"data": 1, "fsdp": 8}, rules={"preset": "fsdp"})
    trainer = Trainer.from_config(cfg)
    layouts = {lay.path: lay for lay in jax.tree.leaves(trainer.layouts, is_leaf=lambda x: hasattr(x, "spec"))}
    params = jax.tree.leaves_with_path(trainer.params)
    assert len(params) == len(layouts) > 10
    for path, array in params:
        name = "/".join(str(k.key) for k in path)
        expected = layouts[name]
        assert {shard.data.shape for shard in array.addressable_shards} == {expected.shard_shape}, name
        if "embed" in expected.names:  # fsdp shards every weight along `embed`
            dim = expected.names.index("embed")
            assert expected.shard_shape[dim] * 8 == expected.shape[dim], name

    total = sum(leaf.nbytes for leaf in jax.tree.leaves(trainer.state))
    per_device = state_bytes_per_device(trainer.state)
    assert len(per_device) == 8
    assert max(per_device.values()) <= total / 8 * 1.01, (max(per_device.values()), total)


def test_tensor_parallel_shards_heads_and_mlp(tmp_path):
    cfg = make_config(tmp_path, mesh={"data": 2, "fsdp": 1, "tensor": 4}, rules={"preset": "tp"})
    trainer = Trainer.from_config(cfg)
    blocks = trainer.params["blocks"]
    # qkv: (layers, 3, embed, heads, head_dim) with heads split 4 ways; mlp hidden split 4 ways.
    assert blocks["attn"]["qkv"].addressable_shards[0].data.shape == (2, 3, 64, 1, 16)
    assert blocks["mlp"]["up"].addressable_shards[0].data.shape == (2, 64, 64)
    assert blocks["mlp"]["down"].addressable_shards[0].data.shape == (2, 64, 64)
    assert math.prod(blocks["attn"]["out"].sharding.shard_shape(blocks["attn"]["out"].shape)) * 4 == blocks["attn"]["out"].size
