"""Packed documents (`data.packing`): rows of whole documents whose tokens attend only within their
own document, positions restarting with each, padding left out of the loss. A document's losses in
a packed row are the losses it has run alone."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_config
from flax import nnx

from jaxdist import cli, loop, models
from jaxdist.config import Config
from jaxdist.data.stream import PackedDocuments
from jaxdist.models import cross_entropy, gpt

SEP = 0
DOCS = [[5, 6, 7, 8, 9, SEP], [11, 12, 13, SEP], [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, SEP], [41, 42, SEP],
        [51, 52, 53, 54, 55, SEP]]


def _model(**keys):
    cfg = Config.model_validate({"model": {"vocab": 64, "d_model": 32, "layers": 2, "heads": 4, "seq_len": 16,
                                           **keys}})
    with nnx.use_eager_sharding(False):  # one device, no mesh: the logical names stay metadata
        return models.get(cfg.model.name).create(cfg)(nnx.Rngs(3)), cfg


def _token_losses(model, inputs, targets, segments=None, positions=None) -> np.ndarray:
    logits = model(jnp.asarray(inputs), None if segments is None else jnp.asarray(segments),
                   None if positions is None else jnp.asarray(positions))
    return np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), jnp.asarray(targets)))


@pytest.mark.parametrize("keys", [
    {},  # GPT: learned positions, LayerNorm, GELU
    {"name": "llama", "kv_heads": 2, "rope_base": 500000.0, "biases": "qkv"},
], ids=["gpt", "llama-gqa"])
def test_each_document_in_a_packed_row_has_the_losses_it_has_alone(keys):
    model, cfg = _model(**keys)
    source = PackedDocuments(np.concatenate(DOCS).astype(np.int32), cfg.model.seq_len, SEP)
    rows = [source[i] for i in range(len(source))]
    batch = {key: np.stack([row[key] for row in rows]) for key in rows[0]}
    packed = _token_losses(model, batch["inputs"], batch["targets"], batch["segments"], batch["positions"])
    checked = 0
    for doc in DOCS:
        alone = _token_losses(model, np.array([doc[:-1]]), np.array([doc[1:]]))[0]
        row, at = _find(batch["inputs"], doc[:-1])
        assert list(batch["positions"][row, at:at + len(alone)]) == list(range(len(alone)))
        np.testing.assert_allclose(packed[row, at:at + len(alone)], alone, atol=1e-6, rtol=0)
        checked += 1
    assert checked == len(DOCS) and len(source) < len(DOCS)  # several documents did share a row


def _find(inputs: np.ndarray, doc: list[int]) -> tuple[int, int]:
    for row, tokens in enumerate(inputs.tolist()):
        for at in range(len(tokens) - len(doc) + 1):
            if tokens[at:at + len(doc)] == doc:
                return row, at
    raise AssertionError(f"document {doc} not found whole in any row")


def test_packed_rows_hold_every_document_once_in_order():
    tokens = np.concatenate(DOCS + [[61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, SEP]])
    source = PackedDocuments(tokens.astype(np.int32), 8, SEP)
    pairs = []
    for i in range(len(source)):
        row = source[i]
        real = row["segments"] > 0
        assert not row["segments"][real.sum():].any(), "padding only at the row's end"
        assert (row["targets"][~real] == 0).all() and (row["positions"][~real] == 0).all()
        for segment in range(1, row["segments"].max() + 1):
            mine = row["segments"] == segment
            assert list(row["positions"][mine]) == list(range(mine.sum()))
            pairs += list(zip(row["inputs"][mine].tolist(), row["targets"][mine].tolist()))
    # Every (input, target) pair of every document once, in stream order; no pair across a boundary.
    expected = [(a, b) for doc in DOCS + [list(range(61, 80)) + [SEP]] for a, b in zip(doc[:-1], doc[1:])]
    assert pairs == expected
    # The 19-pair document fills rows of 8, 8 and 3 pairs; the 11-pair one rows of 8 and 3.
    assert source.documents == 6 and 0 < source.padding < 0.5
    # Read a few tokens at a time, the stream gives the same plan.
    from jaxdist.data import stream

    assert np.array_equal(stream._document_ends(tokens, SEP, chunk=7), stream._document_ends(tokens, SEP))


def test_the_chunked_loss_weighs_tokens_as_the_plain_loss_does():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((4, 16, 8)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((8, 24)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 24, (4, 16)))
    weights = jnp.asarray(rng.random((4, 16)) > 0.3, jnp.float32)

    def plain(hidden, head):
        losses = optax.softmax_cross_entropy_with_integer_labels(hidden @ head, targets)
        return (losses * weights).sum() / weights.sum()

    def chunked(hidden, head):
        total = cross_entropy.fused_linear_cross_entropy(hidden, head, targets, weights, chunk=4, impl="xla")
        return total / weights.sum()

    (value, grads), (expected, expected_grads) = (jax.value_and_grad(f, argnums=(0, 1))(hidden, head)
                                                  for f in (chunked, plain))
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_a_packed_run_trains_alike_on_one_device_and_on_data_fsdp_tensor(tmp_path):
    losses = {}
    for name, mesh in [("one", {"data": 1, "fsdp": 1, "tensor": 1}), ("dft", {"data": 2, "fsdp": 2, "tensor": 2})]:
        run_dir = tmp_path / name
        cfg = make_config(run_dir, data={"packing": True}, train={"steps": 4, "global_batch": 8},
                          mesh=mesh, rules={"preset": "fsdp_tp"}, impl={"loss_chunk": 8})
        devices = jax.devices()[:1] if name == "one" else None
        loop.train(cfg, devices=devices)
        losses[name] = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                        if "loss" in json.loads(line)]
    assert len(losses["one"]) == 4
    np.testing.assert_allclose(losses["dft"], losses["one"], rtol=2e-5)


def test_packing_where_it_cannot_apply_is_one_line(tmp_path, capsys):
    code = cli.main(["train", "digits_mlp", f"run_dir={tmp_path / 'run'}", "data.packing=true"])
    err = capsys.readouterr().err
    message = "data.packing packs the documents of a token stream; data.source=digits holds none"
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_the_documents_mask_is_causal_within_each_document():
    # The GPT's documents mask: causal and within a segment, padding (segment 0) with itself.
    segments = jnp.array([[1, 1, 2, 2, 0]])
    mask = gpt.documents(segments, jnp.zeros_like(segments)).mask[0, 0]
    expected = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]], bool)
    np.testing.assert_array_equal(mask, expected)
