"""The loop on prepared shards: `data.epochs` decides the steps, `eval_loss` covers the eval split exactly."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import yaml
from conftest import TINY_GPT, make_config
from data_helpers import huggingface_tokenizer, prepared, random_documents
from flax import nnx

from jaxdist import loop
from jaxdist.config import TrainConfig
from jaxdist.data import loader, sources

pytestmark = pytest.mark.slow


def test_epochs_and_exact_eval_loss(tmp_path):
    path, _ = prepared(tmp_path, random_documents(40, seed=4), eval_fraction=0.2)
    cfg = make_config(
        tmp_path / "run", data={"source": "arrayrecord", "path": str(path), "epochs": 1}, eval={"every": 5, "batches": None}
    )
    cfg = cfg.model_copy(update={"train": TrainConfig(global_batch=cfg.train.global_batch)})  # the epoch decides
    train_windows = len(loader.open_split(cfg, "train"))
    eval_source = loader.open_split(cfg, "eval")
    assert len(eval_source) % cfg.train.global_batch  # the last eval batch is padded

    trainer = loop.train(cfg)

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = train_windows // cfg.train.global_batch
    assert steps > 5
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    evaluated = [r["step"] for r in records if "eval_loss" in r]
    assert evaluated == [s for s in range(1, steps + 1) if s % 5 == 0 or s == steps]

    # The last eval_loss is the mean next-token loss over every eval window, computed in one go.
    windows = [eval_source[i] for i in range(len(eval_source))]
    model = nnx.merge(trainer.graphdef, jax.device_get(trainer.params))
    logits = model(np.stack([w["inputs"] for w in windows]))
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, np.stack([w["targets"] for w in windows]))
    np.testing.assert_allclose(records[-1]["eval_loss"], float(expected.mean()), rtol=2e-6)
    assert records[-1]["eval_loss"] < records[4]["eval_loss"]  # the model learns between evals


def test_huggingface_tokenizer_prepares_round_trips_and_trains(tmp_path):
    docs = random_documents(40, seed=5)
    tokenizer_file = huggingface_tokenizer(tmp_path / "tokenizer.json", docs)
    path, manifest = prepared(tmp_path, docs, tokenizer=str(tokenizer_file), eval_fraction=0.0)
    assert manifest["tokenizer"] == {"name": "huggingface", "vocab_size": 300, "separator": 0, "file": "tokenizer.json"}
    assert (path / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()

    cfg = make_config(tmp_path / "run", data={"source": "arrayrecord", "path": str(path)}, model={"vocab": "auto"},
                      train={"steps": 3}, eval={"every": 0})
    tokenizer = loader.tokenizer(cfg)
    tokens = sources.ArrayRecordTokens(path, manifest, "train")
    stream = np.asarray(tokens[0 : len(tokens)])
    pieces = np.split(stream, np.flatnonzero(stream == tokenizer.separator) + 1)[:-1]
    assert [tokenizer.decode(piece[:-1]) for piece in pieces] == docs
    assert len(stream) < sum(len(doc) for doc in docs)  # BPE merges: fewer tokens than bytes

    trainer = loop.train(cfg)
    model = nnx.merge(trainer.graphdef, jax.device_get(trainer.params))
    assert model.embed[...].shape == (300, cfg.model.d_model)  # model.vocab: auto took the tokenizer's vocabulary
    assert "vocab: 300" in (tmp_path / "run" / "config.yaml").read_text()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in records)


def test_a_whole_eval_split_on_simulated_devices_runs_one_batch_at_a_time(tmp_path):
    """Hundreds of eval batches in flight at once deadlocked XLA's CPU collectives (a rendezvous
    waited 40 s for a busy device thread, then aborted the process); the evaluator finishes each."""
    loop.train(make_config(tmp_path / "run", train={"steps": 2}, log={"every": 2}, eval={"every": 2}))
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and math.isfinite(last["eval_loss"])


def test_a_run_with_data_workers_leaves_no_shared_memory_behind(tmp_path):
    """grain's worker processes hand batches over in shared memory: none of it outlives the run,
    which Python's resource tracker would report at exit as leaked shared_memory objects."""
    config_file = tmp_path / "tiny.yaml"
    config_file.write_text(yaml.safe_dump({**TINY_GPT, "train": {**TINY_GPT["train"], "steps": 3},
                                           "run_dir": str(tmp_path / "run")}))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir}
    run = subprocess.run([sys.executable, "-m", "jaxdist.cli", "train", str(config_file), "data.workers=2"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trained 3 steps" in run.stdout
    assert "leaked" not in run.stderr, run.stderr[-3000:]
