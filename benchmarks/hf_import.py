"""Importing a Hugging Face model folder: load time and peak host memory, and the logits against
`transformers` on the same tokens.

    python benchmarks/hf_import.py save FOLDER [--size 1b]     # where transformers is installed
    PYTHONPATH=. python benchmarks/hf_import.py load FOLDER [key=value ...]

`save` writes a random Llama-3.2-1B-shaped model (grouped-query attention, Llama 3's RoPE scaling,
tied embeddings) in bfloat16 with `save_pretrained`. `load` runs in a process of its own: it places
the weights with `model.init_from` under the config's layout (default: fsdp over every GPU),
in float32, computes in float32, and prints one JSON line: the seconds from the folder to the arrays on the devices, the
process's peak resident memory before and after, the folder's bytes, and the largest difference
between jaxdist's logits and the ones `save` stored for fixed tokens.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIZES = {  # Llama 3.2 1B's shapes; "tiny" for trying the script on a CPU
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}
TOKENS = np.arange(64, dtype=np.int64).reshape(2, 32) * 37 % 500  # two rows: one per GPU of fsdp=2


def save(folder: Path, size: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **SIZES[size], max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    start = time.perf_counter()
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(folder)
    # The reference in float32 from the bfloat16 weights jaxdist reads, loaded afresh: the model cast
    # with .float() would keep RoPE's frequencies rounded to bfloat16 by the cast before saving.
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(TOKENS)).logits.numpy()
    np.save(folder / "reference_logits.npy", logits)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"saved": str(folder), "params": params, "seconds": round(time.perf_counter() - start, 1)}))


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kilobytes on Linux


def load(folder: Path, overrides: list[str]) -> None:
    import jax
    import jax.numpy as jnp

    from jaxdist import config as config_lib
    from jaxdist import models
    from jaxdist.checkpoint import hf_folder
    from jaxdist.parallel import layout as layout_lib
    from jaxdist.parallel import rules as rules_lib
    from jaxdist.train.state import abstract_model, merge, param_shardings

    jax.devices()  # the runtime up first: its memory is not the import's
    before = _peak_rss_gib()
    raw = {"model": {"init_from": f"hf:{folder}", "seq_len": TOKENS.shape[1], "impl": {"scan_layers": True}},
           "mesh": {"data": 1, "fsdp": -1}, "rules": {"preset": "fsdp"},
           "precision": {"compute": "float32"}}  # the logits check compares float32 with float32
    recipe = Path(tempfile.mkdtemp()) / "import.yaml"  # loaded as a file, so overrides count as set keys
    recipe.write_text(json.dumps(raw))
    cfg = config_lib.load(recipe, overrides)
    start = time.perf_counter()
    cfg = hf_folder.resolve(cfg)
    entry = models.get(cfg.model.name)
    placed = layout_lib.from_config(cfg, None, entry.activations)
    abstract = abstract_model(entry.create(cfg), 0)
    shardings = param_shardings(abstract, placed.rules, placed.mesh)
    params = jax.block_until_ready(hf_folder.load_params(cfg, abstract.params, shardings))
    seconds = time.perf_counter() - start
    after = _peak_rss_gib()
    with rules_lib.activation_rules(placed.mesh, placed.rules), jax.default_matmul_precision("highest"):
        logits = jax.jit(lambda p, t: merge(abstract.graphdef, p)(t))(params, jnp.asarray(TOKENS, jnp.int32))
    reference = np.load(folder / "reference_logits.npy")
    folder_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    param_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    print(json.dumps({
        "devices": len(placed.mesh.devices.flat), "mesh": dict(placed.mesh.shape), "load_s": round(seconds, 2),
        "peak_rss_before_gib": round(before, 2), "peak_rss_after_gib": round(after, 2),
        "folder_gib": round(folder_bytes / 2**30, 2), "params_float32_gib": round(param_bytes / 2**30, 2),
        "max_logit_difference": float(np.abs(np.asarray(logits) - reference).max()),
        "logit_scale": float(np.abs(reference).max()),
    }))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("save", "load"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--size", choices=SIZES, default="1b")
    args, overrides = parser.parse_known_args(argv)
    if args.action == "save":
        save(args.folder, args.size)
    else:
        load(args.folder, overrides)


if __name__ == "__main__":
    main(sys.argv[1:])
