"""Sampling with a KV cache: greedy output is the full recompute's, token for token, under any
layout; nucleus sampling keeps to its nucleus; `jaxdist sample` continues a run's prompt."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_config

from jaxdist import cli, loop
from jaxdist.parallel import rules as rules_lib
from jaxdist.train import generate
from jaxdist.train.state import merge
from jaxdist.train.trainer import Trainer


def _recomputed(trainer: Trainer, prompt: np.ndarray, length: int) -> np.ndarray:
    """Greedy continuation that runs the whole prefix again for every new token."""
    tokens = np.zeros((trainer.mesh.devices.size // 2, length), np.int32)
    tokens[:, : len(prompt)] = prompt
    def forward(params, model_state, tokens):
        model = merge(trainer.graphdef, params, model_state)
        model.deterministic = True  # a sigmoid router's biases stay as they are
        return model(tokens)

    forward = jax.jit(forward)
    with rules_lib.activation_rules(trainer.mesh, trainer.rules):
        for position in range(len(prompt), length):
            logits = np.asarray(forward(trainer.params, trainer.state.model_state, jnp.asarray(tokens)))
            tokens[:, position] = logits[:, position - 1].argmax(-1)
    return tokens


FSDP_TP = {"data": 2, "fsdp": 2, "tensor": 2}


@pytest.mark.parametrize("model, impl, mesh", [
    ({}, {"scan_layers": True}, FSDP_TP),
    ({"name": "llama", "kv_heads": 2, "biases": "qkv"}, {"scan_layers": False}, FSDP_TP),
    # Qwen3-MoE's shape: q and k normed, wider heads, a dense first layer, the experts split.
    ({"name": "llama", "kv_heads": 2, "head_dim": 48, "qk_norm": True, "moe": {"experts": 4, "first_dense": 1}},
     {"scan_layers": False}, {"data": 1, "expert": 2, "fsdp": 2, "tensor": 2}),
    # A window of 3: the prompt of 5 is longer, the cache a ring of 3 positions.
    ({"name": "llama", "kv_heads": 2, "sliding_window": 3}, {"scan_layers": True}, FSDP_TP),
    # Gemma's: windowed and global layers in turn, each with its own RoPE base, both logits capped.
    ({"name": "gemma", "kv_heads": 2, "sliding_window": 3, "global_every": 2, "local_rope_base": 100.0,
      "qk_norm": True, "attention_softcap": 2.0, "logit_softcap": 8.0, "attention_scale_dim": 24},
     {"scan_layers": False}, FSDP_TP),
    # DeepSeek-V3's: latent attention (the cache holds latents), a dense layer, then routed experts.
    ({"name": "deepseek", "head_dim": 16, "latent": {"kv_rank": 16, "q_rank": 24, "rope_dim": 8, "value_dim": 12},
      "moe": {"experts": 4, "experts_per_token": 2, "first_dense": 1, "router": "sigmoid", "shared_experts": 1,
              "groups": 2, "top_groups": 1}}, {"scan_layers": False}, FSDP_TP),
], ids=["gpt-scanned", "llama-gqa-unrolled", "mixture-experts-split", "llama-sliding-window", "gemma", "deepseek"])
def test_greedy_sampling_with_the_cache_is_the_full_recompute(tmp_path, model, impl, mesh):
    cfg = make_config(tmp_path, model=model, impl=impl, mesh=mesh, rules={"preset": "fsdp_tp"})
    trainer = Trainer.from_config(cfg)
    prompt = np.array([3, 17, 42, 5, 99], np.int32)
    length = cfg.model.seq_len
    cached = generate.sample(trainer.graphdef, trainer.params, prompt, length, generate.Sampling(length, 0.0, rows=4),
                             trainer.mesh, trainer.rules, model_state=trainer.state.model_state)
    expected = _recomputed(trainer, prompt, length)
    np.testing.assert_array_equal(cached, expected)
    assert len(set(cached[0, len(prompt):].tolist())) > 3  # a real continuation, not one token repeated
    cache = merge(trainer.graphdef, trainer.params, trainer.state.model_state).init_cache(4, length)
    # No longer than the window where every layer is windowed; whole where some layer is global.
    windowed = not any(cfg.model.is_global(layer) for layer in range(cfg.model.layers))
    assert cache.keys.shape[2] == (min(length, cfg.model.sliding_window) if windowed else length)
    if cfg.model.latent.kv_rank:  # a token's latent and shared rotated key part, not every head's keys and values
        assert (cache.keys.shape[-2:], cache.values.shape[-2:]) == ((1, 16), (1, 8))


def test_nucleus_sampling_draws_only_from_its_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    draws = {int(generate.choose(logits, jax.random.key(i), 1.0, 0.85)[0]) for i in range(300)}
    assert draws == {0, 1, 2}  # 0.5 + 0.3 < 0.85 <= 0.5 + 0.3 + 0.1
    everything = {int(generate.choose(logits, jax.random.key(i), 1.0, 1.0)[0]) for i in range(300)}
    assert everything == {0, 1, 2, 3, 4}
    assert {int(generate.choose(logits, jax.random.key(i), 1.0, 0.3)[0]) for i in range(50)} == {0}


def test_the_sample_command_continues_a_run_and_reports_its_speed(tmp_path, capsys):
    run_dir = tmp_path / "run"
    loop.train(make_config(run_dir, train={"steps": 2}, checkpoint={"every": 2}))
    capsys.readouterr()
    assert cli.main(["sample", str(run_dir), "--prompt", "def ", "--tokens", "12", "--temperature", "0"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("def ")
    assert out[-1].startswith("12 tokens in ") and "tokens/s, 1 row(s), step 2 of" in out[-1], out
    for prompt, message in [("", "the prompt is empty"), ("x" * 40, "leaves no room to continue it")]:
        assert cli.main(["sample", str(run_dir), "--prompt", prompt]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    for option, value, message in [
        ("--temperature", "nan", "sample --temperature nan: use a finite number, 0 (greedy) or more"),
        ("--temperature", "-1", "sample --temperature -1.0: use a finite number, 0 (greedy) or more"),
        ("--temperature", "inf", "sample --temperature inf: use a finite number, 0 (greedy) or more"),
        ("--seed", str(10**23), f"sample --seed {10**23}: use an integer from 0 to 4294967295"),
        ("--prompt", os.fsdecode(b"def \xff"), "sample --prompt: it is not UTF-8 text (byte 0xff at character 4); pass UTF-8 text"),
    ]:
        arguments = {"--prompt": "def ", option: value}
        assert cli.main(["sample", str(run_dir), *(x for pair in arguments.items() for x in pair)]) == 2
        assert capsys.readouterr().err == f"jaxdist: error: {message}\n"
    # 10**8 rows of a KV cache of 2 layers x 32 positions x 64 features, keys and values, in float32
    assert cli.main(["sample", str(run_dir), "--prompt", "def ", "--rows", str(10**8)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdist: error: sample --rows 100000000: sampling 100,000,000 rows (their KV cache and the "
                          "prompt's logits) needs at least 3,699.2 GB of memory, more than this host has ("), err
    assert err.count("\n") == 1 and "); pass at most --rows " in err
