"""`model.impl.loss_chunk`: the fused, chunked cross-entropy is the plain loss with less memory.

Same loss and gradients as the unchunked `gpt.loss` (float32) under tensor-sharded vocabulary and
data parallelism, with and without eval weights, tied and untied head; a smaller compiled step;
the same training run; bad chunk sizes rejected before anything compiles. The one-pass logsumexp
is the two-pass one on extreme logits, and reads the logits in one reduction.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_config
from jaxpr_walk import equations
from flax import nnx

from jaxdist import cli, loop, models
from jaxdist.models import gpt
from jaxdist.models.cross_entropy import fused_linear_cross_entropy, reduce_logits
from jaxdist.observe import hlo
from jaxdist.parallel import feed
from jaxdist.parallel import layout as layout_lib
from jaxdist.parallel import mesh as mesh_lib
from jaxdist.parallel import rules as rules_lib
from jaxdist.train.accumulate import GradInputs, loss_and_grads
from jaxdist.train.options import InitOptions, StepLayout, StepOptions
from jaxdist.train.state import abstract_model, init_state, param_dict
from jaxdist.train.step import make_train_step

pytestmark = pytest.mark.slow

CHUNK = 8
VOCAB = 512  # divisible by tensor=2; the chunked scan then runs 32 / 8 = 4 chunks
GLOBAL_BATCH = 32


def _batch(seq_len: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, VOCAB, (GLOBAL_BATCH, seq_len + 1), dtype=np.int32)
    weights = rng.uniform(0.5, 1.5, GLOBAL_BATCH).astype(np.float32)
    weights[::3] = 0.0  # padding rows, as the eval iterator marks them
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}


def _losses_and_grads(cfg, params, batch, microbatches):
    """({with/without weights: (loss, grads), eval: loss}, compiled HLO) through the step's own
    `loss_and_grads` and, for eval, the loss alone, on cfg's mesh."""
    mesh = layout_lib.from_config(cfg).mesh
    rules = rules_lib.from_config(cfg.rules)
    abstract = abstract_model(models.get("gpt").create(cfg), cfg.seed)
    graphdef, abstract_params, names = abstract.graphdef, abstract.params, abstract.names
    param_shardings = rules_lib.layout_shardings(rules_lib.param_layouts(abstract_params, names, rules, mesh), mesh)

    def both(p, b):
        unweighted = {k: v for k, v in b.items() if k != "weights"}
        with rules_lib.activation_rules(mesh, rules):
            results = {
                name: (lambda out: (out.loss, out.grads))(loss_and_grads(
                    graphdef, gpt.loss, GradInputs(p), inputs, StepLayout(mesh, rules), param_shardings,
                    StepOptions(microbatches=microbatches),
                ))
                for name, inputs in (("weighted", b), ("unweighted", unweighted))
            }
            # As the evaluator scores a batch: the weighted loss alone, not differentiated.
            results["eval"] = gpt.loss(nnx.merge(graphdef, p), b).mean
            return results

    params = jax.device_put(params, param_shardings)
    batch = feed.assemble(batch, feed.batch_sharding(mesh, rules))
    compiled = jax.jit(both).lower(params, batch).compile()
    return jax.device_get(compiled(params, batch)), compiled.as_text()


def _relative_error(a, b) -> float:
    return float(np.linalg.norm(np.ravel(a - b)) / np.linalg.norm(np.ravel(b)))


FSDP4_TENSOR2 = ({"data": 1, "fsdp": 4, "tensor": 2}, {"preset": "fsdp_tp"}, 1)
DATA8_2MICROBATCHES = ({"data": 8, "fsdp": 1, "tensor": 1}, {"preset": "dp"}, 2)
FSDP8 = ({"data": 1, "fsdp": 8, "tensor": 1}, {"preset": "fsdp"}, 1)
# Context parallelism: each sequence of 32 in two parts over fsdp, each part two chunks of 8.
DATA4_CONTEXT2 = ({"data": 4, "fsdp": 2, "tensor": 1},
                  {"preset": "fsdp", "activations": {"batch": "data", "seq": "fsdp", "length": "fsdp"}}, 1)


@pytest.mark.parametrize(
    "layout, tied, impl",
    [(FSDP4_TENSOR2, False, "xla"), (FSDP4_TENSOR2, True, "xla"), (DATA8_2MICROBATCHES, False, "xla"),
     (DATA8_2MICROBATCHES, False, "pallas"), (FSDP8, True, "pallas"), (DATA4_CONTEXT2, False, "xla"),
     (DATA4_CONTEXT2, True, "xla")],
    ids=["fsdp4_tensor2-untied", "fsdp4_tensor2-tied", "data8_2microbatches-untied",
         "data8_2microbatches-untied-kernel", "fsdp8-tied-kernel", "data4_context2-untied",
         "data4_context2-tied"],
)
def test_loss_and_gradients_equal_the_unchunked_loss(tmp_path, layout, tied, impl):
    """fsdp_tp splits the vocabulary (head or tied embedding, and the logits) over tensor and the
    batch over fsdp; data8 with 2 microbatches runs the loss under the per-shard vmap of per_step
    gradient reduction; context2 splits each sequence over fsdp. `impl` pallas: each chunk's
    softmax and gradient by the Pallas kernel (kernels/softmax_grad.py, in the interpreter here),
    run per batch shard. (With the sequence split too, jax's interpreter of the kernel deadlocks on
    the CPU: the kernel sees the same per-device chunk there, and runs on GPUs.)"""
    mesh, rules, microbatches = layout

    def config(chunk):
        return make_config(
            tmp_path, mesh=mesh, rules=rules, train={"global_batch": GLOBAL_BATCH},
            model={"vocab": VOCAB, "layers": 1, "tied_embeddings": tied},
            impl={"loss_chunk": chunk, "loss_impl": impl if chunk else "auto"},
        )

    plain_cfg, chunked_cfg = config(0), config(CHUNK)
    init = jax.jit(lambda: param_dict(models.get("gpt").create(plain_cfg), 0))
    params = jax.device_get(init())
    batch = _batch(plain_cfg.model.seq_len)
    plain, _ = _losses_and_grads(plain_cfg, params, batch, microbatches)
    chunked, chunked_hlo = _losses_and_grads(chunked_cfg, params, batch, microbatches)

    for name in ("weighted", "unweighted"):
        (plain_loss, plain_grads), (loss, grads) = plain[name], chunked[name]
        assert np.isfinite(plain_loss) and plain_loss > 5.0  # about log(512) = 6.2 at init
        np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
        assert jax.tree.structure(grads) == jax.tree.structure(plain_grads)
        assert min(float(np.abs(g).max()) for g in jax.tree.leaves(plain_grads)) > 0
        errors = jax.tree.leaves(jax.tree.map(_relative_error, grads, plain_grads))
        assert max(errors) <= 1.5e-6, (name, max(errors))
    np.testing.assert_allclose(chunked["eval"], plain["eval"], rtol=1e-6)
    assert ("softmax_grad" in chunked_hlo) == (impl == "pallas")
    if microbatches == 1:
        np.testing.assert_allclose(plain["eval"], plain["weighted"][0], rtol=1e-6)
    # The weights matter: the weighted mean differs from the plain mean.
    assert abs(plain["weighted"][0] - plain["unweighted"][0]) > 1e-4
    # Inside the chunk loop only activations cross devices (the logsumexp and the hidden-state
    # gradient over a split vocabulary); the head's gradient, summed over the batch shards and the
    # sequence's parts, is reduced once after the loop.
    head_shard = chunked_cfg.model.d_model * VOCAB // mesh["tensor"]
    in_loop = [shape for op in hlo.collectives(chunked_hlo, hlo.REDUCTIONS) if op.in_loop for shape in op.operand_shapes]
    assert all(math.prod(shape) < head_shard for shape in in_loop), in_loop
    assert bool(in_loop) == (mesh["tensor"] > 1)


def test_bfloat16_compute_matches_the_unchunked_loss_to_bfloat16_rounding():
    """The GPU recipes' precision: bf16 hidden states and logits, float32 head and softmax."""
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (4, 64, 128)).astype(jnp.bfloat16)
    head = 0.1 * jax.random.normal(keys[1], (128, 1024))
    targets = jax.random.randint(keys[2], (4, 64), 0, 1024)

    def plain(hidden, head):
        logits = jnp.einsum("btd,dv->btv", hidden, head.astype(hidden.dtype), preferred_element_type=hidden.dtype)
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()

    def chunked(hidden, head):
        return fused_linear_cross_entropy(hidden, head, targets, chunk=16, logits_dtype=jnp.bfloat16) / targets.size

    reference = jax.jit(jax.value_and_grad(plain, (0, 1)))(hidden.astype(jnp.float32), head)
    (plain_loss, plain_grads), (loss, grads) = (
        jax.jit(jax.value_and_grad(f, (0, 1)))(hidden, head) for f in (plain, chunked)
    )
    assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.float32
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
    for got, unchunked, exact in zip(grads, plain_grads, reference[1]):
        error = _relative_error(np.asarray(got, np.float32), np.asarray(exact, np.float32))
        # Measured: hidden 2.5e-3 both ways; head 8.8e-4 chunked (float32 sums over chunks) vs 1.9e-3.
        assert error <= 1.05 * _relative_error(np.asarray(unchunked, np.float32), np.asarray(exact, np.float32))
        assert error < 4e-3


def _step_temp_bytes(cfg) -> int:
    """Temporary bytes per device of the real compiled train step for this config."""
    mesh = layout_lib.from_config(cfg, jax.devices()[:1]).mesh
    rules = rules_lib.from_config(cfg.rules)
    tx = optax.adamw(1e-3)
    layout = StepLayout(mesh, rules)
    state, shardings, graphdef, _ = init_state(models.get("gpt").create(cfg), tx, layout, InitOptions(seed=cfg.seed))
    step = make_train_step(graphdef, gpt.loss, tx, layout, shardings)
    tokens = np.zeros((cfg.train.global_batch, cfg.model.seq_len), np.int32)
    batch = feed.assemble({"inputs": tokens, "targets": tokens}, feed.batch_sharding(mesh, rules))
    return step.lower(state, None, batch).compile().memory_analysis().temp_size_in_bytes


def test_chunking_shrinks_the_compiled_steps_temporaries(tmp_path):
    """A short model where the (16, 128, 8192) float32 logits (64 MiB) dominate, on one device."""

    def config(chunk):
        return make_config(
            tmp_path, mesh={"data": 1, "fsdp": 1, "tensor": 1}, rules={"preset": "dp"},
            model={"vocab": 8192, "layers": 1, "seq_len": 128}, impl={"loss_chunk": chunk},
        )

    plain, chunked = _step_temp_bytes(config(0)), _step_temp_bytes(config(CHUNK))
    logits_bytes = 16 * 128 * 8192 * 4
    # Measured on CPU: 158.9 MiB -> 38.9 MiB (4.1x). The plain step holds the whole logits and
    # their gradient (2 x 64 MiB); the chunked one 8 of 128 positions of each, besides the ~29 MiB
    # the rest of the step needs (this model at vocab 256: 28.9 MiB).
    assert plain > 2 * logits_bytes
    assert plain >= 3.5 * chunked, (plain / 2**20, chunked / 2**20)
    assert plain - chunked > 1.5 * logits_bytes


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_training_run_is_the_same_with_chunking(tmp_path):
    """The real loop (`jaxdist train`) on a tensor-sharded vocabulary, with the switch off and on."""
    runs = {}
    for chunk in (0, CHUNK):
        run_dir = tmp_path / f"chunk{chunk}"
        loop.train(make_config(
            run_dir, mesh={"data": 1, "fsdp": 4, "tensor": 2}, rules={"preset": "fsdp_tp"},
            model={"layers": 1}, impl={"loss_chunk": chunk}, train={"steps": 5},
        ))
        runs[chunk] = [record["loss"] for record in _records(run_dir)]
    plain, chunked = runs[0], runs[CHUNK]
    assert len(chunked) == 5
    np.testing.assert_allclose(chunked, plain, rtol=1e-5)
    assert plain[-1] < plain[0] - 0.1  # it trains: the comparison is not of constants


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(make_config(tmp_path / "run").to_yaml())
    return path


@pytest.mark.parametrize(
    "override, must_mention",
    [
        ("model.impl.loss_chunk=5", ["model.impl.loss_chunk=5", "model.seq_len=32", "divisor of 32"]),
        ("model.impl.loss_chunk=-8", ["model.impl.loss_chunk=-8", "greater than or equal to 0"]),
        ("model.impl.loss_impl=pallas", ["model.impl.loss_impl=pallas", "model.impl.loss_chunk > 0"]),
    ],
)
def test_bad_chunk_exits_2_before_compiling(config_file, capsys, compiles, override, must_mention):
    code = cli.main(["train", str(config_file), override])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    for text in must_mention:
        assert text in err, (text, err)
    assert compiles.count == 0


def test_one_pass_logsumexp_matches_two_passes_and_reduces_once():
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 30.0, (3, 5, VOCAB)).astype(np.float32)
    logits[0, 0, 7] = 3e4           # one huge logit: every other term rescales against it
    logits[1, 2] = -1e4             # a row far below zero
    logits[2, 1, ::2] = -np.inf     # masked entries
    targets = rng.integers(0, VOCAB, (3, 5))
    is_target = jnp.arange(VOCAB) == targets[..., None]

    one = jax.jit(lambda x, t: reduce_logits(x, t, one_pass=True))
    lse, target_logit = one(logits, is_target)
    want_lse, want_target = reduce_logits(jnp.asarray(logits), is_target, one_pass=False)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    np.testing.assert_array_equal(target_logit, want_target)
    assert lse[0, 0] == 3e4 and np.isfinite(lse).all()
    # One reduction over the logits: max, sum of exponentials and target logit in one kernel.
    assert one.lower(logits, is_target).compile().as_text().count(" reduce(") == 1


def _sharding_constraints(jaxpr):
    """(in a loop?, shape, spec) of every sharding constraint in a jaxpr and its sub-jaxprs."""
    return [(in_loop, eqn.invars[0].aval.shape, tuple(eqn.params["sharding"].spec))
            for eqn, in_loop in equations(jaxpr) if eqn.primitive.name == "sharding_constraint"]


def test_the_head_is_laid_out_whole_over_fsdp_before_the_chunk_loop():
    """Under FSDP the head is split along `embed`; the chunk loop reads it whole. Constrained before
    the loop, it is gathered once per step (on GPU, XLA otherwise gathered it in every chunk)."""
    mesh = mesh_lib.make_mesh(fsdp=2, tensor=2, devices=jax.devices()[:4])
    hidden = jnp.zeros((4, 32, 64), jnp.bfloat16)
    head = jnp.zeros((64, VOCAB), jnp.float32)
    targets = jnp.zeros((4, 32), jnp.int32)

    def loss(hidden, head):
        return fused_linear_cross_entropy(hidden, head, targets, chunk=CHUNK, logits_dtype=jnp.bfloat16)

    with rules_lib.activation_rules(mesh, rules_lib.preset("fsdp_tp")):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(hidden, head).jaxpr
    head_layouts = [(in_loop, spec) for in_loop, shape, spec in _sharding_constraints(jaxpr) if shape == (64, VOCAB)]
    assert head_layouts == [(False, (None, "tensor"))], head_layouts


@pytest.mark.parametrize("chunk, loop_reductions", [(8, False), (32, True)], ids=["parts_chunked", "whole_chunks"])
def test_a_split_sequence_is_chunked_by_parts_where_they_hold_whole_chunks(tmp_path, chunk, loop_reductions):
    """Sequences of 64 over fsdp=4: parts of 16 hold two chunks of 8, so each device scores its own
    part and the loop has no cross-device sum; a chunk of 32 straddles two parts, and the loss
    chunks the whole sequence as without the split (the head's gradient then summed in the loop).
    Both are the unchunked loss."""
    cfg = make_config(tmp_path, mesh={"data": 2, "fsdp": 4, "tensor": 1},
                      rules={"preset": "fsdp", "activations": {"batch": "data", "seq": "fsdp", "length": "fsdp"}})
    mesh = mesh_lib.make_mesh(data=2, fsdp=4, devices=jax.devices()[:8])
    rules = rules_lib.from_config(cfg.rules)
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (4, 64, 64), jnp.float32)
    head = 0.1 * jax.random.normal(keys[1], (64, VOCAB), jnp.float32)
    targets = jax.random.randint(keys[2], (4, 64), 0, VOCAB)

    def chunked(hidden, head):
        with rules_lib.activation_rules(mesh, rules):
            return fused_linear_cross_entropy(hidden, head, targets, chunk=chunk, impl="xla") / targets.size

    def plain(hidden, head):
        return optax.softmax_cross_entropy_with_integer_labels(hidden @ head, targets).mean()

    compiled = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1))).lower(hidden, head).compile()
    loss, grads = compiled(hidden, head)
    want_loss, want_grads = jax.value_and_grad(plain, argnums=(0, 1))(hidden, head)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for got, want in zip(grads, want_grads):
        assert _relative_error(np.asarray(got), np.asarray(want)) < 1e-6
    in_loop = [op for op in hlo.collectives(compiled.as_text(), hlo.REDUCTIONS) if op.in_loop]
    assert bool(in_loop) == loop_reductions, in_loop


def test_soft_capped_logits_give_the_unchunked_loss_and_gradients():
    """Gemma 2's cap on the output logits, 8 x tanh(logit / 8), inside the chunked loss: its value and
    gradients (through the cap) are those of the capped logits' plain cross-entropy, per-token
    weights included; uncapped they differ (the cap bites)."""
    keys = jax.random.split(jax.random.key(1), 4)
    hidden = jax.random.normal(keys[0], (2, 32, 64), jnp.float32)
    head = 0.5 * jax.random.normal(keys[1], (64, VOCAB), jnp.float32)
    targets = jax.random.randint(keys[2], (2, 32), 0, VOCAB)
    weights = (jax.random.uniform(keys[3], (2, 32)) > 0.25).astype(jnp.float32)

    def chunked(hidden, head, softcap=8.0):
        return fused_linear_cross_entropy(hidden, head, targets, weights, chunk=8, impl="xla", softcap=softcap)

    def plain(hidden, head):
        logits = 8.0 * jnp.tanh(hidden @ head / 8.0)
        return (optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights).sum()

    loss, grads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(hidden, head)
    want_loss, want_grads = jax.value_and_grad(plain, argnums=(0, 1))(hidden, head)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for got, want in zip(grads, want_grads):
        assert _relative_error(np.asarray(got), np.asarray(want)) < 1e-5
    assert abs(float(chunked(hidden, head, None)) - float(want_loss)) > 0.1 * float(want_loss)
    with pytest.raises(ValueError, match="impl='pallas' does not cap the logits"):
        fused_linear_cross_entropy(hidden, head, targets, chunk=8, impl="pallas", softcap=8.0)
