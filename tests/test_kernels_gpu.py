"""On a GPU host, the train step really runs each GPU kernel: the fused norms' forward and
backward and the loss's softmax (Mosaic GPU kernels), and the GELU-gradient epilogue (the cuBLASLt
FFI handler), found by name in the compiled program of a small 406M-like step.

Skipped where JAX finds no GPU (CI's machines); run it on a GPU host with
`pytest tests/test_kernels_gpu.py`.
"""

import collections

import jax
import pytest
from conftest import make_config

from jaxdist import kernels
from jaxdist.kernels import gelu_matmul
from jaxdist.observe import bench, hlo
from jaxdist.train.trainer import Trainer

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

LAYERS, SEQ, CHUNK = 2, 128, 32
MOSAIC_KERNELS = ("add_norm_forward", "add_norm_backward", "softmax_grad")


def test_train_step_runs_every_kernel(tmp_path):
    cfg = make_config(
        tmp_path,
        model={"vocab": 1024, "d_model": 256, "layers": LAYERS, "heads": 4, "seq_len": SEQ, "norm": "layernorm",
               "activation": "gelu"},
        impl={"scan_layers": False, "loss_chunk": CHUNK, "norm_impl": "pallas", "loss_impl": "pallas",
              "gelu_grad_impl": "cublaslt"},
        train={"global_batch": 8},
        precision={"compute": "bfloat16"},
    )
    assert "unavailable" not in kernels.build_for(cfg.model, cfg.impl)
    gelu_matmul.unavailable_reason.cache_clear()
    trainer = Trainer.from_config(cfg, jax.devices()[:1])
    batch = trainer.global_batch(bench.random_tokens(cfg))
    trainer.compile(batch)

    runs = collections.Counter()
    for call in hlo.custom_calls(trainer.compiled_text()):
        if call.target.startswith("mosaic_gpu"):  # named by the kernel's scope in the op path
            [kernel] = set(MOSAIC_KERNELS) & set(call.op_name.split("/"))
        else:
            kernel = call.target
        runs[kernel] += call.executions
    norms = 2 * LAYERS + 1  # before attention, before the MLP, and the final norm
    assert runs["add_norm_forward"] == norms
    assert runs["add_norm_backward"] == norms
    assert runs["softmax_grad"] == SEQ // CHUNK  # once per loss chunk
    assert runs[gelu_matmul.HANDLER.target] == LAYERS
    loss = float(trainer.step(batch)["loss"])
    assert 6.5 < loss < 7.5, loss  # about log(1024) = 6.93 for the untrained model
