"""Data mixtures (`data.mixture`): prepared folders mixed by weight, deterministically, resumable at
the exact row, each evaluated apart."""

import json

import numpy as np
import pytest
from conftest import logged_keys, make_config, undocumented_metrics
from data_helpers import prepared, write_text_files

from jaxdist import cli, loop
from jaxdist.config import Config
from jaxdist.data import loader, prepare
from jaxdist.parallel.feed import BatchRows

SEQ = 16


def _source(tmp_path, name: str, alphabet: str, docs: int, seed: int):
    """A prepared folder of random documents over `alphabet` (a row's bytes tell its source)."""
    rng = np.random.default_rng(seed)
    texts = ["".join(rng.choice(list(alphabet), rng.integers(60, 200))) for _ in range(docs)]
    write_text_files(tmp_path / name / "docs", texts)
    out = tmp_path / name / "shards"
    prepare.prepare([str(tmp_path / name / "docs")], str(out), eval_fraction=0.1)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mixture")
    return {"letters": _source(tmp, "letters", "abcdefghij", 400, 0), "digits": _source(tmp, "digits", "0123456789", 400, 1)}


def _config(tmp_path, folders, weights=(0.7, 0.3), **sections):
    raw = make_config(tmp_path / "run", model={"seq_len": SEQ}, **sections).model_dump(mode="json")
    raw["data"] = {**raw["data"], "source": "arrayrecord", "path": None, "mixture": [
        {"name": name, "path": str(path), "weight": weight} for (name, path), weight in zip(folders.items(), weights)]}
    return Config.model_validate(raw)


def _origin(row: np.ndarray) -> str:
    text = bytes(row.astype(np.uint8)).replace(b"\x00", b"")
    return "digits" if text and all(48 <= c <= 57 for c in text) else "letters"


def test_each_source_gets_its_share_of_10000_rows(tmp_path, folders):
    cfg = _config(tmp_path, folders, train={"global_batch": 100})
    rows = BatchRows(100, list(range(100)))
    batches = loader.train_iterator(cfg, rows)
    origins = [_origin(row) for _ in range(100) for row in next(batches)["inputs"]]
    batches.close()
    share = origins.count("letters") / len(origins)
    assert len(origins) == 10_000 and abs(share - 0.7) < 0.02, share


def test_a_resumed_mixture_reads_the_rows_the_uninterrupted_one_reads(tmp_path, folders):
    cfg = _config(tmp_path, folders, train={"global_batch": 8})
    rows = BatchRows(8, list(range(8)))
    whole = loader.train_iterator(cfg, rows)
    expected = [next(whole)["inputs"] for _ in range(30)]
    whole.close()
    resumed = loader.train_iterator(cfg, rows, start_example=17 * 8)
    for step in range(17, 30):
        np.testing.assert_array_equal(next(resumed)["inputs"], expected[step])
    resumed.close()


def test_a_mixture_run_reports_each_sources_eval_loss(tmp_path, folders):
    cfg = _config(tmp_path, folders, weights=(3.0, 1.0), train={"steps": 4, "global_batch": 8},
                  eval={"every": 4, "batches": 2})
    loop.train(cfg)
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if "eval_loss" in line]
    last = evals[-1]
    assert {"eval_letters_loss", "eval_digits_loss"} <= set(last)
    assert last["eval_loss"] == pytest.approx(0.75 * last["eval_letters_loss"] + 0.25 * last["eval_digits_loss"])
    assert last["eval_letters_loss"] != last["eval_digits_loss"]
    assert undocumented_metrics(logged_keys(tmp_path / "run")) == set()


@pytest.mark.parametrize("mixture, message", [
    ([{"name": "a", "path": "x", "weight": 1}, {"name": "a", "path": "y", "weight": 1}],
     "data.mixture needs one or more sources of distinct names"),
    ([{"name": "a-b", "path": "x", "weight": 1}], "data.mixture name 'a-b': use letters, digits and _"),
    ([{"name": "a", "path": "x", "weight": 0}], "greater than 0"),
])
def test_a_bad_mixture_is_one_line(tmp_path, capsys, mixture, message):
    path = tmp_path / "run.json"
    raw = make_config(tmp_path / "run").model_dump(mode="json")
    raw["data"] = {"source": "arrayrecord", "mixture": mixture}
    path.write_text(json.dumps(raw))
    assert cli.main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_sources_of_different_tokenizers_are_refused(tmp_path, folders, capsys):
    other, _ = prepared(tmp_path, ["some words here " * 20] * 30, tokenizer="sentencepiece", vocab_size=280)
    cfg = _config(tmp_path, {"letters": folders["letters"], "words": other})
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab": 512})})
    path = tmp_path / "run.json"
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    assert cli.main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "data.mixture: words was prepared with tokenizer sentencepiece" in err and "prepare every source with one tokenizer" in err, err
