"""Models, registered by name (`registry`): the GPT (gpt.py), and the image classifiers MLP (mlp.py)
and ResNet (resnet.py). Importing the package registers them; `model.name` picks one."""

from jaxdist.models import gpt, mlp, resnet  # noqa: F401  (each registers itself)
from jaxdist.models.registry import MODELS, ModelEntry, get, register

__all__ = ["MODELS", "ModelEntry", "get", "register"]
