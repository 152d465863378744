"""A new model is one file and one registration line: the worked example in docs/architecture.md,
registered as a user's program would, trains under two layouts to the same losses."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import logged_losses, make_classifier_config

from jaxdist import loop, models
from jaxdist.config import model_sections
from jaxdist.config import registry as config_registry

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


@pytest.fixture(scope="module")
def softmax():
    """The model the docs add, registered from the docs' block as its own module would be."""
    match = re.search(r"<!-- model-example:[^>]*-->\s*```python\n(.*?)```", DOCS.read_text(), re.S)
    assert match, "docs/architecture.md lost its worked example"
    namespace = {"__name__": "softmax_model"}
    registered = dict(models.MODELS), dict(config_registry._MODELS)
    exec(compile(match.group(1), "softmax_model.py", "exec"), namespace)  # noqa: S102  (the docs' own code)
    yield namespace
    # Registered for this module only: other tests in this process see the built-in models alone.
    for table, before in zip((models.MODELS, config_registry._MODELS), registered):
        table.clear()
        table.update(before)


def test_a_model_of_one_file_trains_under_two_layouts(softmax, tmp_path):
    assert "softmax" in models.MODELS and model_sections()["softmax"] is softmax["SoftmaxConfig"]
    model = {"name": "softmax"}  # classes and image shape: the digits', resolved from the data
    runs = {"fsdp8": {"mesh": {"data": 1, "fsdp": 8, "tensor": 1}, "rules": {"preset": "fsdp"}},
            "data2_fsdp2_tensor2": {"mesh": {"data": 2, "fsdp": 2, "tensor": 2}, "rules": {"preset": "fsdp_tp"}}}
    for name, layout in runs.items():
        trainer = loop.train(make_classifier_config(tmp_path / name, model, train={"steps": 6}, **layout))
        assert trainer.params["weights"].shape == (64, 10)
    first, second = (logged_losses(tmp_path / name) for name in runs)
    assert len(first) == 6 and first[-1] < first[0]  # it learns
    np.testing.assert_allclose(first, second, rtol=1e-5)
    assert jax.tree.leaves(trainer.params)[0].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)  # classes: never split
