"""Pipeline parallelism: a pipelined layer stack computes what the plain stack computes."""

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_config
from flax import nnx

from jaxdist import cli, models
from jaxdist.kernels import fused_norm, fused_norm_triton
from jaxdist.observe import hlo, memory
from jaxdist.parallel import layout as layout_lib
from jaxdist.parallel.feed import batch_sharding
from jaxdist.parallel import mesh as mesh_lib
from jaxdist.parallel import pipeline
from jaxdist.parallel import rules as rules_lib
from jaxdist.train.state import abstract_model, param_dict
from jaxdist.train.trainer import Trainer

pytestmark = pytest.mark.slow

# 8 layers so that stages x repeats in {2, 4, 8} divide them; small enough to compile in seconds.
PIPE_GPT = {"d_model": 32, "layers": 8, "heads": 4, "seq_len": 16, "vocab": 256}
BATCH = 16


def _compiled(fn, *args):
    """`jax.jit(fn)` compiled for `args`."""
    return jax.jit(fn).lower(*args).compile()


# -- the schedule on toy layers ---------------------------------------------------------------------


def _apply(layer, x, stacked, unroll):
    """`layer(h, w) -> (h, sums or None)` over the stack, one call per layer or a `lax.scan`: the
    output and the layers' sums stacked."""
    if unroll:
        sums = []
        for per_layer in stacked:
            x, layer_sums = layer(x, per_layer)
            sums.append(layer_sums)
        return x, jax.tree.map(lambda *layers: jnp.stack(layers), *sums)
    return jax.lax.scan(layer, x, stacked)


def _toy_layers(x, stacked, *, unroll, riders=()):
    """Each layer `tanh(h * scale + shift)`, plus each rider (a per-row value) where given; its sum
    over the rows is the layer's sum (as a mixture's token counts are)."""
    extra = sum(riders, jnp.zeros(()))

    def layer(h, w):
        out = jnp.tanh(h * w["scale"] + w["shift"] + extra)
        return out, out.sum(0)

    return _apply(layer, x, stacked, unroll)


@pytest.mark.parametrize(
    "stages, microbatches, repeats, hop, batch_rule",
    [(2, 6, 1, 1, ["data", "fsdp", "stage"]), (4, 6, 3, 1, ["data", "fsdp"]), (4, 6, 3, 1, ["data", "fsdp", "stage"]),
     (2, 2, 12, 1, ["data", "fsdp", "stage"]), (2, 3, 1, 2, ["data", "fsdp", "stage"]),
     (2, 4, 6, 2, ["data", "fsdp", "stage"]), (4, 12, 3, 2, ["data", "fsdp"])],
    ids=["S2_M6_gpipe_batch_over_stages", "S4_M6_R3_batch_replicated_over_stages", "S4_M6_R3_batch_over_stages",
         "S2_M2_R12_a_layer_a_lap", "S2_M3_gpipe_overlapped", "S2_M4_R6_overlapped", "S4_M12_R3_overlapped_laps_wait"],
)
def test_schedule_applies_every_layer_in_order(devices, stages, microbatches, repeats, hop, batch_rule):
    """GPipe, and circular with M not a multiple of S (laps wait M - S iterations at stage 0) and
    with M = S and one layer per lap (no wait: the largest microbatches at the smallest bubble); the
    batch outside the pipeline split over the stages or whole on each. With overlapped transfers
    (two iterations a stage): GPipe, circular with M = 2 S (no wait) and with laps that wait."""
    layers, width, batch = 24, 8, 24
    keys = jax.random.split(jax.random.key(0), 3)
    stacked = {
        "scale": 1 + 0.3 * jax.random.normal(keys[0], (layers, width)),
        "shift": 0.3 * jax.random.normal(keys[1], (layers, width)),
    }
    x = jax.random.normal(keys[2], (batch, width))
    # A per-row value every layer reads (as packed rows' documents): it must reach each stage with
    # its own microbatch, in every lap.
    rider = jnp.arange(batch, dtype=jnp.float32)[:, None] / batch
    mesh = mesh_lib.make_mesh(stage=stages, fsdp=-1)
    rules = rules_lib.preset("dp").override(activations={"batch": batch_rule})
    schedule = pipeline.Schedule(stages, microbatches, repeats, hop)

    def pipelined(stacked, x):
        with rules_lib.activation_rules(mesh, rules):
            return pipeline.pipeline(_toy_layers, stacked, x, schedule, ("batch", None),
                                     riders=[pipeline.Rider(rider, ("batch", None))])

    def loss(fn, stacked, x):  # and the layers' sums over the rows of every microbatch, in layer order
        out, sums = fn(stacked, x)
        return jnp.sum(out**2), sums

    plain = jax.value_and_grad(lambda s, x: loss(lambda s, x: _toy_layers(x, s, unroll=False, riders=(rider,)), s, x),
                               (0, 1), has_aux=True)
    expected = _compiled(plain, stacked, x)(stacked, x)
    piped = jax.value_and_grad(lambda s, x: loss(pipelined, s, x), (0, 1), has_aux=True)
    got = _compiled(piped, stacked, x)(stacked, x)
    jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6), got, expected)


@pytest.mark.parametrize("repeats, remat", [(1, False), (2, False), (2, True)], ids=["gpipe", "circular", "circular_remat"])
def test_unrolled_iterations_trace_the_stages_layers_once(devices, repeats, remat):
    """Every iteration runs the stages' layers on the same shapes: they are traced once for the whole
    step (forward and gradient), not once per iteration, which made start-up grow with M."""
    traces = []

    def counted_layers(x, layers, *, unroll, riders):
        traces.append(unroll)
        return _toy_layers(x, layers, unroll=unroll, riders=riders)

    layers, width, batch = 8, 8, 16
    stacked = {"scale": jnp.ones((layers, width)), "shift": jnp.zeros((layers, width))}
    mesh = mesh_lib.make_mesh(stage=2, fsdp=-1)
    rules = rules_lib.preset("dp")
    schedule = pipeline.Schedule(2, 4, repeats)
    assert schedule.iterations > 4

    def loss(stacked, x):
        with rules_lib.activation_rules(mesh, rules):
            return jnp.sum(pipeline.pipeline(counted_layers, stacked, x, schedule, ("batch", None), remat=remat)[0])

    jax.make_jaxpr(jax.value_and_grad(loss))(stacked, jnp.ones((batch, width)))
    assert traces == [True]


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in it."""
    yield from jaxpr.eqns
    for sub in jax.extend.core.subjaxprs(jaxpr):
        yield from _eqns(sub)


def _stage_calls_between_each_roll_and_its_input(jaxpr, stages: int) -> list[int]:
    """For each roll to the next stage (a one-in, one-out call of the stage-dim shape) whose input
    some stage computation made: how many of the stages' layer calls come between the newest one
    it depends on and the roll. 0: the roll waits for the iteration just before it."""
    newest: dict = {}  # var -> index of the newest stage call it depends on
    calls, between = 0, []
    for eqn in jaxpr.eqns:
        made_by = max((newest.get(v, -1) for v in eqn.invars if isinstance(v, jax.extend.core.Var)), default=-1)
        if eqn.primitive.name == "jit" and eqn.params["name"] == "_toy_layers":
            made_by, calls = calls, calls + 1
        elif (eqn.primitive.name == "custom_vjp_call" and len(eqn.invars) == len(eqn.outvars) == 1
              and eqn.invars[0].aval.shape == eqn.outvars[0].aval.shape and eqn.invars[0].aval.shape[0] == stages):
            if made_by >= 0:
                between.append(calls - 1 - made_by)
        for v in eqn.outvars:
            newest[v] = made_by
    return between


@pytest.mark.parametrize("hop", [1, 2], ids=["next_iteration", "overlapped"])
def test_overlapped_transfers_need_nothing_of_the_iteration_before_their_use(devices, hop):
    """Stage s + 1 uses stage s's output of iteration t in iteration t + 1, so the roll between them
    waits for iteration t and is waited for; with overlapped transfers it is used in t + 2, and the
    roll needs nothing of iteration t + 1's computation: it can run beside it."""
    layers, width, batch = 8, 8, 16
    stacked = {"scale": jnp.ones((layers, width)), "shift": jnp.zeros((layers, width))}
    mesh = mesh_lib.make_mesh(stage=2, fsdp=-1)
    schedule = pipeline.Schedule(2, 4, 2, hop)

    def forward(stacked, x):
        with rules_lib.activation_rules(mesh, rules_lib.preset("dp")):
            return pipeline.pipeline(_toy_layers, stacked, x, schedule, ("batch", None))

    jaxpr = jax.make_jaxpr(forward)(stacked, jnp.ones((batch, width))).jaxpr
    between = _stage_calls_between_each_roll_and_its_input(jaxpr, 2)
    assert len(between) == schedule.iterations - hop  # the first hop rolls move zeros
    assert set(between) == {hop - 1}


def test_an_iteration_whose_stages_are_in_two_laps_selects_their_weights_once(devices):
    """With R = 12 laps of one layer, M = S = 2: where stage 0 has begun a lap that stage 1 has not,
    each weight is picked from those two laps' layers by one select, not by a chain over all 12."""
    stages, micro, repeats, width = 2, 2, 12, 8
    stacked = {"scale": jnp.ones((stages * repeats, width)), "shift": jnp.zeros((stages * repeats, width))}
    mesh = mesh_lib.make_mesh(stage=stages, fsdp=-1)
    schedule = pipeline.Schedule(stages, micro, repeats)

    def run(stacked, x):
        with rules_lib.activation_rules(mesh, rules_lib.preset("dp")):
            return pipeline.pipeline(_toy_layers, stacked, x, schedule, ("batch", None))

    jaxpr = jax.make_jaxpr(run)(stacked, jnp.ones((16, width))).jaxpr
    weight_selects = [eqn for eqn in _eqns(jaxpr) if eqn.primitive.name == "select_n"
                      and eqn.outvars[0].aval.shape == (stages, width)]
    t = np.arange(schedule.iterations)[:, None]
    laps = np.clip((t - np.arange(stages)) // micro, 0, repeats - 1)
    two_laps = int(np.sum(laps[:, 0] != laps[:, 1]))
    assert two_laps == repeats - 1  # each lap's start but the first
    assert len(weight_selects) == two_laps * len(stacked)


@pytest.mark.parametrize("repeats", [1, 2], ids=["gpipe", "circular"])
def test_only_the_outputs_read_are_stacked(tmp_path, devices, repeats):
    """Unrolled, the step keeps the last M iterations' outputs (each microbatch's final pass), not
    every iteration's: the GPT's compiled step held a buffer stacked over all R x M + S - 1
    iterations, and its gradient as many zeros."""
    cfg = make_config(tmp_path, model={"vocab": 128, "d_model": 32, "layers": 4, "heads": 4, "seq_len": 16,
                                       "impl": {"scan_layers": True}},
                      mesh={"stage": 2, "data": 1, "fsdp": 1, "tensor": 1}, train={"global_batch": 8},
                      pipeline={"microbatches": 2, "repeats": repeats})
    trainer, _ = memory.compiled_trainer(cfg, devices[:2])
    text = trainer.compiled.as_text()
    schedule = pipeline.Schedule(2, 2, repeats)
    # (iterations kept, stages, rows, length, d_model), each device's part of the stages.
    assert re.search(r"\[2,1,4,16,32\]", text)  # the outputs read
    assert not re.search(rf"\[{schedule.iterations},1,4,16,32\]", text)


def _matmul_layers(x, stacked, *, unroll, riders):
    return _apply(lambda h, w: (jnp.tanh(h @ w), None), x, stacked, unroll)


@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "scanned"])
def test_remat_recomputes_each_iterations_forward_in_the_backward(devices, unroll):
    """`pipeline.remat`: the compiled gradient runs the stages' forward twice, so its flops grow by
    the forward's share (one matmul per layer on top of the backward's two: 4/3). Unrolled, XLA
    merged the recomputation with the forward it repeats unless prevented, and the step kept every
    activation, as if remat were off."""
    width, batch = 64, 256
    stacked = jnp.full((8, width, width), 0.01)
    x = jnp.ones((batch, width))
    mesh = mesh_lib.make_mesh(stage=2, fsdp=-1)
    rules = rules_lib.preset("dp")

    def flops(remat):
        def loss(stacked, x):
            with rules_lib.activation_rules(mesh, rules):
                out, _ = pipeline.pipeline(_matmul_layers, stacked, x, pipeline.Schedule(2, 4), ("batch", None),
                                           remat=remat, unroll=unroll)
            return jnp.sum(out)

        return _compiled(jax.grad(loss), stacked, x).cost_analysis()["flops"]

    assert flops(True) / flops(False) > 1.2


def test_bubble_is_the_idle_fraction():
    assert pipeline.Schedule(4, 8).bubble == pytest.approx(3 / 11)
    assert pipeline.Schedule(4, 8, repeats=2).bubble == pytest.approx(3 / 19)
    assert pipeline.Schedule(2, 4).iterations == 5
    # Overlapped transfers: two iterations a stage, so twice the idle iterations.
    assert pipeline.Schedule(4, 8, repeats=2, hop=2).bubble == pytest.approx(6 / 22)
    assert pipeline.Schedule(2, 4, hop=2).iterations == 6


# -- the GPT, pipelined over 8 CPU devices, against the plain model --------------------------------


def _pipe_config(tmp_path, stages=1, microbatches=1, repeats=1, data=1, tensor=1, remat=False, **sections):
    """The tiny pipeline GPT on a mesh of `stages` x `data` x `tensor` (fsdp fills the rest)."""
    defaults = {
        "model": PIPE_GPT,
        "mesh": {"stage": stages, "data": data, "tensor": tensor, "fsdp": -1},
        "pipeline": {"microbatches": microbatches, "repeats": repeats, "remat": remat},
        "train": {"global_batch": BATCH},
    }
    return make_config(tmp_path, **{**defaults, **sections})


def _loss_and_grads_fn(cfg):
    entry = models.get("gpt")
    graphdef = abstract_model(entry.create(cfg), cfg.seed).graphdef

    def loss_and_grads(params, batch):
        return jax.value_and_grad(lambda p: entry.loss(nnx.merge(graphdef, p), batch).mean)(params)

    return loss_and_grads


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Params, a batch, and the unpipelined loss and gradients on one device (compiled once)."""
    cfg = _pipe_config(tmp_path_factory.mktemp("reference"))
    params = _compiled(lambda: param_dict(models.get("gpt").create(cfg), cfg.seed))()
    tokens = np.random.default_rng(0).integers(0, PIPE_GPT["vocab"], (BATCH, PIPE_GPT["seq_len"] + 1))
    batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}
    loss, grads = _compiled(_loss_and_grads_fn(cfg), params, batch)(params, batch)
    return params, batch, float(loss), jax.device_get(grads)


def _max_relative_error(got, expected) -> float:
    """Largest |got - expected| of a leaf over that leaf's largest |expected|, across leaves."""
    errors = jax.tree.map(lambda g, e: float(jnp.max(jnp.abs(g - e)) / jnp.max(jnp.abs(e))), got, expected)
    return max(jax.tree.leaves(errors))


@pytest.mark.parametrize(
    "stages, microbatches, repeats, data, tensor, norm_impl, unroll, overlap",
    [(2, 4, 1, 2, 1, "xla", True, False), (2, 8, 2, 1, 2, "xla", True, False), (4, 4, 1, 1, 2, "pallas", True, False),
     (4, 8, 2, 2, 1, "xla", True, False), (4, 8, 2, 1, 2, "xla", False, False), (2, 2, 4, 2, 1, "xla", True, False),
     (2, 4, 2, 2, 1, "xla", False, True)],
    ids=["S2_M4_data2", "S2_M8_R2_tensor2", "S4_M4_tensor2_fused_norms", "S4_M8_R2_data2", "S4_M8_R2_tensor2_rolled",
         "S2_M2_R4_a_layer_a_lap_data2", "S2_M4_R2_overlapped_rolled_data2"],
)
def test_pipelined_loss_and_grads_match_unpipelined(tmp_path, monkeypatch, devices, reference, stages, microbatches,
                                                    repeats, data, tensor, norm_impl, unroll, overlap):
    """Also with the fused norm kernels (in Pallas's interpreter here) in the stages' unrolled layers,
    their backward traced outside the pipeline's rules; with the iterations as a rolled loop; and
    with overlapped transfers (rolled: the loop carries two iterations' outputs).
    The kernels are Triton's here: Mosaic GPU's interpreter deadlocks on a kernel batched by the
    stages' vmap (waiting in its shared-memory barrier); on a GPU the Mosaic GPU kernels run there."""
    if norm_impl == "pallas":
        monkeypatch.setattr(fused_norm, "IMPLEMENTATIONS", (fused_norm_triton,))
    params, batch, expected_loss, expected_grads = reference
    cfg = _pipe_config(tmp_path, stages, microbatches, repeats, data, tensor, impl={"norm_impl": norm_impl},
                       pipeline={"microbatches": microbatches, "repeats": repeats, "unroll": unroll,
                                 "overlap_transfers": overlap})
    layout = layout_lib.from_config(cfg, devices)
    mesh, rules = layout.mesh, layout.rules
    model = abstract_model(models.get("gpt").create(cfg), cfg.seed)
    abstract, names = model.params, model.names
    layouts = rules_lib.param_layouts(abstract, names, rules, mesh)
    sharded = jax.device_put(params, rules_lib.layout_shardings(layouts, mesh))
    assert sharded["blocks"]["mlp"]["up"].sharding.spec[0] == "stage"
    loss_and_grads = _loss_and_grads_fn(cfg)

    def step(p, b):
        with rules_lib.activation_rules(mesh, rules):
            return loss_and_grads(p, b)

    batch = jax.device_put(batch, batch_sharding(mesh, rules))
    loss, grads = _compiled(step, sharded, batch)(sharded, batch)
    assert abs(float(loss) - expected_loss) <= 1e-5 * abs(expected_loss)
    assert _max_relative_error(grads, expected_grads) <= 1e-5


def test_train_step_on_four_stages_matches_and_keeps_a_quarter_per_device(tmp_path, devices, reference):
    """The Trainer's step (rules from the config, gradient accumulation, circular schedule with
    remat) gets the reference gradients into Adam, and each device keeps a quarter of the stack."""
    params, batch, expected_loss, expected_grads = reference
    cfg = _pipe_config(
        tmp_path, stages=4, microbatches=4, repeats=2, data=2, remat=True,
        train={"global_batch": BATCH, "microbatches": 2}, optim={"name": "adamw", "clip_norm": None, "b1": 0.9},
    )
    trainer = Trainer.from_config(cfg)
    metrics = trainer.step(jax.device_get(batch))
    assert abs(float(metrics["loss"]) - expected_loss) <= 1e-5 * abs(expected_loss)
    expected_norm = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(expected_grads)))
    assert abs(float(metrics["grad_norm"]) - expected_norm) <= 1e-5 * expected_norm
    adam = [s for s in jax.tree.leaves(trainer.state.opt_state, is_leaf=_has_mu) if _has_mu(s)]
    assert len(adam) == 1
    # After one step Adam's first moment is (1 - b1) x the gradient.
    assert _max_relative_error(jax.tree.map(lambda m: m / 0.1, adam[0].mu), expected_grads) <= 1e-5

    stack = trainer.params["blocks"]
    stage_of = {device: coords[1] for coords, device in np.ndenumerate(trainer.mesh.devices)}
    per_device: dict = {}
    for leaf in jax.tree.leaves((stack, adam[0].mu["blocks"], adam[0].nu["blocks"])):
        for shard in leaf.addressable_shards:
            stage = stage_of[shard.device]
            assert list(range(leaf.shape[0])[shard.index[0]]) == [2 * stage, 2 * stage + 1]
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    stack_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(stack))
    # Parameters and both Adam moments of the layer stack: each device holds exactly a quarter.
    assert len(per_device) == 8 and set(per_device.values()) == {3 * stack_bytes // 4}


def _has_mu(x) -> bool:
    return hasattr(x, "mu")


# -- what the pipelined step runs: flops per device, loops, collectives --------------------------

# A vocabulary large enough that the output head and the loss dominate the step's flops.
HEAD_GPT = {**PIPE_GPT, "layers": 4, "vocab": 8192}
HEAD_BATCH, HEAD_MICROBATCHES = 8, 4


def _step_on_stages(tmp_path, stages: int, fsdp: int = 1, rows: int = HEAD_BATCH, unroll: bool = True):
    """The GPT's loss and gradients on `stages` x `fsdp` devices, and abstract inputs laid out for it."""
    cfg = _pipe_config(tmp_path, stages, HEAD_MICROBATCHES, model=HEAD_GPT, train={"global_batch": rows},
                       mesh={"stage": stages, "data": 1, "fsdp": fsdp, "tensor": 1},
                       pipeline={"microbatches": HEAD_MICROBATCHES, "unroll": unroll})
    layout = layout_lib.from_config(cfg, jax.devices()[:stages * fsdp])
    mesh, rules = layout.mesh, layout.rules
    model = abstract_model(models.get("gpt").create(cfg), cfg.seed)
    abstract, names = model.params, model.names
    shardings = rules_lib.layout_shardings(rules_lib.param_layouts(abstract, names, rules, mesh), mesh)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    tokens = jax.ShapeDtypeStruct((rows, HEAD_GPT["seq_len"]), jnp.int32, sharding=batch_sharding(mesh, rules))
    loss_and_grads = _loss_and_grads_fn(cfg)

    def step(p, b):
        with rules_lib.activation_rules(mesh, rules):
            return loss_and_grads(p, b)

    return step, params, {"inputs": tokens, "targets": tokens}


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    """The step on 2 stages: its jaxpr and its compiled program."""
    step, params, batch = _step_on_stages(tmp_path_factory.mktemp("two_stages"), 2)
    return jax.make_jaxpr(step)(params, batch), _compiled(step, params, batch)


def _flops(compiled) -> float:
    analysis = compiled.cost_analysis()
    return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]


def test_stages_split_the_rows_of_the_head_and_loss(tmp_path, devices, two_stages):
    """Outside the pipeline the batch is split over the stages too: with the head dominating, a
    stage device runs about half the flops of one device running the whole step, the layers of
    the bubble's iterations included (all replicated: 0.97)."""
    one_device = _compiled(*_step_on_stages(tmp_path, 1))
    ratio = _flops(two_stages[1]) / _flops(one_device)
    assert 0.45 <= ratio <= 0.65, ratio


def _scans(jaxpr) -> int:
    return len(re.findall(r"\bscan\[", str(jaxpr)))


def _rolls(iterations: int) -> range:
    """How many collective permutes the rolls make: one per iteration each way (XLA may drop the
    first forward one, a roll of zeros, and the last backward one, whose result is unused)."""
    return range(2 * iterations - 2, 2 * iterations + 1)


def test_stages_run_their_layers_unrolled_and_only_roll_between_iterations(tmp_path, devices, two_stages):
    """The iterations and a stage's layers are straight-line code (no scan in the traced step, no
    loop in the program), and the only permutes are the rolls, one per iteration each way."""
    jaxpr, compiled = two_stages
    assert _scans(jaxpr) == 0
    ops = hlo.collectives(compiled.as_text())
    assert not any(op.in_loop for op in ops)
    iterations = pipeline.Schedule(2, HEAD_MICROBATCHES).iterations
    assert sum(op.opcode == "collective-permute" for op in ops) in _rolls(iterations)


def test_rolled_iterations_loop_once_each_way_and_only_roll_inside(tmp_path, devices):
    """`pipeline.unroll=false`: one scan forward and one backward, and the one collective in each
    loop is the roll to the next stage, once per iteration."""
    step, params, batch = _step_on_stages(tmp_path, 2, unroll=False)
    compiled = _compiled(step, params, batch)
    assert _scans(jax.make_jaxpr(step)(params, batch)) == 2
    in_loops = [op for op in hlo.collectives(compiled.as_text()) if op.in_loop]
    iterations = pipeline.Schedule(2, HEAD_MICROBATCHES).iterations
    assert [(op.opcode, op.executions) for op in in_loops] == [("collective-permute", iterations)] * 2


def test_with_fsdp_the_embedding_lookup_moves_no_rows_between_devices(tmp_path, devices):
    """Under stage=2 x fsdp=4 the batch outside the pipeline is split over both axes and the
    embedding table over fsdp only. The table is gathered for the lookup (as FSDP gathers every
    weight): split, XLA could produce the looked-up rows only by replicating them and partitioning
    again, a reshuffle of activations through extra collective permutes and all-to-alls. The
    only permutes left are the rolls inside the loops."""
    step, params, batch = _step_on_stages(tmp_path, 2, fsdp=4, rows=2 * 4 * HEAD_MICROBATCHES)
    ops = hlo.collectives(_compiled(step, params, batch).as_text())
    iterations = pipeline.Schedule(2, HEAD_MICROBATCHES).iterations
    assert sum(op.opcode == "collective-permute" for op in ops) in _rolls(iterations)
    assert sum(op.opcode == "all-to-all" for op in ops) <= 2  # the microbatches to stage 0 and back


# -- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.layers=6", "pipeline.microbatches=4"],
         r"model.layers=6 is not divisible by mesh.stage x pipeline.repeats = 4 x 1 = 4"),
        (["pipeline.microbatches=8", "pipeline.repeats=4"],
         r"model.layers=8 is not divisible by mesh.stage x pipeline.repeats = 4 x 4 = 16"),
        (["pipeline.microbatches=2"], r"pipeline.microbatches=2 is less than mesh.stage=4"),
        (["pipeline.microbatches=8", "train.microbatches=2"],
         r"pipeline.microbatches=8 does not divide the 4 rows each batch shard gets"),
        (["pipeline.microbatches=4", "pipeline.repeats=2", "pipeline.overlap_transfers=true"],
         r"pipeline.microbatches=4 is less than 2 x mesh.stage = 8, which pipeline.overlap_transfers needs"),
    ],
    ids=["layers", "layers_repeats", "too_few_microbatches", "batch", "too_few_microbatches_to_overlap"],
)
def test_bad_pipeline_config_exits_2_before_compiling(tmp_path, capsys, compiles, overrides, message):
    cfg = _pipe_config(tmp_path, stages=4, microbatches=4)
    path = tmp_path / "pipe.yaml"
    path.write_text(cfg.to_yaml())
    assert cli.main(["train", str(path), "mesh.fsdp=1", "mesh.data=2", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxdist: error: ")
    assert re.search(message, err), err
    assert compiles.count == 0
