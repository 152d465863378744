"""The loss chunks' softmax kernel (kernels/softmax_grad.py) computes XLA's two passes.

Off the GPU the Pallas kernel runs in Pallas's interpreter: the same kernel code as on the GPU.
The chunked loss through it is checked against the unchunked loss in test_loss_chunk.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxdist.kernels import softmax_grad, switch
from jaxdist.models import cross_entropy
from jaxdist.parallel import rules as rules_lib


def _inputs(vocab, block, dtype, scale):
    """Logits with one row of huge values and targets on every block edge, in the overlap of the
    last block with the one before it, and at both ends of the vocabulary."""
    keys = jax.random.split(jax.random.key(1), 2)
    logits = scale * jax.random.normal(keys[0], (3, 8, vocab))
    logits = logits.at[1, 2].multiply(1e3)  # the online maximum must rescale the running sum
    overlap_start = vocab - block
    edges = [0, block - 1, block, overlap_start, overlap_start + 1, vocab - 1, (vocab // block) * block - 1]
    targets = jax.random.randint(keys[1], (3, 8), 0, vocab)
    targets = targets.at[0, : len(edges)].set(jnp.array(edges) % vocab)
    weights = jnp.array([1.0, 0.0, 0.25])  # 0: a padding row, as eval batches mark them
    return logits.astype(dtype), targets, weights


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("vocab, block", [(300, 256), (1000, 128), (512, 512)],
                         ids=["last_block_overlaps", "many_blocks", "one_block"])
def test_kernel_equals_xla_passes(dtype, vocab, block):
    logits, targets, weights = _inputs(vocab, block, dtype, scale=4.0)
    losses, grad = softmax_grad._local(logits, targets, weights, grad_dtype=dtype, block=block)
    want_losses, want_grad = cross_entropy.xla_loss_and_grad(logits, targets, weights, grad_dtype=dtype,
                                                             one_pass=False)
    assert losses.dtype == jnp.float32 and losses.shape == (3, 8)
    assert grad.dtype == dtype and grad.shape == logits.shape
    np.testing.assert_allclose(losses, want_losses, rtol=2e-6, atol=2e-5)
    assert float(jnp.min(losses)) >= 0.0 and np.isfinite(np.asarray(losses)).all()
    # Same float32 math up to summation order (the logsumexps differ in their last bits): the
    # gradients agree to one rounding of their dtype, or of float32 exp with that logsumexp.
    step = max(float(jnp.finfo(dtype).eps), 4e-6)
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(want_grad, np.float32), rtol=step, atol=1e-7)
    assert not np.asarray(grad[1]).any()  # weight 0: no gradient
    # Each row's gradient sums to 0 (softmax sums to 1, minus the one-hot) times its weight.
    np.testing.assert_allclose(np.asarray(grad[0], np.float32).sum(-1), 0.0, atol=8 * step)


def test_auto_and_pallas_under_a_split_vocabulary(monkeypatch):
    """Where the rules split the vocabulary over devices, `auto` keeps XLA's passes and `pallas`
    says why it cannot run; with the vocabulary whole, `auto` runs the kernel only on GPU."""
    shape = (4, 8, 512)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 1, 2), ("data", "fsdp", "tensor"))
    with rules_lib.activation_rules(mesh, rules_lib.preset("fsdp_tp")):
        assert softmax_grad.unsupported(shape, jnp.bfloat16) == "it needs the vocabulary whole on each device; " \
                                                                "the rules split it"
        assert not softmax_grad.use_kernel("auto", shape, jnp.bfloat16)
        with pytest.raises(ValueError, match="model.impl.loss_impl=pallas: it needs the vocabulary whole on each device"):
            softmax_grad.use_kernel("pallas", shape, jnp.bfloat16)
    with rules_lib.activation_rules(mesh, rules_lib.preset("fsdp")):
        assert softmax_grad.unsupported(shape, jnp.bfloat16) is None
        assert softmax_grad.use_kernel("pallas", shape, jnp.bfloat16)
        assert not softmax_grad.use_kernel("auto", shape, jnp.bfloat16)  # this is the CPU
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        monkeypatch.setattr(softmax_grad.mosaic, "unavailable", lambda: None)
        assert softmax_grad.use_kernel("auto", shape, jnp.bfloat16)
    assert not softmax_grad.use_kernel("xla", shape, jnp.bfloat16)


def test_unsupported_shapes_fall_back_and_say_so_once(monkeypatch):
    """Under `auto` on a GPU, logits the kernel can't take run XLA's passes, with one warning per
    reason however many chunks ask; a jax without Mosaic GPU says so too."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(softmax_grad.mosaic, "unavailable", lambda: None)
    switch.warn_once.cache_clear()
    assert softmax_grad.unsupported((3, 5, 512), jnp.bfloat16) == "rows per device (15) must be a multiple of 4"
    assert softmax_grad.unsupported((4, 8, 16), jnp.float32) == "the vocabulary (16) must be at least 32 wide"
    with pytest.warns(UserWarning, match="XLA's two passes.*rows per device") as caught:
        for _ in range(3):
            assert not softmax_grad.use_kernel("auto", (3, 5, 512), jnp.bfloat16)
    assert len(caught) == 1
    monkeypatch.setattr(softmax_grad.mosaic, "plgpu", lambda: None)
    monkeypatch.setattr(softmax_grad.mosaic, "unavailable", lambda: "this jax has no Pallas Mosaic GPU backend")
    assert softmax_grad.unsupported((4, 8, 512), jnp.bfloat16) == "this jax has no Pallas Mosaic GPU backend"
