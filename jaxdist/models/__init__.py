"""Models, registered by name (`registry`): the GPT (gpt/, on the shared layers of layers/) and the Llama
family (llama.py, the same decoder), and the image classifiers MLP (mlp.py) and ResNet (resnet.py). Importing the package
registers them; `model.name` picks one. hf_mapping.py maps Hugging Face configs and weights onto the decoder."""

from jaxdist.models import gpt, llama, mlp, resnet  # noqa: F401  (each registers itself)
from jaxdist.models.registry import MODELS, ModelEntry, get, register

__all__ = ["MODELS", "ModelEntry", "get", "register"]
