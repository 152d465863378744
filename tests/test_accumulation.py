"""Gradient accumulation: k microbatches make the same step as one batch, with one reduction per step."""

import dataclasses
import math

import jax
import numpy as np
import pytest
from conftest import make_config
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist import models
from jaxdist.observe import hlo
from jaxdist.parallel import feed
from jaxdist.parallel import layout as layout_lib
from jaxdist.parallel import rules as rules_lib
from jaxdist.train.optim import build_optimizer
from jaxdist.train.options import StepLayout, StepOptions
from jaxdist.train.state import TrainState, abstract_model, opt_state_shardings, param_dict
from jaxdist.train.step import make_train_step

pytestmark = pytest.mark.slow

LAYOUTS = {
    "data8": ({"data": 8, "fsdp": 1, "tensor": 1}, "dp"),
    "fsdp8": ({"data": 1, "fsdp": 8, "tensor": 1}, "fsdp"),
    "data2_tensor4": ({"data": 2, "fsdp": 1, "tensor": 4}, "tp"),
    "data2_fsdp2_tensor2": ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp"),
}
MICROBATCHES = (1, 2, 4)
GLOBAL_BATCH = 32
# Sizes chosen so that no activation has the shape of a gradient (the HLO check matches shapes).
MODEL = {"d_model": 48, "heads": 4, "layers": 2, "seq_len": 24, "mlp_ratio": 3}
LR = 0.5


def _config(tmp_path, layout: str, microbatches: int, grad_reduction: str = "per_step"):
    mesh, preset = LAYOUTS[layout]
    return make_config(
        tmp_path, mesh=mesh, rules={"preset": preset}, model=MODEL,
        train={"global_batch": GLOBAL_BATCH, "microbatches": microbatches, "grad_reduction": grad_reduction},
        optim={"name": "sgd", "lr": LR, "momentum": 0.0, "clip_norm": None},
    )


def _batch(seq_len: int) -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(7).integers(0, 256, (GLOBAL_BATCH, seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@dataclasses.dataclass
class Step:
    loss: float
    update: dict  # new params - old params, on the host
    hlo: str  # the compiled step
    mesh: Mesh
    layouts: list  # ParamLayout per parameter


@pytest.fixture(scope="module")
def initial_params(tmp_path_factory):
    """The tiny GPT's initial parameters, on the host: one init, placed into every layout."""
    cfg = _config(tmp_path_factory.mktemp("init"), "data8", 1)
    init = jax.jit(lambda: param_dict(models.get("gpt").create(cfg), cfg.seed))
    return jax.device_get(init())


def _one_step(cfg, initial_params) -> Step:
    """One SGD step through the config's optimizer and the real compiled step, on the config's mesh."""
    mesh = layout_lib.from_config(cfg).mesh
    rules = rules_lib.from_config(cfg.rules)
    abstract = abstract_model(models.get("gpt").create(cfg), cfg.seed)
    graphdef, abstract_params, names = abstract.graphdef, abstract.params, abstract.names
    layouts = rules_lib.param_layouts(abstract_params, names, rules, mesh)
    param_shardings = rules_lib.layout_shardings(layouts, mesh)
    tx, schedule = build_optimizer(cfg.optim, cfg.train, names, abstract.roles)
    shardings = TrainState(
        step=NamedSharding(mesh, PartitionSpec()), params=param_shardings,
        opt_state=opt_state_shardings(tx, abstract_params, param_shardings, mesh),
        skipped_steps=NamedSharding(mesh, PartitionSpec()),
    )
    state = jax.device_put(
        TrainState(step=np.int32(0), params=initial_params, opt_state=tx.init(initial_params),
                   skipped_steps=np.int32(0)), shardings
    )
    options = StepOptions(microbatches=cfg.train.microbatches, grad_reduction=cfg.train.grad_reduction,
                          schedule=schedule)
    step = make_train_step(graphdef, models.get("gpt").loss, tx, StepLayout(mesh, rules), shardings, options)
    batch = feed.assemble(_batch(cfg.model.seq_len), feed.batch_sharding(mesh, rules))
    compiled = step.lower(state, None, batch).compile()
    state, _, metrics = compiled(state, None, batch)
    update = jax.tree.map(lambda new, old: new - old, jax.device_get(state.params), initial_params)
    layouts = jax.tree.leaves(layouts, is_leaf=_is_layout)
    return Step(float(metrics["loss"]), update, compiled.as_text(), mesh, layouts)


def _is_layout(x) -> bool:
    return isinstance(x, rules_lib.ParamLayout)


class _Steps(dict):
    """One step per (layout, microbatches), compiled when a test first asks for it and kept for the
    others: a test process compiles only the layouts of the tests it runs (xdist splits a module)."""

    def __init__(self, tmp_path_factory, initial_params):
        super().__init__()
        self._tmp_path_factory, self._initial_params = tmp_path_factory, initial_params

    def __missing__(self, key: tuple[str, int]) -> Step:
        layout, k = key
        self[key] = _one_step(_config(self._tmp_path_factory.mktemp(f"{layout}_{k}"), layout, k), self._initial_params)
        return self[key]


@pytest.fixture(scope="module")
def steps(tmp_path_factory, initial_params):
    return _Steps(tmp_path_factory, initial_params)


def _relative_error(a, b) -> float:
    return float(np.linalg.norm(np.ravel(a - b)) / np.linalg.norm(np.ravel(b)))


def _update_error(step: Step, reference: Step) -> tuple[float, float]:
    """(relative L2 error of the whole update, worst relative L2 error of one parameter's update)."""
    flat = lambda s: np.concatenate([np.ravel(u) for u in jax.tree.leaves(s.update)])  # noqa: E731
    per_param = jax.tree.leaves(jax.tree.map(_relative_error, step.update, reference.update))
    return _relative_error(flat(step), flat(reference)), max(per_param)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_microbatches_give_the_update_of_one_batch(steps, layout):
    one = steps[layout, 1]
    # A real SGD step: -lr x the mean gradient, non-zero in every parameter.
    assert min(float(np.abs(u).max()) for u in jax.tree.leaves(one.update)) > 1e-6
    for k in MICROBATCHES[1:]:
        assert steps[layout, k].loss == pytest.approx(one.loss, rel=1e-6)
        whole, worst = _update_error(steps[layout, k], one)
        assert whole <= 1e-6 and worst <= 2e-6, (layout, k, whole, worst)


def _unreduced_shape(layout: rules_lib.ParamLayout, mesh: Mesh) -> list[int]:
    """A parameter's gradient on one device before its reduction: split along `tensor` only."""
    spec = tuple(layout.spec) + (None,) * (len(layout.shape) - len(layout.spec))
    return [
        size // (mesh.shape["tensor"] if "tensor" in ((entry,) if isinstance(entry, str) else (entry or ())) else 1)
        for size, entry in zip(layout.shape, spec)
    ]


def _normal(shape) -> tuple[int, ...]:
    """Dims without the 1s, sorted: XLA may reduce a gradient reshaped or transposed."""
    return tuple(sorted(d for d in shape if d != 1))


def _gradient_shapes(step: Step) -> set[tuple[int, ...]]:
    """Shapes an unreduced gradient can have in the HLO (1-dims dropped): whole, or one layer of a
    stacked parameter, since XLA may reduce a scanned layer's gradient inside the layer loop."""
    shapes = set()
    for layout in step.layouts:
        local = _unreduced_shape(layout, step.mesh)
        shapes.add(_normal(local))
        if layout.names[0] == "layers":
            shapes.add(_normal(local[1:]))
    return shapes


def _gradient_reductions(step: Step) -> tuple[int, int, list]:
    """(gradient elements fed into all-reduce/reduce-scatter per step, how many of those inside
    loops, the reductions as (opcode, executions per step, gradient operand shapes)).

    Counts executions: a reduction inside a scan of trip count n counts n times.
    """
    shapes = _gradient_shapes(step)
    total = in_loops = 0
    ops = []
    for op in hlo.collectives(step.hlo, hlo.REDUCTIONS):
        grads = sorted(_normal(s) for s in op.operand_shapes if _normal(s) in shapes)
        elements = op.executions * sum(math.prod(s) for s in grads)
        total += elements
        in_loops += elements if op.in_loop else 0
        if grads:
            ops.append((op.opcode, op.executions, grads))
    return total, in_loops, sorted(ops)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_gradient_reduction_per_step_at_any_microbatch_count(steps, layout):
    """With k > 1 microbatches; k = 1 is XLA's plain step, which reduces where XLA likes (under
    FSDP it may reduce some gradients as shards, or per layer inside the layer scan)."""
    mesh, layouts = steps[layout, 1].mesh, steps[layout, 1].layouts
    once_each = sum(math.prod(_unreduced_shape(lay, mesh)) for lay in layouts)
    programs = []
    for k in MICROBATCHES[1:]:
        total, in_loops, ops = _gradient_reductions(steps[layout, k])
        # Each device feeds each of its gradient elements into a reduction exactly once per step,
        # after the microbatch scan, never inside it ...
        assert (total, in_loops) == (once_each, 0), (layout, k, total, in_loops, once_each)
        assert all(executions == 1 for _, executions, _ in ops)
        programs.append(ops)
    # ... through the same reductions at every microbatch count.
    assert all(ops == programs[0] for ops in programs), programs


def test_per_microbatch_mode_reduces_in_every_microbatch(tmp_path, steps, initial_params):
    """The control: the memory-lean mode reduces k times per step, and the HLO check sees it."""
    k = 4
    step = _one_step(_config(tmp_path, "data8", k, "per_microbatch"), initial_params)
    whole, _ = _update_error(step, steps["data8", 1])
    assert whole <= 1e-6
    once, _, _ = _gradient_reductions(steps["data8", 1])
    total, in_loops, _ = _gradient_reductions(step)
    assert total == k * once and in_loops == total

