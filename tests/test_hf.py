"""Hugging Face folders in and out, checked against models that the real `transformers` made.

tests/fixtures/hf holds tiny random Llama (grouped-query attention, Llama 3's RoPE scaling), Qwen2
(q/k/v biases, tied embeddings), Qwen3 (q and k normed, heads wider than hidden / heads), Mistral
(a sliding window of 5 tokens, shorter than the 12 of the reference logits), GPT-2,
and the mixtures of experts Mixtral (every layer routed) and Qwen3-MoE (a dense first layer, weights
not renormalized) as `save_pretrained` wrote them, each with the logits transformers computed for
fixed tokens (tests/fixtures/hf/make.py made them).
"""

import json
import re
import shutil
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_config
from safetensors.numpy import load_file

from jaxdist import cli, models
from jaxdist.checkpoint import export, hf_folder
from jaxdist.config import Config
from jaxdist.errors import UserError
from jaxdist.parallel import layout as layout_lib
from jaxdist.parallel import rules as rules_lib
from jaxdist.train.state import abstract_model, merge, model_state_shardings, param_shardings

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gpt2")
MIXTURES = ("mixtral", "qwen3_moe")
GEMMAS = ("gemma2", "gemma3")  # windowed and global layers: unrolled, so no pipeline layout
DEEPSEEK = "deepseek_v3"  # dense and routed layers: unrolled; the routers' biases are the model's state
UNROLLED = {"model": {"impl": {"scan_layers": False}}}  # Qwen3-MoE's dense and routed layers are two kinds
ONE_DEVICE = {"mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "rules": {"preset": "dp"}}
LAYOUTS = {
    "one_device": ONE_DEVICE,
    "data8": {"mesh": {"data": 8, "fsdp": 1, "tensor": 1}, "rules": {"preset": "dp"}},
    "fsdp2_tensor2_data2": {"mesh": {"data": 2, "fsdp": 2, "tensor": 2}, "rules": {"preset": "fsdp_tp"},
                            "model": {"impl": {"scan_layers": False}}},
    "stage2_fsdp4": {"mesh": {"data": 1, "fsdp": 4, "tensor": 1, "stage": 2}, "rules": {"preset": "fsdp"},
                     "pipeline": {"microbatches": 2}},
}
MIXTURE_LAYOUTS = {
    "one_device": ({**ONE_DEVICE, **UNROLLED}, 1),
    # 2 rows over 8 devices: the experts' batch shards padded with rows routed to none.
    "expert2_fsdp2_tensor2": ({"mesh": {"expert": 2, "fsdp": 2, "tensor": 2}, "rules": {"preset": "fsdp_tp"},
                               **UNROLLED}, 8),
}


def imported(folder: Path, layout: dict | None = None, seq_len: int = 12, devices: int = 8):
    """(config, graphdef, params made in their shardings, layout) of a model folder under `layout`
    on the first `devices` devices."""
    layout = layout or {**LAYOUTS["data8"], **(UNROLLED if folder.name in MIXTURES else {})}
    raw = {key: value for key, value in layout.items() if key != "model"}
    raw["model"] = {"init_from": f"hf:{folder}", "seq_len": seq_len, **layout.get("model", {})}
    cfg = hf_folder.resolve(Config.model_validate(raw))
    entry = models.get(cfg.model.name)
    placed = layout_lib.from_config(cfg, jax.devices()[:devices], entry.activations)
    abstract = abstract_model(entry.create(cfg), 0)
    shardings = param_shardings(abstract, placed.rules, placed.mesh)
    return cfg, abstract.graphdef, hf_folder.load_params(cfg, abstract.params, shardings), placed


def logits_of(graphdef, params, placed, tokens: np.ndarray, model_state=None) -> np.ndarray:
    with rules_lib.activation_rules(placed.mesh, placed.rules):
        out = jax.jit(lambda p, s, t: merge(graphdef, p, s)(t))(params, model_state, jnp.asarray(tokens))
    return np.asarray(out)


def imported_state(cfg, placed):
    """The model state (the routers' biases) of `cfg`'s folder, placed as `placed`'s rules place it."""
    abstract = abstract_model(models.get(cfg.model.name).create(cfg), 0)
    return hf_folder.load_state(cfg, abstract.state, model_state_shardings(abstract, placed.rules, placed.mesh))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_imported_models_give_the_logits_transformers_gave(family, layout):
    reference = np.load(FIXTURES / family / "reference.npz")
    cfg, graphdef, params, placed = imported(FIXTURES / family, LAYOUTS[layout], devices=1 if layout == "one_device"
                                             else 8)
    logits = logits_of(graphdef, params, placed, reference["input_ids"])
    assert logits.shape == reference["logits"].shape
    np.testing.assert_allclose(logits, reference["logits"], atol=1e-4, rtol=0)
    # A check that can fail: the logits vary, and the model is the family's.
    assert reference["logits"].std() > 0.5
    assert cfg.model.name == ("gpt" if family == "gpt2" else "llama")


@pytest.mark.parametrize("layout", MIXTURE_LAYOUTS)
def test_imported_deepseek_gives_the_logits_transformers_gave(layout):
    """Latent attention, group-limited sigmoid routing with the published score-correction biases,
    a shared expert: on one device and with the experts split over 2 devices (and fsdp x tensor)."""
    reference = np.load(FIXTURES / DEEPSEEK / "reference.npz")
    sections, devices = MIXTURE_LAYOUTS[layout]
    cfg, graphdef, params, placed = imported(FIXTURES / DEEPSEEK, sections, devices=devices)
    state = imported_state(cfg, placed)
    np.testing.assert_allclose(logits_of(graphdef, params, placed, reference["input_ids"], state), reference["logits"],
                               atol=1e-4, rtol=0)
    assert reference["logits"].std() > 0.5 and cfg.model.name == "deepseek"
    source = _tensors(FIXTURES / DEEPSEEK)
    bias = source["model.layers.2.mlp.gate.e_score_correction_bias"]
    np.testing.assert_array_equal(np.asarray(state["blocks"][2]["moe"]["bias"]), bias)
    assert np.abs(bias).max() > 0.05  # the biases choose: zeros would route otherwise
    zeroed = jax.tree.map(jnp.zeros_like, state)
    unbiased = logits_of(graphdef, params, placed, reference["input_ids"], zeroed)
    assert np.abs(unbiased - reference["logits"]).max() > 1e-3


@pytest.mark.parametrize("layout", ["one_device", "fsdp2_tensor2_data2"])
@pytest.mark.parametrize("family", GEMMAS)
def test_imported_gemmas_give_the_logits_transformers_gave(family, layout):
    reference = np.load(FIXTURES / family / "reference.npz")
    sections, devices = (ONE_DEVICE, 1) if layout == "one_device" else (LAYOUTS[layout], 8)
    cfg, graphdef, params, placed = imported(FIXTURES / family, sections, devices=devices)
    logits = logits_of(graphdef, params, placed, reference["input_ids"])
    np.testing.assert_allclose(logits, reference["logits"], atol=1e-4, rtol=0)
    assert reference["logits"].std() > 0.5 and cfg.model.name == "gemma"
    # The norms hold w of Gemma's 1 + w, as published (the fixture's are random, none a no-op).
    source = _tensors(FIXTURES / family)
    published = source["model.layers.1.post_attention_layernorm.weight"]
    np.testing.assert_array_equal(np.asarray(params["blocks"][1]["attn_out_norm"]["scale"]), published)
    assert np.abs(published).max() > 0.1


@pytest.mark.parametrize("layout", MIXTURE_LAYOUTS)
@pytest.mark.parametrize("family", MIXTURES)
def test_imported_mixtures_give_the_logits_transformers_gave(family, layout):
    reference = np.load(FIXTURES / family / "reference.npz")
    sections, devices = MIXTURE_LAYOUTS[layout]
    cfg, graphdef, params, placed = imported(FIXTURES / family, sections, devices=devices)
    assert placed.mesh.devices.size == devices
    logits = logits_of(graphdef, params, placed, reference["input_ids"])
    np.testing.assert_allclose(logits, reference["logits"], atol=1e-4, rtol=0)
    assert reference["logits"].std() > 0.5
    # Each expert's weights are its own: a Hugging Face expert's gate projection, as placed.
    source = _tensors(FIXTURES / family)
    gate = "mlp.experts.2.gate_proj" if family == "qwen3_moe" else "block_sparse_moe.experts.2.w1"
    np.testing.assert_array_equal(np.asarray(params["blocks"][1]["moe"]["gate"])[2],
                                  source[f"model.layers.1.{gate}.weight"].T)


def test_the_fixtures_cover_what_the_families_differ_in():
    llama, qwen2, gpt2 = (hf_folder.resolve(Config.model_validate({"model": {"init_from": f"hf:{FIXTURES / f}",
                                                                      "seq_len": 64}})).model
                          for f in ("llama", "qwen2", "gpt2"))
    assert (llama.kv_heads, llama.heads, llama.rope_scaling.kind, llama.tied_embeddings) == (2, 4, "llama3", False)
    assert (llama.mlp_dim, llama.norm_eps, llama.rope_base) == (96, 1e-6, 500000.0)
    assert (qwen2.biases, qwen2.tied_embeddings, qwen2.rope_base) == ("qkv", True, 1e6)
    assert (gpt2.biases, gpt2.positions, gpt2.norm, gpt2.max_positions) == ("all", "learned", "layernorm", 64)
    qwen3, mixtral, qwen3_moe = (hf_folder.resolve(Config.model_validate({"model": {
        "init_from": f"hf:{FIXTURES / f}", "seq_len": 64, "impl": {"scan_layers": False}}})).model
        for f in ("qwen3", *MIXTURES))
    assert (qwen3.qk_norm, qwen3.head_width, qwen3.d_model // qwen3.heads, qwen3.moe.experts) == (True, 32, 16, 0)
    mistral = hf_folder.resolve(Config.model_validate({"model": {"init_from": f"hf:{FIXTURES / 'mistral'}",
                                                                 "seq_len": 12}})).model
    assert (mistral.sliding_window, llama.sliding_window, qwen3.sliding_window) == (5, None, None)
    assert mistral.sliding_window < len(np.load(FIXTURES / "mistral" / "reference.npz")["input_ids"][0])
    assert (mixtral.moe.experts, mixtral.moe.experts_per_token, mixtral.expert_hidden, mixtral.moe.renormalize,
            mixtral.qk_norm) == (4, 2, 96, True, False)
    assert all(mixtral.moe.is_moe(layer) for layer in range(2))
    assert (qwen3_moe.moe.experts, qwen3_moe.expert_hidden, qwen3_moe.mlp_dim, qwen3_moe.moe.renormalize,
            qwen3_moe.moe.first_dense, qwen3_moe.qk_norm, qwen3_moe.head_width) == (4, 48, 96, False, 1, True, 32)
    gemma2, gemma3 = (hf_folder.resolve(Config.model_validate({"model": {"init_from": f"hf:{FIXTURES / f}",
                                                                       "seq_len": 12}})).model for f in GEMMAS)
    assert (gemma2.sliding_window, gemma2.global_every, gemma2.attention_softcap, gemma2.logit_softcap,
            gemma2.attention_scale_dim, gemma2.head_width, gemma2.qk_norm) == (5, 2, 2.0, 5.0, 24, 32, False)
    assert [gemma2.layer_window(layer) for layer in range(3)] == [5, None, 5]
    assert (gemma3.global_every, gemma3.rope_base, gemma3.rope_scaling.kind, gemma3.rope_scaling.factor,
            gemma3.local_rope_base, gemma3.attention_scale_dim, gemma3.qk_norm) == (3, 1e6, "linear", 4.0, 1e4, None,
                                                                                    True)
    assert (gemma3.attention_softcap, gemma3.logit_softcap, gemma3.impl.scan_layers) == (None, None, False)
    assert all(g.embed_scale and g.post_norms and g.norm_plus_one and g.tied_embeddings and g.activation == "geglu"
               for g in (gemma2, gemma3))
    deepseek = hf_folder.resolve(Config.model_validate({"model": {"init_from": f"hf:{FIXTURES / DEEPSEEK}",
                                                                  "seq_len": 12}})).model
    latent, moe = deepseek.latent, deepseek.moe
    assert (latent.kv_rank, latent.q_rank, latent.rope_dim, deepseek.value_width, deepseek.head_width) == (
        16, 32, 8, 20, 16)
    assert (moe.experts, moe.experts_per_token, moe.expert_hidden, moe.shared_experts, moe.first_dense, moe.router,
            moe.routed_scale, moe.groups, moe.top_groups, moe.renormalize) == (8, 2, 32, 1, 1, "sigmoid", 2.5, 2, 1,
                                                                               True)


@pytest.mark.parametrize("family", FAMILIES + MIXTURES + GEMMAS + (DEEPSEEK,))
def test_an_export_holds_the_fixture_tensors_and_config_keys_and_reimports_bitwise(family, tmp_path):
    source = FIXTURES / family
    cfg, _, params, placed = imported(source)
    params = jax.tree.map(np.asarray, params)
    state = jax.tree.map(np.asarray, imported_state(cfg, placed)) if family == DEEPSEEK else None
    out = tmp_path / "export"
    tensors = hf_folder.hf_tensors(cfg.model, lambda path: hf_folder.leaf_at(params, path),
                                   lambda path: hf_folder.leaf_at(state, path))
    written = hf_folder.write_folder(out, cfg.model, tensors, source, max_shard_bytes=150_000)
    assert "model.safetensors.index.json" in written and "tokenizer.json" in written

    exported, published = _tensors(out), _tensors(source)
    assert {name: a.shape for name, a in exported.items()} == {name: a.shape for name, a in published.items()}
    for name, array in published.items():
        np.testing.assert_array_equal(exported[name], array, err_msg=name)
    ours, theirs = (json.loads((folder / "config.json").read_text()) for folder in (out, source))
    assert set(ours) == set(theirs) - {"transformers_version"}
    for key in ("architectures", "vocab_size", "tie_word_embeddings", "rope_parameters", "num_key_value_heads",
                "intermediate_size", "n_embd", "n_positions", "rms_norm_eps", "layer_norm_epsilon", "head_dim",
                "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "mlp_only_layers", "decoder_sparse_step", "sliding_window", "layer_types", "query_pre_attn_scalar",
                "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation", "q_lora_rank", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
                "first_k_dense_replace", "routed_scaling_factor", "n_group", "topk_group", "rope_interleave"):
        assert ours.get(key) == theirs.get(key), key
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()

    again_cfg, _, again, again_placed = imported(out, {**LAYOUTS["data8"], **(UNROLLED if family in MIXTURES else {})})
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    if state is not None:
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(imported_state(again_cfg, again_placed)), strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_a_run_starts_from_the_weights_trains_and_exports_what_it_trained(tmp_path, capsys):
    """From a folder that ships no tokenizer: the export says it holds none, and how to add one."""
    from jaxdist import loop

    folder = tmp_path / "llama"
    shutil.copytree(FIXTURES / "llama", folder, ignore=shutil.ignore_patterns("tokenizer*"))
    run_dir = tmp_path / "run"
    # A learning rate so small that the trained weights stay within 1e-5 of where they started.
    raw = make_config(run_dir, train={"steps": 3, "global_batch": 8}, checkpoint={"every": 3},
                      optim={"lr": 1e-7, "weight_decay": 0.0}, mesh={"data": 2, "fsdp": 2, "tensor": 2})
    raw = raw.model_dump(mode="json")
    raw["model"] = {"init_from": f"hf:{folder}", "seq_len": 16}  # the folder decides the rest
    trainer = loop.train(Config.model_validate(raw))
    assert "starting from the weights of hf:" in capsys.readouterr().out

    out = tmp_path / "hf"
    assert cli.main(["export", str(run_dir), str(out), "--format", "hf"]) == 0
    assert capsys.readouterr().err == (
        f"jaxdist: warning: export --format hf: {out} holds no tokenizer: {folder}, the folder the run started "
        f"from, has no tokenizer.json; copy the model's tokenizer files (tokenizer.json, tokenizer_config.json) "
        f"into {out}\n")
    assert not list(out.glob("tokenizer*"))
    _, trained, _ = export.read_params(run_dir)
    _, _, again, _ = imported(out, seq_len=16)
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    published = jax.tree.leaves(imported(folder, seq_len=16)[2])
    moved = [np.abs(np.asarray(a) - b).max() for a, b in zip(published, jax.tree.leaves(trained), strict=True)]
    assert 0 < max(moved) < 1e-5
    assert trainer.state.step == 3


def test_a_deepseek_run_starts_from_the_published_router_biases_and_exports_them(tmp_path, capsys):
    """The routers' score-correction biases are the model's state, not parameters: a run from the
    folder starts with them, trains (without moving them: bias_rate 0), its export holds them, and
    `sample` reads them with the parameters of its unrolled blocks."""
    from jaxdist import loop

    run_dir = tmp_path / "run"
    raw = make_config(run_dir, train={"steps": 2, "global_batch": 8}, checkpoint={"every": 2}).model_dump(mode="json")
    raw["model"] = {"init_from": f"hf:{FIXTURES / DEEPSEEK}", "seq_len": 16}
    trainer = loop.train(Config.model_validate(raw))
    published = _tensors(FIXTURES / DEEPSEEK)
    for layer in (1, 2):
        np.testing.assert_array_equal(np.asarray(trainer.state.model_state["blocks"][layer]["moe"]["bias"]),
                                      published[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"])
    out = tmp_path / "hf"
    assert cli.main(["export", str(run_dir), str(out), "--format", "hf"]) == 0
    exported = _tensors(out)
    np.testing.assert_array_equal(exported["model.layers.2.mlp.gate.e_score_correction_bias"],
                                  published["model.layers.2.mlp.gate.e_score_correction_bias"])
    name = "model.layers.2.self_attn.kv_b_proj.weight"  # it trained: the weights moved, the layout kept
    assert exported[name].shape == published[name].shape and not np.array_equal(exported[name], published[name])
    assert set(exported) == set(published) and trainer.state.step == 2
    capsys.readouterr()
    assert cli.main(["sample", str(run_dir), "--prompt", "The quick", "--tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("4 tokens in ")


def test_an_export_without_a_tokenizer_says_where_the_runs_tokens_came_from(tmp_path):
    from data_helpers import prepared, random_documents

    out = tmp_path / "out"
    said = f"export --format hf: {out} holds no tokenizer: "
    prepare = ("to export one, prepare the data with a Hugging Face tokenizer (jaxdist data prepare INPUTS --out DIR "
               "--tokenizer PATH/tokenizer.json) and train on it")
    assert hf_folder.missing_tokenizer(make_config(tmp_path), out) == (
        f"{said}the run's tokens are UTF-8 bytes, which no tokenizer.json describes; {prepare}")
    shards, _ = prepared(tmp_path / "hf", random_documents(3), tokenizer=str(FIXTURES / "qwen2" / "tokenizer.json"))
    assert hf_folder.missing_tokenizer(make_config(tmp_path, data={"source": "arrayrecord", "path": str(shards)}), out) == (
        f"{said}the run's data was tokenized with {shards / 'tokenizer.json'}; copy it into {out}")
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["tokenizer"].update(name="sentencepiece", file="tokenizer.model")
    (shards / "manifest.json").write_text(json.dumps(manifest))
    assert hf_folder.missing_tokenizer(make_config(tmp_path, data={"source": "arrayrecord", "path": str(shards)}), out) == (
        f"{said}the run's data was tokenized with a SentencePiece model ({shards / 'tokenizer.model'}); {prepare}")
    ids = make_config(tmp_path, data={"source": "arrays", "path": "ids.npz"})
    assert hf_folder.missing_tokenizer(ids, out) == (
        f"{said}the run started from no Hugging Face folder, and its data (data.path=ids.npz) names no tokenizer; "
        f"copy the tokenizer.json its token ids come from into {out}")


def _broken(tmp_path: Path, family: str, damage) -> Path:
    folder = tmp_path / family
    shutil.copytree(FIXTURES / family, folder)
    damage(folder)
    return folder


def _edit_config(**changes):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))
    return edit


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "config.json").unlink(), "the folder has no config.json"),
    (_edit_config(architectures=["T5ForConditionalGeneration"]), "architectures=['T5ForConditionalGeneration'] is not "
                                                                 "one jaxdist imports"),
    (_edit_config(hidden_act="gelu"), "hidden_act='gelu' (SwiGLU needs silu): jaxdist cannot reproduce this model"),
    (_edit_config(intermediate_size=128), "does not fit the model config.json describes"),
    (lambda f: (f / "model-00002-of-00003.safetensors").unlink(), "1 shard(s) the index names are missing: "
                                                                  "model-00002-of-00003.safetensors"),
    (lambda f: (f / "config.json").write_text("{not json"), "config.json is not valid JSON"),
], ids=["no-config", "architecture", "activation", "shape", "missing-shard", "bad-json"])
def test_a_bad_folder_is_one_line_and_exit_2(tmp_path, capsys, damage, message):
    folder = _broken(tmp_path, "llama", damage)
    code = cli.main(["train", str(_config_file(tmp_path, folder)), "mesh.fsdp=-1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("jaxdist: error: "), err
    assert message in err, err


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.2-1B", "gpt2"])
def test_a_model_name_that_is_no_folder_says_how_to_fetch_it(tmp_path, capsys, name):
    assert cli.main(["train", str(_config_file(tmp_path, Path(name)))]) == 2
    local = f"models/{name.rpartition('/')[2]}"
    assert capsys.readouterr().err == (
        f"jaxdist: error: model.init_from=hf:{name}: no such folder; jaxdist reads local folders and downloads "
        f"nothing: if {name} is a model on the Hugging Face Hub, fetch it first with `hf download {name} --local-dir "
        f"{local}` (pip install huggingface_hub), then set model.init_from=hf:{local}\n")


def test_data_of_a_larger_vocabulary_than_the_folders_names_the_models_tokenizer(tmp_path, capsys, compiles):
    """Not model.vocab, which the folder decides (setting it is the next error)."""
    folder = _broken(tmp_path, "llama", _edit_config(vocab_size=200))
    assert cli.main(["train", str(_config_file(tmp_path, folder))]) == 2
    assert capsys.readouterr().err == (
        f"jaxdist: error: model.vocab=200 is smaller than the vocabulary of the stdlib corpus (256 ids); "
        f"model.init_from=hf:{folder} decides model.vocab, so the data must be tokenized with that model's tokenizer: "
        f"prepare it with `jaxdist data prepare INPUTS --out DIR --tokenizer {folder / 'tokenizer.json'}` and set "
        f"data.source=arrayrecord data.path=DIR\n")
    assert compiles.count == 0


SHARD = "model-00001-of-00003.safetensors"  # its first tensor: model.embed_tokens.weight, F32 [320, 64]


def _header(change):
    """A damage that rewrites the first shard's header: `change(header)` edits it, or returns what to
    write instead (bytes: the header's text; an int: the length field alone, the header kept)."""
    def edit(folder):
        path = folder / SHARD
        data = path.read_bytes()
        size = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + size])
        new = change(header)
        if isinstance(new, int):
            path.write_bytes(struct.pack("<Q", new) + data[8:])
            return
        text = new if isinstance(new, bytes) else json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + size:])
    return edit


def _first_tensor(change):
    return _header(lambda header: change(header["model.embed_tokens.weight"]))


def _index(weight_map):
    def edit(folder):
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        (folder.parent / "outside").mkdir()
        shutil.copyfile(folder / SHARD, folder.parent / "outside" / "x.safetensors")  # a file to read, if followed
    return edit


def _rope(value):
    return _edit_config(rope_parameters=value)


@pytest.mark.parametrize("family, damage, message", [
    ("llama", _header(lambda header: 2**63), f"{SHARD}: its header claims 9,223,372,036,854,775,808 bytes, more than "
                                             f"the 180,960 after its length: the file is cut short, or no "
                                             f"safetensors file"),
    ("llama", _header(lambda header: b"[1, 2, 3]"), f"{SHARD}: its header is not a JSON object"),
    ("llama", _first_tensor(lambda entry: entry.pop("data_offsets")),
     f"{SHARD}: model.embed_tokens.weight's data_offsets None are not two integers within its 180,224 bytes of data"),
    ("llama", _first_tensor(lambda entry: entry.update(data_offsets=["0", "81920"])),
     f"{SHARD}: model.embed_tokens.weight's data_offsets ['0', '81920'] are not two integers within"),
    ("llama", _first_tensor(lambda entry: entry.update(data_offsets=[-744, 81176])),
     f"{SHARD}: model.embed_tokens.weight's data_offsets [-744, 81176] are not two integers within"),
    ("llama", _first_tensor(lambda entry: entry.update(data_offsets=[0, 999999])),
     f"{SHARD}: model.embed_tokens.weight's data_offsets [0, 999999] are not two integers within"),
    ("llama", _first_tensor(lambda entry: entry.update(shape=["320", "64"])),
     f"{SHARD}: model.embed_tokens.weight's shape ['320', '64'] is not a list of non-negative integers"),
    ("llama", _first_tensor(lambda entry: entry.update(shape=[320, 32])),
     f"{SHARD}: model.embed_tokens.weight holds 81,920 bytes, not the 40,960 of its shape [320, 32] in F32"),
    ("llama", _header(lambda header: header.update(x=5)), f"{SHARD}: the header's entry 'x' is not an object"),
    ("llama", _edit_config(rms_norm_eps="abc"), "config.json: rms_norm_eps='abc' is not a positive number"),
    ("gpt2", _edit_config(layer_norm_epsilon=None), "config.json: layer_norm_epsilon=None is not a positive number"),
    ("llama", _rope({"rope_type": "llama3", "rope_theta": 5e5}), "config.json: has no 'rope_parameters.factor', which a "
                                                                 "LlamaForCausalLM config needs"),
    ("llama", _rope("abc"), "config.json: rope_parameters='abc' is not an object"),
    ("gpt2", _edit_config(tie_word_embeddings="false"), "config.json: tie_word_embeddings='false' is not true or false"),
    ("llama", _index(["model-00001-of-00003.safetensors"]), "model.safetensors.index.json: its weight_map is not an "
                                                            "object of tensor names to file names"),
    ("llama", _index({"model.embed_tokens.weight": "../outside/x.safetensors"}),
     "model.safetensors.index.json names ../outside/x.safetensors, which is not a file name inside the folder"),
    ("qwen3_moe", _edit_config(mlp_only_layers=[1]), "config.json: mlp_only_layers=[1] (jaxdist's dense layers are the "
                                                     "first k: model.moe.first_dense): jaxdist cannot reproduce this"),
    ("mixtral", _edit_config(router_jitter_noise=0.01), "config.json: router_jitter_noise=0.01 (jaxdist's routers take "
                                                        "no noise)"),
    ("qwen3", _edit_config(use_sliding_window=True, max_window_layers=1), "config.json: use_sliding_window with "
                                                                          "max_window_layers=1 (jaxdist's sliding "
                                                                          "window covers every layer"),
    ("mistral", _edit_config(sliding_window=0), "config.json: sliding_window=0 is not a positive integer"),
    ("qwen3_moe", _edit_config(num_experts_per_tok="2"), "config.json: num_experts_per_tok='2' is not a positive "
                                                         "integer"),
    ("gemma2", _edit_config(layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
     "config.json: layer_types=['full_attention', 'sliding_attention', 'sliding_attention'] (jaxdist's global "
     "layers are every k-th: model.global_every)"),
    ("gemma2", _edit_config(query_pre_attn_scalar="x"), "config.json: query_pre_attn_scalar='x' is not a positive "
                                                        "integer"),
    ("gemma3", _edit_config(use_bidirectional_attention=True), "config.json: use_bidirectional_attention set "
                                                               "(jaxdist's attention is causal)"),
    ("gemma3", _edit_config(attn_logit_softcapping="50"), "config.json: attn_logit_softcapping='50' is not a positive "
                                                          "number"),
    ("deepseek_v3", _rope({"rope_type": "yarn", "factor": 40.0}), "config.json: rope type 'yarn' (jaxdist's DeepSeek "
                                                                   "has the default RoPE; YaRN is not yet computed)"),
    ("deepseek_v3", _edit_config(num_nextn_predict_layers=1), "config.json: num_nextn_predict_layers=1 (jaxdist "
                                                              "trains no multi-token prediction module)"),
    ("deepseek_v3", _edit_config(rope_interleave=False), "config.json: rope_interleave=False (jaxdist reads "
                                                         "DeepSeek's interleaved RoPE rows)"),
    ("deepseek_v3", _edit_config(kv_lora_rank=None), "config.json: kv_lora_rank=None is not a positive integer"),
], ids=["header-2**63", "header-list", "no-offsets", "string-offsets", "negative-offsets", "offsets-past-the-data",
        "string-shape", "shape-not-the-span", "entry-not-object", "eps-string", "eps-null", "rope-no-factor",
        "rope-string", "tied-string", "index-list", "index-outside", "dense-layers-not-first", "router-noise",
        "qwen-window", "window-zero", "experts-string", "gemma-global-first", "gemma-scale-string",
        "gemma-bidirectional", "gemma-softcap-string", "deepseek-yarn", "deepseek-mtp", "deepseek-not-interleaved",
        "deepseek-rank-null"])
def test_a_crafted_folder_is_one_line_and_exit_2_before_anything_is_read_from_it(tmp_path, capsys, compiles, family,
                                                                                damage, message):
    """Headers, config values and index entries of the wrong type or out of bounds: never a traceback,
    and never bytes of the header, or of a file outside the folder, read as weights."""
    folder = _broken(tmp_path, family, damage)
    code = cli.main(["train", str(_config_file(tmp_path, folder)), "mesh.fsdp=-1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"jaxdist: error: model.init_from=hf:{folder}: ") and message in err, err
    assert compiles.count == 0


def _config_file(tmp_path: Path, folder: Path) -> Path:
    """A run of the tiny GPT's settings whose model section is only `init_from` and `seq_len`."""
    raw = make_config(tmp_path / "run", train={"steps": 1}).model_dump(mode="json")
    raw["model"] = {"init_from": f"hf:{folder}", "seq_len": 16}
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(raw))
    return path


def test_a_key_that_disagrees_with_the_folder_is_named(tmp_path, capsys):
    code = cli.main(["train", "tiny", f"model.init_from=hf:{FIXTURES / 'llama'}", f"run_dir={tmp_path / 'run'}",
                     "model.seq_len=16"])
    err = capsys.readouterr().err
    assert code == 2
    assert "model.d_model=128 disagrees with" in err and "makes it 64; leave model.d_model out" in err, err


def test_export_of_a_model_no_hugging_face_architecture_computes_is_refused(tmp_path, capsys):
    from jaxdist import loop

    run_dir = tmp_path / "run"
    loop.train(make_config(run_dir, model={"positions": "rope"}, train={"steps": 1}, checkpoint={"every": 1}))
    code = cli.main(["export", str(run_dir), str(tmp_path / "out"), "--format", "hf"])
    err = capsys.readouterr().err
    assert code == 2 and "no Hugging Face architecture computes this model (positions=rope" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("moe, qk_norm, message", [
    ({"router": "sigmoid"}, False, "MixtralForCausalLM routes otherwise than model.moe.router=sigmoid"),
    ({"first_dense": 1}, False, "MixtralForCausalLM routes otherwise than model.moe.first_dense=1"),
    ({"shared_experts": 1, "capacity_factor": 2.0}, True,
     "Qwen3MoeForCausalLM routes otherwise than model.moe.shared_experts=1, model.moe.capacity_factor=2.0"),
])
def test_a_mixture_no_hugging_face_architecture_routes_as_is_not_exported(moe, qk_norm, message):
    from jaxdist.models import hf_mapping

    model = Config.model_validate({"model": {"name": "llama", "qk_norm": qk_norm, "moe": {"experts": 4, **moe},
                                             "impl": {"scan_layers": False}}}).model
    with pytest.raises(UserError, match="^export --format hf: " + re.escape(message)):
        hf_mapping.hf_config(model)
    assert hf_mapping.export_architecture(model.model_copy(update={"moe": model.moe.model_copy(update={
        "router": "softmax", "first_dense": 0, "shared_experts": 0, "capacity_factor": None})})) == (
        "Qwen3MoeForCausalLM" if qk_norm else "MixtralForCausalLM")


def test_a_sliding_window_is_exported_as_mistral_or_mixtral_and_refused_where_neither_computes_it():
    from jaxdist.models import hf_mapping

    def model(**keys):
        return Config.model_validate({"model": {"name": "llama", "sliding_window": 8, **keys}}).model

    assert hf_mapping.export_architecture(model()) == "MistralForCausalLM"
    assert hf_mapping.hf_config(model())["sliding_window"] == 8
    assert hf_mapping.export_architecture(model(moe={"experts": 4})) == "MixtralForCausalLM"
    assert hf_mapping.export_architecture(model(sliding_window=None)) == "LlamaForCausalLM"
    for keys in ({"qk_norm": True}, {"biases": "qkv"}, {"qk_norm": True, "moe": {"experts": 4}}):
        with pytest.raises(UserError, match=r"^export --format hf: a sliding window \(model.sliding_window=8\) is "
                                            r"written as Mistral or Mixtral"):
            hf_mapping.export_architecture(model(**keys))
    gpt = Config.model_validate({"model": {"sliding_window": 8}}).model
    with pytest.raises(UserError, match="GPT-2 has no model.sliding_window=8"):
        hf_mapping.export_architecture(gpt)


def test_a_model_of_no_hugging_face_family_is_refused_in_one_line():
    from jaxdist.models import hf_mapping

    resnet = Config.model_validate({"model": {"name": "resnet"}}).model
    with pytest.raises(UserError, match="^export --format hf: model.name=resnet has no Hugging Face form"):
        hf_mapping.hf_config(resnet)


def test_safetensors_files_round_trip_bfloat16_and_agree_with_the_safetensors_package(tmp_path):
    import ml_dtypes
    from safetensors.numpy import save_file

    from jaxdist.checkpoint import safetensors_file

    rng = np.random.default_rng(0)
    ours = {"w": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16), "b": np.arange(7, dtype=np.int64),
            "x": rng.standard_normal((2, 2, 2)).astype(np.float32)}
    safetensors_file.write(tmp_path / "ours.safetensors", ours, {"format": "pt"})
    back = safetensors_file.File(tmp_path / "ours.safetensors")
    assert back.metadata == {"format": "pt"} and sorted(back.keys()) == ["b", "w", "x"]
    for name, array in ours.items():
        assert back.get(name).dtype == array.dtype
        np.testing.assert_array_equal(back.get(name), array)
    # The package reads what we write, and we read what it writes (the dtypes numpy has).
    plain = {k: v for k, v in ours.items() if k != "w"}
    safetensors_file.write(tmp_path / "plain.safetensors", plain)
    for name, array in load_file(str(tmp_path / "plain.safetensors")).items():
        np.testing.assert_array_equal(array, plain[name])
    save_file(plain, str(tmp_path / "theirs.safetensors"))
    theirs = safetensors_file.File(tmp_path / "theirs.safetensors")
    for name, array in plain.items():
        np.testing.assert_array_equal(theirs.get(name), array)
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes((tmp_path / "ours.safetensors").read_bytes()[:-4])
    with pytest.raises(safetensors_file.SafetensorsError, match="not two integers within its 114 bytes of data"):
        safetensors_file.File(truncated)  # refused as it is opened, before anything is read


def test_the_fine_tuning_walkthrough_in_the_docs_runs(tmp_path, capsys):
    """docs/huggingface.md's config, with the tiny Qwen2 fixture for the published model and a
    small JSON-lines corpus prepared with its tokenizer: trains from the weights, exports, and the
    export re-imports as what was trained."""
    import re

    import yaml
    from data_helpers import random_documents

    text = (Path(__file__).parents[1] / "docs" / "huggingface.md").read_text()
    block = re.search(r"<!-- finetune-example:[^>]*-->\s*```yaml\n(.*?)```", text, re.S).group(1)
    folder = FIXTURES / "qwen2"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in random_documents(60, shortest=40, longest=160)))
    shards = tmp_path / "shards"
    assert cli.main(["data", "prepare", str(corpus), "--out", str(shards), "--tokenizer",
                     str(folder / "tokenizer.json"), "--eval-fraction", "0.1"]) == 0
    run_dir = tmp_path / "run"
    raw = yaml.safe_load(block.replace("models/Qwen2.5-0.5B", str(folder)).replace("data/corpus", str(shards))
                         .replace("runs/finetune", str(run_dir)))
    config_file = tmp_path / "finetune.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert cli.main(["train", str(config_file), "train.steps=3", "eval.every=3", "checkpoint.every=3",
                     "model.seq_len=32", "train.global_batch=8", "precision.compute=float32", "sample.tokens=8"]) == 0
    out = capsys.readouterr().out
    assert "starting from the weights of hf:" in out and "--- sample ---" in out
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in line for line in metrics)

    export_dir = tmp_path / "exported"
    assert cli.main(["export", str(run_dir), str(export_dir), "--format", "hf"]) == 0
    assert (export_dir / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    _, trained, _ = export.read_params(run_dir)
    _, _, again, _ = imported(export_dir, seq_len=32)
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
