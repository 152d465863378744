"""The fused residual-add + norm kernels (kernels/fused_norm.py) compute the unfused function.

Off the GPU the Pallas kernels run in their interpreters: the same kernel code as on the GPU, each
implementation (Mosaic GPU, Triton) on its own. Mosaic GPU's interpreter takes about 2 ms per row
here, so the model-level tests keep their rows few, and the sharded training run swaps each
device's kernels for XLA's form of the same results (its subject is the wiring).
tests/test_kernels_gpu.py checks on a GPU that the compiled step runs the kernels.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import logged_losses, make_config
from flax import nnx

from jaxdist import loop
from jaxdist.kernels import fused_norm, fused_norm_mosaic, fused_norm_triton, switch
from jaxdist.models import gpt
from jaxdist.models.gpt import GPT, RESIDUAL, GPTConfig, ImplConfig

pytestmark = pytest.mark.slow


def _unfused(x, delta, scale, bias, rms):
    total = x if delta is None else x + delta
    x32 = total.astype(jnp.float32)
    if not rms:
        x32 = x32 - x32.mean(-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5) * scale
    if bias is not None:
        y = y + bias
    return total, y.astype(x.dtype)


def _fused(x, delta, scale, bias, rms):
    if delta is None:
        return x, fused_norm.norm(x, scale, bias, rms=rms, eps=1e-5, names=RESIDUAL)
    return fused_norm.add_norm(x, delta, scale, bias, rms=rms, eps=1e-5, names=RESIDUAL)


def _value_and_grads(fn, x, delta, scale, bias, rms, weights):
    """Both outputs and the gradients of a random linear function of both, for every input."""

    def loss(x, delta, scale, bias):
        total, normed = fn(x, delta, scale, bias, rms)
        return jnp.sum(total.astype(jnp.float32) * weights[0]) + jnp.sum(normed.astype(jnp.float32) * weights[1])

    argnums = tuple(i for i, a in enumerate((x, delta, scale, bias)) if a is not None)
    return fn(x, delta, scale, bias, rms), jax.grad(loss, argnums=argnums)(x, delta, scale, bias)


IMPLEMENTATIONS = {"mosaic": fused_norm_mosaic, "triton": fused_norm_triton}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("with_add", [True, False], ids=["add_norm", "norm"])
@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
def test_kernels_equal_the_unfused_norm_and_its_gradients(monkeypatch, implementation, dtype, rms, with_add):
    _use_only(monkeypatch, implementation)
    _check_against_the_unfused_norm(dtype, rms, with_add)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("with_add", [True, False], ids=["add_norm", "norm"])
def test_mosaic_gpu_kernels_on_rows_wider_than_a_chunk(monkeypatch, dtype, rms, with_add):
    """Rows of several chunks: statistics over the whole row, each pass reading the chunks again,
    the scale and bias gradient sums kept per chunk in shared memory (512 features, chunks of 256)."""
    _use_only(monkeypatch, "mosaic")
    monkeypatch.setattr(fused_norm_mosaic, "CHUNK", 256)
    _check_against_the_unfused_norm(dtype, rms, with_add, features=512)


def _use_only(monkeypatch, implementation: str) -> None:
    monkeypatch.setattr(fused_norm, "IMPLEMENTATIONS", (IMPLEMENTATIONS[implementation],))


def _check_against_the_unfused_norm(dtype, rms, with_add, features=128):
    keys = jax.random.split(jax.random.key(7), 6)
    shape = (2, 16, features)  # 32 rows: the fewest the Triton kernels take
    x = (3.0 * jax.random.normal(keys[0], shape) + 1.0).astype(dtype)
    delta = jax.random.normal(keys[1], shape).astype(dtype) if with_add else None
    scale = 1.0 + 0.2 * jax.random.normal(keys[2], (features,))
    bias = None if rms else 0.2 * jax.random.normal(keys[3], (features,))
    weights = (jax.random.normal(keys[4], shape), jax.random.normal(keys[5], shape))
    assert fused_norm.supported(shape, RESIDUAL)

    got_out, got_grads = _value_and_grads(_fused, x, delta, scale, bias, rms, weights)
    want_out, want_grads = _value_and_grads(_unfused, x, delta, scale, bias, rms, weights)
    # float32: rounding only. bfloat16: the fused backward adds the two incoming gradients in
    # float32 and rounds once, the unfused one rounds each: at most one bf16 step (2^-7 relative).
    rtol, atol = (2e-5, 2e-5) if dtype == jnp.float32 else (2**-7, 2e-2)
    for got, want in zip(got_out, want_out):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=rtol, atol=atol)
    for got, want in zip(got_grads, want_grads):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=rtol, atol=atol)
    # The norm-parameter gradients are sums over all 32 rows: float32 in both, so tight either way.
    np.testing.assert_allclose(got_grads[-1 if rms else -2], want_grads[-1 if rms else -2], rtol=1e-4, atol=1e-4)


def _model_loss_and_grads(norm_impl: str, norm: str):
    cfg = GPTConfig(vocab=64, d_model=32, layers=2, heads=4, seq_len=16, norm=norm)
    impl = ImplConfig(scan_layers=False, norm_impl=norm_impl)
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(GPT(cfg, impl, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(2), (2, 17), 0, 64)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return jax.jit(jax.value_and_grad(lambda p: gpt.loss(nnx.merge(graphdef, p), batch).mean))(params)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_gpt_with_fused_norms_has_the_same_loss_and_gradients(norm):
    loss, grads = _model_loss_and_grads("pallas", norm)
    want_loss, want_grads = _model_loss_and_grads("xla", norm)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    flat, want_flat = jax.tree.leaves_with_path(grads), jax.tree.leaves(want_grads)
    assert len(flat) == len(want_flat)
    for (path, got), want in zip(flat, want_flat):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def _xla_forward_local(rms, eps, x, delta, scale, bias):
    """`fused_norm._forward_local`'s results, computed by XLA."""
    return _unfused(x, delta, scale, bias, rms)


def _xla_backward_local(rms, eps, has_bias, total, d_normed, d_total, scale):
    """`fused_norm._backward_local`'s results by XLA: one row of partial sums per device."""
    bias = jnp.zeros_like(scale) if has_bias else None
    _, vjp = jax.vjp(lambda t, s, b: _unfused(t, None, s, b, rms)[1], total, scale, bias)
    d_x, d_scale, d_bias = vjp(d_normed)
    d_sum = d_x if d_total is None else (d_x.astype(jnp.float32) + d_total.astype(jnp.float32)).astype(d_x.dtype)
    return d_sum, d_scale[None], None if d_bias is None else d_bias[None]


def test_fused_norms_per_shard_train_like_one_device(tmp_path, monkeypatch):
    """data2 x fsdp2 x tensor2: the kernels run on each batch shard (shard_map), their scale and bias
    gradients are summed across shards; the losses equal the unfused single-device run's."""
    shapes = []

    def forward_local(rms, eps, x, delta, scale, bias):
        shapes.append(x.shape)
        return _xla_forward_local(rms, eps, x, delta, scale, bias)

    single, sharded = tmp_path / "single", tmp_path / "sharded"
    impl = {"scan_layers": False}
    loop.train(make_config(single, mesh={"data": 1, "fsdp": 1, "tensor": 1}, rules={"preset": "dp"},
                           impl={**impl, "norm_impl": "xla"}), devices=jax.devices()[:1])
    monkeypatch.setattr(fused_norm, "_forward_local", forward_local)
    monkeypatch.setattr(fused_norm, "_backward_local", _xla_backward_local)
    loop.train(make_config(sharded, mesh={"data": 2, "fsdp": 2, "tensor": 2}, rules={"preset": "fsdp_tp"},
                           impl={**impl, "norm_impl": "pallas"}))
    want = logged_losses(single)
    assert len(want) == 10 and want[-1] < want[0] - 0.5, want
    np.testing.assert_allclose(logged_losses(sharded), want, rtol=1e-5, atol=0)
    # Every norm's kernel runs on a quarter of the 16 x 32 x 64 batch: its batch shard.
    assert shapes and set(shapes) == {(4, 32, 64)}, shapes


def test_mosaic_gpu_takes_rows_of_one_chunk_first_and_wider_rows_after_triton(monkeypatch):
    def chosen(features):
        return fused_norm.implementation(features, 64, jnp.bfloat16)

    assert chosen(1024) is fused_norm_mosaic and chosen(2048) is fused_norm_triton
    assert fused_norm_mosaic.unsupported(2048, 64, jnp.bfloat16) is None  # two chunks
    assert fused_norm_mosaic.unsupported(1536, 64, jnp.bfloat16) == "features (1536) above 1024 must be a multiple of 1024"
    assert fused_norm_mosaic.unsupported(8192, 64, jnp.bfloat16) == (
        "features (8192) too many for a block of rows in shared memory")
    assert chosen(8192) is fused_norm_triton
    monkeypatch.setattr(fused_norm_triton, "pallas_triton", None)  # a jax without Triton
    assert chosen(1024) is fused_norm_mosaic and chosen(2048) is fused_norm_mosaic and chosen(8192) is None


def test_unsupported_shapes_fall_back_or_fail_clearly(monkeypatch):
    """Each implementation says what it needs; no kernel for a shape is one message, naming both."""
    assert fused_norm_mosaic.unsupported(48, 64, jnp.bfloat16) == "features (48) must be a multiple of 32"
    assert fused_norm_mosaic.unsupported(128, 15, jnp.bfloat16) == "rows per device (15) must be a multiple of 4"
    assert fused_norm_mosaic.unsupported(96, 64, jnp.bfloat16) is None  # 3 runs of 32 lanes, one value each
    assert fused_norm_triton.unsupported(96, 64, jnp.bfloat16).startswith("Triton blocks need powers of two")
    assert fused_norm.supported((4, 16, 96), RESIDUAL)
    assert fused_norm.unsupported((4, 16, 48), jnp.bfloat16, RESIDUAL) == (
        "features (48) must be a multiple of 32; "
        "Triton blocks need powers of two: features 48, rows per device 64 (at least 32)")
    with monkeypatch.context() as patch:  # a jax with neither backend
        patch.setattr(fused_norm_triton, "pallas_triton", None)
        patch.setattr(fused_norm_mosaic.mosaic, "plgpu", lambda: None)
        assert fused_norm.unsupported((4, 16, 128), jnp.bfloat16, RESIDUAL) == (
            "this jax has no Pallas Mosaic GPU backend; this jax has no Pallas Triton backend")
    cfg = GPTConfig(vocab=64, d_model=48, layers=2, heads=4, seq_len=16)
    with nnx.use_eager_sharding(False):
        model = GPT(cfg, ImplConfig(scan_layers=False, norm_impl="pallas"), rngs=nnx.Rngs(0))
        auto = GPT(cfg, ImplConfig(scan_layers=False, norm_impl="auto"), rngs=nnx.Rngs(0))
    tokens = jnp.zeros((2, 16), jnp.int32)
    with pytest.raises(ValueError, match="norm_impl=pallas.*features \\(48\\) must be a multiple of 32"):
        model(tokens)
    # On a GPU, `auto` runs XLA's norms where the kernels can't, and says so once, not per norm.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(fused_norm_mosaic.mosaic, "unavailable", lambda: None)
    switch.warn_once.cache_clear()
    with pytest.warns(UserWarning, match="XLA's fusions.*features \\(48\\)") as caught:
        jax.eval_shape(auto, tokens)
    assert len(caught) == 1
