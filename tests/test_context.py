"""Context parallelism (parallel/context.py): sequences split over a mesh axis through attention
train as on one device, with the heads exchanged by all-to-alls, or the keys and values all-gathered
and the causal mask offset where the heads do not divide."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import logged_losses, make_config
from jax.sharding import Mesh

from jaxdist import cli, loop
from jaxdist.observe import hlo
from jaxdist.parallel import context
from jaxdist.parallel import rules as rules_lib

pytestmark = pytest.mark.slow

CONTEXT = {"batch": "data", "seq": "fsdp", "length": "fsdp"}  # each sequence in chunks over fsdp
NAMES = ("batch", "length", "heads", "head_dim")
KV_NAMES = ("batch", "length", "kv_heads", "head_dim")


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one")
    loop.train(make_config(run_dir, mesh={"data": 1, "fsdp": 1, "tensor": 1}, rules={"preset": "dp"}),
               devices=jax.devices()[:1])
    return logged_losses(run_dir)


@pytest.mark.parametrize("mesh, preset, train, impl", [
    ({"data": 2, "fsdp": 4, "tensor": 1}, "fsdp", {}, {}),
    ({"data": 2, "fsdp": 4, "tensor": 1}, "fsdp", {"microbatches": 2}, {}),
    ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp", {}, {}),
    # The chunked loss: each device's 8 positions in two chunks of 4.
    ({"data": 2, "fsdp": 4, "tensor": 1}, "fsdp", {}, {"loss_chunk": 4}),
], ids=["data2_context4", "data2_context4_accumulated", "data2_context2_tensor2", "data2_context4_chunked_loss"])
def test_sequences_split_over_fsdp_train_as_on_one_device(tmp_path, one_device, mesh, preset, train, impl):
    cfg = make_config(tmp_path, mesh=mesh, rules={"preset": preset, "activations": CONTEXT}, train=train, impl=impl)
    trainer = loop.train(cfg)
    np.testing.assert_allclose(logged_losses(tmp_path), one_device, rtol=1e-5, atol=0)
    # The heads are exchanged: all-to-alls send each device along fsdp a share of every other's
    # heads for its chunk of the sequence (XLA on CPU sends pieces per peer and row); no activation is
    # gathered.
    text = trainer.compiled_text()
    assert not _activations_gathered(text)
    pieces = {shape[1:] for op in hlo.collectives(text, ("all-to-all",)) for shape in op.operand_shapes
              if len(shape) == 4}
    assert (32 // mesh["fsdp"], 4 // mesh["tensor"] // mesh["fsdp"], 16) in pieces, pieces


def _activations_gathered(text: str) -> list[tuple[int, ...]]:
    # The weights' gathers have fewer dimensions here.
    return [op.operand_shapes[0] for op in hlo.collectives(text, ("all-gather", "all-gather-start"))
            if len(op.operand_shapes[0]) >= 4]


def test_where_the_key_value_heads_do_not_divide_the_keys_and_values_are_gathered(tmp_path):
    grouped = {"d_model": 64, "layers": 2, "heads": 4, "kv_heads": 2, "seq_len": 32, "mlp_ratio": 4}
    loop.train(make_config(tmp_path / "one", model=grouped, mesh={"data": 1, "fsdp": 1, "tensor": 1},
                           rules={"preset": "dp"}), devices=jax.devices()[:1])
    trainer = loop.train(make_config(tmp_path / "split", model=grouped, mesh={"data": 2, "fsdp": 4, "tensor": 1},
                                     rules={"preset": "fsdp", "activations": CONTEXT}))
    np.testing.assert_allclose(logged_losses(tmp_path / "split"), logged_losses(tmp_path / "one"), rtol=1e-5, atol=0)
    # Two key/value heads over four chunks: each device gathers the keys and values of its rows and
    # heads, chunk by chunk.
    gathered = _activations_gathered(trainer.compiled_text())
    assert gathered and {(math.prod(shape[:-3]), *shape[-3:]) for shape in gathered} == {(8, 8, 2, 16)}, gathered


def _attention_inputs(kv_heads: int):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, 16, 4, 8))
    k, v = (jax.random.normal(key, (2, 16, kv_heads, 8)) for key in keys[1:3])
    segments = jnp.cumsum(jax.random.bernoulli(keys[3], 0.15, (2, 16)), axis=1)  # packed documents
    mask = (segments[:, :, None] == segments[:, None, :])[:, None]
    return q, k, v, mask


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["heads", "grouped_query"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["causal", "packed_documents"])
@pytest.mark.parametrize("window", [None, 5], ids=["whole", "window5"])
def test_chunked_attention_and_its_gradients_equal_whole_attention(kv_heads, with_mask, window):
    """Split over 4 chunks of 4 positions or not, with or without packed documents and a sliding
    window: the attention of an explicit mask (causal, the same document, within the window)."""
    q, k, v, mask = _attention_inputs(kv_heads)
    mask = mask if with_mask else None
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    rules = rules_lib.preset("fsdp").override(activations=CONTEXT)

    def split(q, k, v):
        with rules_lib.activation_rules(mesh, rules):
            return jnp.sum(jnp.sin(context.attention(q, k, v, mask, "xla", NAMES, KV_NAMES, window)))

    def unsplit(q, k, v):
        return jnp.sum(jnp.sin(context.attention(q, k, v, mask, "xla", NAMES, KV_NAMES, window)))

    earlier = np.arange(16)[:, None] - np.arange(16)[None, :]
    explicit = (earlier >= 0) & (earlier < (window or 16))
    explicit = explicit if mask is None else mask & explicit

    def whole(q, k, v):
        return jnp.sum(jnp.sin(jax.nn.dot_product_attention(q, k, v, mask=explicit)))

    want = jax.value_and_grad(whole, (0, 1, 2))(q, k, v)
    for got in (jax.jit(jax.value_and_grad(split, (0, 1, 2)))(q, k, v), jax.value_and_grad(unsplit, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        for a, b in zip(got[1], want[1]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if window:  # the window changes the result: the check can fail
        assert not np.isclose(whole(q, k, v), jnp.sum(jnp.sin(jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True))), rtol=1e-3)


@pytest.mark.parametrize("fsdp", [2, 4], ids=["heads_exchanged", "keys_gathered"])
def test_a_sliding_window_trains_as_on_one_device_under_context_parallelism(tmp_path, fsdp):
    """A window of 8 of the 32 positions: with 2 chunks the heads are exchanged (the window applied
    to the whole sequence), with 4 the two key/value heads do not divide and the keys are gathered
    (the window in the offset mask)."""
    windowed = {"d_model": 64, "layers": 2, "heads": 4, "kv_heads": 2, "seq_len": 32, "sliding_window": 8}
    loop.train(make_config(tmp_path / "one", model=windowed, mesh={"data": 1, "fsdp": 1, "tensor": 1},
                           rules={"preset": "dp"}), devices=jax.devices()[:1])
    trainer = loop.train(make_config(tmp_path / "split", model=windowed, mesh={"data": 8 // fsdp, "fsdp": fsdp,
                                                                                 "tensor": 1},
                                     rules={"preset": "fsdp", "activations": CONTEXT}))
    np.testing.assert_allclose(logged_losses(tmp_path / "split"), logged_losses(tmp_path / "one"), rtol=1e-5, atol=0)
    assert bool(_activations_gathered(trainer.compiled_text())) == (fsdp == 4)


def test_a_sequence_that_does_not_split_evenly_is_refused_before_compiling(tmp_path, capsys):
    code = cli.main(["train", "tiny", f"run_dir={tmp_path}", "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1",
                     "rules.preset=fsdp", "rules.activations.batch=null", "rules.activations.seq=fsdp",
                     "rules.activations.length=fsdp", "model.seq_len=100"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "model.seq_len=100 is not divisible by mesh.fsdp=8, over which rules.activations.seq splits each " \
           "sequence; use a multiple of 8" in err
