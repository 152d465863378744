"""The loss chunks' softmax kernel (kernels/softmax_grad.py) computes XLA's two passes.

Off the GPU the Pallas kernel runs in Pallas's interpreter: the same kernel code as on the GPU.
The chunked loss through it is checked against the unchunked loss in test_loss_chunk.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxdist.kernels import softmax_grad
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
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("fsdp", "tensor"))
    with rules_lib.activation_rules(mesh, rules_lib.preset("fsdp_tp")):
        assert not softmax_grad.supported()
        assert not cross_entropy._use_kernel("auto")
        with pytest.raises(ValueError, match="vocabulary whole on each device"):
            cross_entropy._use_kernel("pallas")
    with rules_lib.activation_rules(mesh, rules_lib.preset("fsdp")):
        assert softmax_grad.supported()
        assert cross_entropy._use_kernel("pallas")
        assert not cross_entropy._use_kernel("auto")  # this is the CPU
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        assert cross_entropy._use_kernel("auto")
    assert not cross_entropy._use_kernel("xla")
