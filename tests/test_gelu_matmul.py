"""The MLP's `gelu(pre) @ down` and its backward (kernels/gelu_matmul.py).

The cuBLASLt handler itself needs a GPU: `benchmarks/bench_gelu_matmul.py` checks it against XLA
there. Here: the custom VJP against autodiff, what its backward keeps, the per-shard wiring under
a mesh (with the per-device call swapped for XLA's, then for a CPU handler built and loaded as the
GPU one is), and the fallbacks. The builder itself: tests/test_kernel_build.py.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import logged_losses, make_config

from jaxdist import kernels, loop
from jaxdist.errors import UserError
from jaxdist.kernels import build, gelu_matmul
from jaxdist.parallel import mesh as mesh_lib
from jaxdist.parallel import rules as rules_lib

pytestmark = pytest.mark.slow

# A CPU stand-in for the cuBLASLt handler: the same operands and results, float32.
STAND_IN = build.Handler("gelu_grad_reference", Path(__file__).with_name("native") / "gelu_grad_reference.cc",
                         "JaxdistTestGeluGrad", "jaxdist_test_gelu_grad", platform="cpu")


def _inputs(rows=(2, 8), mlp=64, embed=16):
    keys = jax.random.split(jax.random.key(0), 3)
    pre = 3.0 * jax.random.normal(keys[0], (*rows, mlp))
    down = jax.random.normal(keys[1], (mlp, embed)) / 8
    weights = jax.random.normal(keys[2], (*rows, embed))
    return pre, down, weights


def test_gelu_project_matches_autodiff_of_the_formula():
    pre, down, weights = _inputs()
    loss = lambda project: lambda pre, down: jnp.vdot(project(pre, down), weights)  # noqa: E731
    ours = loss(lambda pre, down: gelu_matmul.gelu_project(pre, down, kernel=False))
    formula = loss(lambda pre, down: jax.nn.gelu(pre, approximate=True) @ down)
    np.testing.assert_allclose(ours(pre, down), formula(pre, down), rtol=1e-6)
    for got, want in zip(jax.grad(ours, (0, 1))(pre, down), jax.grad(formula, (0, 1))(pre, down), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_backward_keeps_the_input_and_output_of_gelu_not_its_tanh():
    pre, down, _ = _inputs()

    def kept(fn):
        _, backward = jax.vjp(fn, pre, down)
        return [leaf for leaf in jax.tree.leaves(backward) if getattr(leaf, "shape", None) == pre.shape]

    ours = kept(lambda pre, down: gelu_matmul.gelu_project(pre, down, kernel=False))
    assert len(ours) == 2
    np.testing.assert_array_equal(ours[0], pre)
    np.testing.assert_array_equal(ours[1], gelu_matmul.gelu(pre))
    assert len(kept(lambda pre, down: jax.nn.gelu(pre, approximate=True) @ down)) > 2


def test_per_shard_wiring_trains_like_one_device(tmp_path, monkeypatch):
    """data2 x fsdp2 x tensor2: the gradient matmul runs per shard (rows by batch, mlp by tensor)
    with the per-device call done by XLA here; the losses equal a single device's."""
    calls = []

    def local(d_out, down, pre):
        calls.append((d_out.shape, down.shape, pre.shape))
        return gelu_matmul.xla_gelu_grad_matmul(d_out, down, pre)

    single, sharded = tmp_path / "single", tmp_path / "sharded"
    impl = {"scan_layers": False, "norm_impl": "xla"}
    loop.train(make_config(single, mesh={"data": 1, "fsdp": 1, "tensor": 1}, rules={"preset": "dp"},
                           impl={**impl, "gelu_grad_impl": "xla"}), devices=jax.devices()[:1])
    monkeypatch.setattr(gelu_matmul, "_local", local)
    monkeypatch.setattr(gelu_matmul, "use_kernel", lambda impl, pre, down: True)
    loop.train(make_config(sharded, mesh={"data": 2, "fsdp": 2, "tensor": 2}, rules={"preset": "fsdp_tp"},
                           impl={**impl, "gelu_grad_impl": "auto"}))
    # Per device: 16 sequences / (data 2 x fsdp 2) of 32 positions; mlp 256 / tensor 2; embed whole.
    assert calls and set(calls) == {((4, 32, 64), (128, 64), (4, 32, 128))}, set(calls)
    want = logged_losses(single)
    assert len(want) == 10 and want[-1] < want[0] - 0.5, want
    np.testing.assert_allclose(logged_losses(sharded), want, rtol=1e-5, atol=0)


def test_the_ffi_call_runs_per_shard_under_vmap(tmp_path, monkeypatch):
    """The real ffi_call path, with a CPU stand-in for the cuBLASLt handler (same operands and
    results), where the gradients are vmapped over batch shards: 2 microbatches on
    data2 x fsdp2 x tensor2. The losses equal XLA's way."""
    monkeypatch.setenv("JAXDIST_CACHE_DIR", str(tmp_path / "cache"))
    assert [status.state for status in kernels.build_kernels((STAND_IN,))] == ["built"]
    build.load(STAND_IN)
    shards = {"mesh": {"data": 2, "fsdp": 2, "tensor": 2}, "rules": {"preset": "fsdp_tp"},
              "train": {"microbatches": 2}}
    impl = {"scan_layers": False, "norm_impl": "xla"}
    xla, kernel = tmp_path / "xla", tmp_path / "kernel"
    loop.train(make_config(xla, impl={**impl, "gelu_grad_impl": "xla"}, **shards))
    monkeypatch.setattr(gelu_matmul, "HANDLER", STAND_IN)
    monkeypatch.setattr(gelu_matmul, "use_kernel", lambda impl, pre, down: True)
    loop.train(make_config(kernel, impl={**impl, "gelu_grad_impl": "auto"}, **shards))
    want = logged_losses(xla)
    assert len(want) == 10 and want[-1] < want[0] - 0.5, want
    np.testing.assert_allclose(logged_losses(kernel), want, rtol=1e-5, atol=0)


def test_kernel_choice_falls_back_or_fails_clearly(tmp_path, monkeypatch):
    pre, down = jnp.zeros((2, 8, 64), jnp.bfloat16), jnp.zeros((64, 16), jnp.bfloat16)
    assert not gelu_matmul.use_kernel("auto", pre, down)  # on CPU
    assert not gelu_matmul.use_kernel("xla", pre, down)
    assert gelu_matmul.unavailable_reason() == "not on a GPU"
    with pytest.raises(RuntimeError, match="not on a GPU"):
        gelu_matmul.use_kernel("cublaslt", pre, down)
    with pytest.raises(ValueError, match="bfloat16"):
        gelu_matmul.use_kernel("cublaslt", pre.astype(jnp.float32), down.astype(jnp.float32))
    with monkeypatch.context() as patch:  # a GPU where the handler doesn't build: warn once, use XLA
        patch.setattr(gelu_matmul, "unavailable_reason", lambda: "not found: cublasLt.h")
        patch.setattr(jax, "default_backend", lambda: "gpu")
        with pytest.warns(UserWarning, match="not found: cublasLt.h"):
            assert not gelu_matmul.use_kernel("auto", pre, down)
    with monkeypatch.context() as patch:  # a GPU where it builds: operands and layouts it doesn't take
        patch.setattr(gelu_matmul, "unavailable_reason", lambda: None)
        patch.setattr(jax, "default_backend", lambda: "gpu")
        assert gelu_matmul.use_kernel("auto", pre, down)
        assert not gelu_matmul.use_kernel("auto", pre[..., :60], down[:60])  # mlp 60: rows not 16 bytes
        with pytest.raises(ValueError, match="multiples of 8"):
            gelu_matmul.use_kernel("cublaslt", pre[..., :60], down[:60])
        assert gelu_matmul.use_kernel("auto", pre[..., :40], down[:40])  # mlp 40, whole
        mesh = mesh_lib.build_mesh({"data": 1, "stage": 1, "fsdp": 1, "tensor": 2}, jax.devices()[:2])
        with rules_lib.activation_rules(mesh, rules_lib.preset("tp")):
            assert gelu_matmul.use_kernel("auto", pre, down)  # 32 of mlp per device
            assert not gelu_matmul.use_kernel("auto", pre[..., :40], down[:40])  # 20 per device
        split_embed = rules_lib.preset("tp").override(activations={"embed": "tensor"})
        with rules_lib.activation_rules(mesh, split_embed):
            assert not gelu_matmul.use_kernel("auto", pre, down)
            with pytest.raises(ValueError, match="embed"):
                gelu_matmul.use_kernel("cublaslt", pre, down)
    with pytest.raises(UserError, match="gelu_grad_impl=cublaslt needs model.activation=gelu"):
        make_config(tmp_path, model={"activation": "swiglu"}, impl={"gelu_grad_impl": "cublaslt", "scan_layers": False})

