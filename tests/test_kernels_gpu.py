"""On a GPU host, the train step really runs each GPU kernel: the fused norms' forward and
backward (on the implementation fused_norm.py prefers, and on Mosaic GPU alone, its rows whole and
in chunks), the loss's softmax
(Mosaic GPU) and the GELU-gradient epilogue (the cuBLASLt FFI handler), each found by name in the
compiled program of a small 406M-like step; and the experts' grouped matmuls against ragged_dot.

The kernel tests are skipped where JAX finds no GPU (CI's machines); run them on a GPU host with
`make test-gpu` (or `JAXDIST_GPU_TESTS=1 pytest tests/test_kernels_gpu.py`). The same small step with every
switch on XLA runs everywhere.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_config

from jaxdist import kernels
from jaxdist.kernels import fused_norm, fused_norm_mosaic, fused_norm_triton, gelu_matmul, grouped_matmul
from jaxdist.observe import hlo, timing
from jaxdist.train.trainer import Trainer

pytestmark = pytest.mark.gpu
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

LAYERS, SEQ, CHUNK = 2, 128, 32
KERNELS = ("add_norm_forward", "add_norm_backward", "softmax_grad")


def _backend(target: str) -> str:
    return "mosaic_gpu" if "mosaic_gpu" in target else "triton" if "triton" in target else target


def _small_step(tmp_path, kernel: str, gelu_kernel: str, d_model: int = 256) -> Trainer:
    """The small step's trainer, compiled and run once (its loss checked), with the norm and loss
    switches set to `kernel` and the GELU gradient's to `gelu_kernel`."""
    cfg = make_config(
        tmp_path,
        model={"vocab": 1024, "d_model": d_model, "layers": LAYERS, "heads": 4, "seq_len": SEQ, "norm": "layernorm",
               "activation": "gelu"},
        impl={"scan_layers": False, "loss_chunk": CHUNK, "norm_impl": kernel, "loss_impl": kernel,
              "gelu_grad_impl": gelu_kernel},
        train={"global_batch": 8},
        precision={"compute": "bfloat16"},
    )
    if kernel != "xla":
        assert "unavailable" not in kernels.build_for(cfg.model)
        gelu_matmul.unavailable_reason.cache_clear()
    trainer = Trainer.from_config(cfg, jax.devices()[:1])
    batch = trainer.global_batch(timing.random_batch(cfg))
    trainer.compile(batch)
    loss = float(trainer.step(batch)["loss"])
    assert 6.5 < loss < 7.5, loss  # about log(1024) = 6.93 for the untrained model
    return trainer


def test_the_small_step_runs_without_kernels(tmp_path):
    """The same step with every switch on XLA, on any backend (so what the GPU tests build stays
    runnable where CI runs): none of the kernels is called."""
    trainer = _small_step(tmp_path, "xla", "xla")
    kernel_targets = ("mosaic_gpu", "triton", gelu_matmul.HANDLER.target)
    assert not [call for call in hlo.custom_calls(trainer.compiled_text()) if _backend(call.target) in kernel_targets]


def _kernel_runs(tmp_path, d_model: int) -> collections.Counter:
    """(backend or FFI target, kernel name) -> executions per step, for the small step."""
    trainer = _small_step(tmp_path, "pallas", "cublaslt", d_model)
    runs = collections.Counter()
    for call in hlo.custom_calls(trainer.compiled_text()):
        names = [name for name in KERNELS if name in call.op_name]
        runs[_backend(call.target), names[0] if names else ""] += call.executions
    return runs


@on_gpu
@pytest.mark.parametrize("norms", ["preferred", "mosaic_gpu", "mosaic_gpu_chunks"])
def test_train_step_runs_every_kernel(tmp_path, monkeypatch, norms):
    d_model = 256
    if norms != "preferred":
        monkeypatch.setattr(fused_norm, "IMPLEMENTATIONS", (fused_norm_mosaic,))
    if norms == "mosaic_gpu_chunks":  # rows of two chunks, as the 1.4B model's 2048 features are
        d_model = 512
        monkeypatch.setattr(fused_norm_mosaic, "CHUNK", 256)
    runs = _kernel_runs(tmp_path, d_model)
    chosen = fused_norm.implementation(d_model, 8 * SEQ, jnp.bfloat16)
    norm_calls = 2 * LAYERS + 1  # before attention, before the MLP, and the final norm
    if chosen is fused_norm_triton:  # Triton's calls carry no kernel name: the norms are its only ones
        assert sum(n for (backend, _), n in runs.items() if backend == "triton") == 2 * norm_calls, runs
    else:
        assert runs["mosaic_gpu", "add_norm_forward"] == norm_calls, runs
        assert runs["mosaic_gpu", "add_norm_backward"] == norm_calls, runs
    assert runs["mosaic_gpu", "softmax_grad"] == SEQ // CHUNK, runs  # once per loss chunk
    assert runs[gelu_matmul.HANDLER.target, ""] == LAYERS, runs


@on_gpu
def test_the_experts_grouped_matmul_is_jaxs_kernel_with_ragged_dots_value_and_gradients():
    """jax's Mosaic GPU grouped matmuls (kernels/grouped_matmul.py) against `jax.lax.ragged_dot` in
    float32: an odd row count with rows after the groups (0 out and 0 gradient, where the kernel
    leaves them unwritten), an empty group, bf16 operands; and the compiled program calls Mosaic GPU
    three times (the forward, the rows' and the weights' gradients), not XLA's ragged dot."""
    rng = np.random.default_rng(0)
    rows, k, n = 1531, 256, 384
    groups = jnp.asarray([400, 0, 611, 300], jnp.int32)  # 1311 of 1531 rows
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.bfloat16)
    w = jnp.asarray(0.05 * rng.normal(size=(4, k, n)), jnp.bfloat16)
    probe = jnp.asarray(rng.normal(size=(rows, n)), jnp.float32)

    def loss(x, w, impl):
        if impl == "reference":
            out = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), groups)
        else:
            out = grouped_matmul.grouped(x, w, groups, impl)
        return jnp.sum(out.astype(jnp.float32) * probe), out

    step = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True), static_argnums=2)
    (_, out), (dx, dw) = step(x, w, "pallas")
    (_, ref), (dx_ref, dw_ref) = step(x, w, "reference")
    for got, want in ((out, ref), (dx, dx_ref), (dw, dw_ref)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.abs(got - want).max() <= 0.02 * np.abs(want).max(), (np.abs(got - want).max(), np.abs(want).max())
    assert np.abs(np.asarray(out[1311:], np.float32)).max() == 0 and np.abs(np.asarray(dx[1311:], np.float32)).max() == 0
    assert np.abs(np.asarray(dw[1], np.float32)).max() == 0
    text = step.lower(x, w, "pallas").compile().as_text()
    assert sum(_backend(call.target) == "mosaic_gpu" for call in hlo.custom_calls(text)) == 3
