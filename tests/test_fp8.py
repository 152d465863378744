"""FP8 matmuls (models/fp8.py, `precision.fp8`): e4m3 operands forward, the input's gradient from an
e5m2 output gradient, the weight's in the compute dtype; each FP8 tensor scaled by its current
absolute maximum. The CPU has no FP8 GEMMs, so these tests make the run believe
it has (XLA on CPU computes the same quantized products in wider floats); the GPU test checks that
XLA turns the projections into cuBLASLt FP8 GEMMs."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import logged_losses, make_config

from jaxdist import loop
from jaxdist.observe import memory
from jaxdist.models import fp8
from jaxdist.models.dtypes import fp8_unavailable

SPEC = "btd,df->btf"


def _operands():
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (4, 32, 64), jnp.bfloat16)
    w = (0.02 * jax.random.normal(keys[1], (64, 128))).astype(jnp.bfloat16)
    d_out = jax.random.normal(keys[2], (4, 32, 128), jnp.bfloat16)
    return x, w, d_out


def _relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_quantize_maps_the_largest_magnitude_into_the_formats_top_octave():
    x = jnp.array([[-3.0, 0.5], [1.5, 0.0]], jnp.bfloat16)
    # Rounded to the nearest: within half a step, 2^-4 of the value in e4m3, 2^-3 in e5m2. The scale
    # is the power of two at or above amax / largest: the largest magnitude lands within a factor 2
    # below the format's largest value.
    for dtype, largest, within in ((fp8.FORWARD, 448.0, 2**-4), (fp8.GRADIENT, 57344.0, 2**-3)):
        quantized, scale = fp8.quantize(x, dtype)
        assert quantized.dtype == dtype and scale.dtype == jnp.float32
        assert float(scale) == 2.0 ** np.ceil(np.log2(3.0 / largest))
        assert largest / 2 < -float(quantized.astype(jnp.float32)[0, 0]) <= largest
        np.testing.assert_allclose(fp8.dequantize(quantized, scale, jnp.float32), x.astype(jnp.float32), rtol=within)
    zeros, scale = fp8.quantize(jnp.zeros((3,), jnp.bfloat16), fp8.FORWARD)
    assert float(scale) == 1.0 and not np.any(np.asarray(zeros, np.float32))


def test_the_forward_and_backward_are_products_of_quantized_operands():
    x, w, d_out = _operands()
    out, transpose = jax.vjp(lambda x, w: fp8.einsum(SPEC, x, w), x, w)
    d_x, d_w = transpose(d_out)
    assert out.dtype == d_x.dtype == d_w.dtype == jnp.bfloat16

    def through(value, dtype):
        return fp8.dequantize(*fp8.quantize(value, dtype), jnp.bfloat16)

    x8, w8, g8 = through(x, fp8.FORWARD), through(w, fp8.FORWARD), through(d_out, fp8.GRADIENT)
    np.testing.assert_array_equal(out, jnp.einsum(SPEC, x8, w8))
    np.testing.assert_array_equal(d_x, jnp.einsum("btf,df->btd", g8, w8))
    np.testing.assert_array_equal(d_w, jnp.einsum("btd,btf->df", x, d_out))  # the compute dtype's product
    # And near the bfloat16 products: e4m3 keeps 3 mantissa bits, e5m2 2.
    exact_out, exact_transpose = jax.vjp(lambda x, w: jnp.einsum(SPEC, x, w), x, w)
    assert _relative_error(out, exact_out) < 0.05
    exact_d_x, exact_d_w = exact_transpose(d_out)
    assert _relative_error(d_x, exact_d_x) < 0.08
    np.testing.assert_array_equal(d_w, exact_d_w)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_a_small_gradient_keeps_its_scale_in_float32(dtype):
    """An output gradient of absolute maximum 1e-3 has the e5m2 scale 1e-3 / 57,344 = 1.7e-8: below
    float16's smallest number (6e-8), so its scale cast to the compute dtype flushed to zero, and with
    it the input's gradient; in bfloat16 each scale rounded. Every amax and scale is float32 in the
    program, and what the compute dtype receives of a scale is its exact copy (a power of two)."""
    x, w, d_out = (a.astype(dtype) for a in _operands())
    d_out = (d_out * (1e-3 / jnp.max(jnp.abs(d_out.astype(jnp.float32))))).astype(dtype)
    backward = jax.jit(lambda x, w, g: jax.vjp(lambda x, w: fp8.einsum(SPEC, x, w), x, w)[1](g))
    d_x, _ = backward(x, w, d_out)
    exact = jnp.einsum("btf,df->btd", d_out.astype(jnp.float32), w.astype(jnp.float32))
    assert d_x.dtype == dtype and _relative_error(d_x, exact) < 0.06
    for value, fmt in ((d_out, fp8.GRADIENT), (w, fp8.FORWARD)):
        _, scale = fp8.quantize(value, fmt)
        assert scale.dtype == jnp.float32 and float(scale.astype(dtype)) == float(scale) > 0
        assert float(scale) == 2.0 ** round(np.log2(float(scale)))
    scalar = {jnp.float16: "tensor<f16>", jnp.bfloat16: "tensor<bf16>"}[dtype]
    made = [line for line in backward.lower(x, w, d_out).as_text().splitlines() if f"-> {scalar}" in line
            or (f": {scalar}" in line and "=" in line)]
    assert made and all("stablehlo.convert" in line and "(tensor<f32>)" in line for line in made), made


def test_a_non_finite_operand_makes_the_output_non_finite():
    x, w, _ = _operands()
    out = fp8.einsum(SPEC, x.at[0, 0, 0].set(jnp.inf), w)
    assert not np.all(np.isfinite(np.asarray(out, np.float32)))


def test_fp8_needs_hopper_class_gpus_and_xlas_triton_gemms_off(monkeypatch):
    hopper = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200")
    ampere = types.SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=false")
    assert fp8.supported([hopper, hopper]) and fp8.unavailable_reason([hopper]) is None
    assert "NVIDIA A100 (gpu) has no FP8 matmuls" in fp8.unavailable_reason([hopper, ampere])
    assert "has no FP8 matmuls" in fp8.unavailable_reason(jax.devices("cpu")[:1])
    # XLA's default, or a user's flag: Triton takes the dots before cuBLASLt's FP8 GEMMs can.
    for flags in ("", "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_triton_gemm=true"):
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert not fp8.supported([hopper])
        assert "jaxdist.gpu_defaults()" in fp8.unavailable_reason([hopper])


@pytest.fixture
def fp8_everywhere(monkeypatch):
    """The CPU taken for a device with FP8 GEMMs."""
    monkeypatch.setattr(fp8, "supported", lambda devices=None: True)


TRAIN = {"steps": 40, "global_batch": 16}
PRECISION = {"compute": "bfloat16", "fp8": True}


@pytest.mark.slow
def test_training_in_fp8_follows_bfloat16(tmp_path, fp8_everywhere, capsys):
    with_fp8 = loop.train(make_config(tmp_path / "fp8", train=TRAIN, precision=PRECISION, log={"every": 5}),
                          devices=jax.devices()[:1])
    assert "has no FP8 matmuls" not in capsys.readouterr().out
    # The step quantizes to both formats: e4m3 operands, e5m2 output gradients.
    text = with_fp8.compiled_text()
    assert "f8e4m3fn" in text and "f8e5m2" in text
    loop.train(make_config(tmp_path / "bf16", train=TRAIN, precision={"compute": "bfloat16"}, log={"every": 5}),
               devices=jax.devices()[:1])
    fp8_losses, bf16_losses = logged_losses(tmp_path / "fp8"), logged_losses(tmp_path / "bf16")
    assert fp8_losses[-1] < 0.8 * fp8_losses[0]  # it learns
    assert fp8_losses[-1] == pytest.approx(bf16_losses[-1], rel=0.02)
    assert fp8_losses != bf16_losses


LLAMA_LIKE = {"d_model": 64, "layers": 2, "heads": 4, "kv_heads": 2, "seq_len": 32, "mlp_ratio": 4,
              "norm": "rmsnorm", "positions": "rope", "activation": "swiglu", "biases": "qkv"}


@pytest.mark.slow
@pytest.mark.parametrize("model", [{}, LLAMA_LIKE], ids=["gpt", "llama_like"])
def test_fp8_steps_are_the_same_on_every_layout(tmp_path, fp8_everywhere, model):
    # Each scale is the whole tensor's maximum, whatever splits it: every layout quantizes the same
    # (the Llama-like model: grouped-query q and kv projections, SwiGLU's gate).
    precision = {"compute": "float32", "fp8": True}
    train = {"steps": 6, "global_batch": 16}
    loop.train(make_config(tmp_path / "one", train=train, precision=precision, model=model,
                           mesh={"data": 1, "fsdp": 1, "tensor": 1}, rules={"preset": "dp"}),
               devices=jax.devices()[:1])
    split = loop.train(make_config(tmp_path / "split", train=train, precision=precision, model=model,
                                   mesh={"data": 2, "fsdp": 2, "tensor": 2}, rules={"preset": "fsdp_tp"}))
    assert "f8e4m3fn" in split.compiled_text() and "f8e5m2" in split.compiled_text()
    # FP8 moves these losses by about 2e-4 from float32's; rounding that lands an element on the
    # other side of an FP8 step moves them by about 3e-5 between layouts.
    np.testing.assert_allclose(logged_losses(tmp_path / "split"), logged_losses(tmp_path / "one"), rtol=1e-4, atol=0)


@pytest.mark.slow
def test_fp8_stages_of_a_pipeline_train_as_accumulation_does(tmp_path, fp8_everywhere):
    # Each stage quantizes its own microbatch's activations, as accumulation over the same
    # microbatches does on one device; the bubble's idle iterations (zeros) leave no trace.
    precision = {"compute": "float32", "fp8": True}
    train = {"steps": 4, "global_batch": 8}
    loop.train(make_config(tmp_path / "one", train={**train, "microbatches": 2}, precision=precision,
                           mesh={"data": 1, "fsdp": 1, "tensor": 1}, rules={"preset": "dp"}),
               devices=jax.devices()[:1])
    piped = loop.train(make_config(tmp_path / "piped", train=train, precision=precision, pipeline={"microbatches": 2},
                                   mesh={"data": 1, "fsdp": 1, "tensor": 1, "stage": 2}, rules={"preset": "dp"}),
                       devices=jax.devices()[:2])
    assert "f8e4m3fn" in piped.compiled_text()
    piped_losses, one = logged_losses(tmp_path / "piped"), logged_losses(tmp_path / "one")
    assert np.all(np.isfinite(piped_losses))
    np.testing.assert_allclose(piped_losses, one, rtol=1e-4, atol=0)


@pytest.mark.skipif(jax.default_backend() == "gpu" and fp8.supported(), reason="this device has FP8 GEMMs")
def test_without_fp8_hardware_the_run_says_so_once_and_runs_in_the_compute_dtype(tmp_path, capsys):
    cfg = make_config(tmp_path / "asked", train={"steps": 3}, precision=PRECISION)
    assert "has no FP8 matmuls" in fp8_unavailable(cfg.precision)
    loop.train(cfg, devices=jax.devices()[:1])
    lines = [line for line in capsys.readouterr().out.splitlines() if "precision.fp8" in line]
    assert len(lines) == 1 and "the projections run in bfloat16" in lines[0], lines
    loop.train(make_config(tmp_path / "plain", train={"steps": 3}, precision={"compute": "bfloat16"}),
               devices=jax.devices()[:1])
    assert logged_losses(tmp_path / "asked") == logged_losses(tmp_path / "plain")


@pytest.mark.gpu
@pytest.mark.skipif(not fp8.supported(), reason="needs a GPU with FP8 GEMMs (compute capability 8.9+)")
def test_on_hopper_the_projections_are_cublaslt_fp8_gemms(tmp_path):
    cfg = make_config(tmp_path, train={"steps": 2}, precision=PRECISION,
                      model={"d_model": 128, "heads": 4, "layers": 2, "seq_len": 64})
    text = loop.train(cfg, devices=jax.devices()[:1]).compiled_text()
    gemms = text.count('custom_call_target="__cublas$lt$matmul$f8"')
    # The scanned layers' body: q/k/v (which XLA may merge, one operand shared), out, up and down
    # forward, and as many input gradients backward (9 on an H200 with jax 0.11.2); the weight
    # gradients stay bfloat16 GEMMs.
    assert gemms >= 8, gemms
    assert text.count('custom_call_target="__cublas$lt$matmul"') >= 6


@pytest.mark.gpu
def test_the_fp8_step_needs_no_more_memory_than_bfloat16s(tmp_path, fp8_everywhere):
    # What the backward keeps is what bfloat16's keeps: each projection's input in the compute
    # dtype. Autodiff of GELU's formula would keep its tanh too: one more activation of the MLP's
    # width per layer.
    model = {"d_model": 128, "layers": 2, "heads": 4, "seq_len": 128}
    temporaries = {}
    for name, precision in (("bfloat16", {"compute": "bfloat16"}), ("fp8", PRECISION)):
        cfg = make_config(tmp_path, train={"global_batch": 16}, precision=precision, model=model,
                          mesh={"data": 1, "fsdp": 1, "tensor": 1}, rules={"preset": "dp"})
        trainer, _ = memory.compiled_trainer(cfg, jax.devices()[:1])
        temporaries[name] = trainer.compiled.memory_analysis().temp_size_in_bytes
    # Within 1%, besides the FP8 weight copies: on Hopper a weight and its transpose (an FP8 GEMM
    # contracts both operands along their last dimension), a byte per parameter each, of q, k, v
    # and out (d x d) and up and down (d x 4d). The tanh took 42% more here.
    projection_params = model["layers"] * 12 * model["d_model"] ** 2
    assert temporaries["fp8"] <= 1.01 * temporaries["bfloat16"] + 2 * projection_params, temporaries
