"""Models, registered by name (`registry`): the GPT (gpt/, on the shared layers of layers/), the Llama
(llama/) and Gemma (gemma/) families on the same decoder, and the image classifiers MLP (mlp.py) and
ResNet (resnet.py). Importing the package registers them; `model.name` picks one. A family's Hugging
Face adapter lives in its own files (gpt/hf.py, llama/hf.py, gemma/hf.py); hf_mapping.py finds the
one a folder or a model needs."""

from jaxdist.models import gemma, gpt, llama, mlp, resnet  # noqa: F401  (each registers itself)
from jaxdist.models.registry import MODELS, ModelEntry, get, register

__all__ = ["MODELS", "ModelEntry", "get", "register"]
