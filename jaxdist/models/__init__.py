"""Models, registered by name (`registry`): the GPT (gpt/, on the shared layers of layers/), the Llama
(llama/), Gemma (gemma/) and DeepSeek-V3 (deepseek/) families on the same decoder, and the image
classifiers MLP (mlp.py) and ResNet (resnet.py). Importing the package registers them; `model.name`
picks one. A family's Hugging Face adapter lives in its own files (gpt/hf.py, llama/hf.py,
gemma/hf.py, deepseek/hf.py); hf_mapping.py finds the one a folder or a model needs."""

from jaxdist.models import deepseek, gemma, gpt, llama, mlp, resnet  # noqa: F401  (each registers itself)
from jaxdist.models.registry import MODELS, ModelEntry, get, register

__all__ = ["MODELS", "ModelEntry", "get", "register"]
