"""`jaxdist data prepare`: formats, tokenizers, manifest; bad input is one line and exit code 2."""

import json
import sys
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import make_config
from data_helpers import huggingface_tokenizer, prepared, random_documents
from tokenizers import Tokenizer

from jaxdist import cli
from jaxdist.data import loader, prepare, sources
from jaxdist.data.shards import SCRATCH_MARKER
from jaxdist.data import tokenizer as tokenizer_lib
from jaxdist.errors import UserError
from jaxdist.observe import timing

TEXT = "def f(x):\n    return x  # é\n"
JSONL_DOCS = ["first line", "second, with a \"quote\"", "ünïcode"]
PARQUET_DOCS = ["row one", None, "row three"]


def test_prepare_reads_text_jsonl_and_parquet(tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "a.txt").write_text(TEXT)
    (inputs / "b.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(JSONL_DOCS)) + "\n\n")
    pq.write_table(pa.table({"text": PARQUET_DOCS}), inputs / "c.parquet")
    manifest = prepare.prepare([str(inputs)], str(tmp_path / "out"), eval_fraction=0.0, chunk_tokens=8)

    docs = [TEXT, *JSONL_DOCS, "row one", "row three"]
    expected = b"".join(doc.encode() + b"\0" for doc in docs)
    train = manifest["splits"]["train"]
    assert (train["documents"], train["tokens"]) == (6, len(expected))
    assert manifest["splits"]["eval"]["tokens"] == 0
    assert manifest["tokenizer"] == {"name": "byte", "vocab_size": 256, "separator": 0}
    tokens = sources.ArrayRecordTokens(tmp_path / "out", manifest, "train")
    assert bytes(tokens[0 : len(tokens)]) == expected
    assert not (tmp_path / "out.partial").exists()


def test_json_lines_suffixes_are_read_as_json_lines_whatever_their_case(tmp_path):
    lines = "".join(json.dumps({"text": doc, "meta": {"id": i}}) + "\n" for i, doc in enumerate(JSONL_DOCS))
    names = ["a.JSONL", "b.json", "c.ndjson", "d.NDJSON", "e.Json"]
    for name in names:
        (tmp_path / name).write_text(lines)
    pq.write_table(pa.table({"text": PARQUET_DOCS}), tmp_path / "f.PARQUET")
    paths = [str(tmp_path / name) for name in [*names, "f.PARQUET"]]
    manifest = prepare.prepare(paths, str(tmp_path / "out"), eval_fraction=0.0)
    expected = b"".join(doc.encode() + b"\0" for doc in JSONL_DOCS * len(names) + ["row one", "row three"])
    tokens = sources.ArrayRecordTokens(tmp_path / "out", manifest, "train")
    assert bytes(tokens[0 : len(tokens)]) == expected


@pytest.mark.parametrize("content", ['[{"text": "a"},\n {"text": "b"}]\n', '[{"text": "a"}, {"text": "b"}]\n'])
def test_a_json_array_file_is_refused_as_not_json_lines(tmp_path, content):
    (tmp_path / "docs.json").write_text(content)
    with pytest.raises(UserError, match=r"docs.json:1 is not (valid JSON \(.*\)|a JSON object); a \.json input must "
                                        r"hold one JSON object per line: fix that line, or convert a JSON array file"):
        prepare.prepare([str(tmp_path / "docs.json")], str(tmp_path / "out"))


def test_a_byte_order_mark_is_not_text(tmp_path):
    bom = "\ufeff".encode()
    (tmp_path / "a.jsonl").write_bytes(bom + b'{"text": "one"}\n' + bom + b'{"text": "two"}\n')  # two files concatenated
    (tmp_path / "b.txt").write_bytes(bom + "three \ufeff".encode())
    manifest = prepare.prepare([str(tmp_path)], str(tmp_path / "out"), eval_fraction=0.0)
    tokens = sources.ArrayRecordTokens(tmp_path / "out", manifest, "train")
    assert bytes(tokens[0 : len(tokens)]) == "one\0two\0three \ufeff\0".encode()


def test_parquet_text_may_be_any_string_or_binary_column_of_utf8(tmp_path):
    # Impala and Hive write text as binary without the UTF-8 annotation: it reads as text all the same.
    columns = [pa.array(PARQUET_DOCS), pa.array(PARQUET_DOCS, pa.large_string()), pa.array(PARQUET_DOCS).dictionary_encode(),
               pa.array([None if doc is None else doc.encode() for doc in PARQUET_DOCS], pa.binary())]
    for index, column in enumerate(columns):
        pq.write_table(pa.table({"text": column}), tmp_path / f"{index}.parquet")
    manifest = prepare.prepare([str(tmp_path)], str(tmp_path / "out"), eval_fraction=0.0)
    tokens = sources.ArrayRecordTokens(tmp_path / "out", manifest, "train")
    assert bytes(tokens[0 : len(tokens)]) == b"row one\0row three\0" * len(columns)


def test_a_parquet_string_that_is_not_utf8_names_its_row(tmp_path):
    data, offsets = b"fineok\xff", np.array([0, 4, 7], np.int32)  # Arrow trusts the writer: no check on write
    column = pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data)])
    pq.write_table(pa.table({"text": column}), tmp_path / "bad.parquet")
    with pytest.raises(UserError, match=r"bad.parquet row index 1 of column 'text' is not UTF-8 text \(byte 2\)"):
        prepare.prepare([str(tmp_path / "bad.parquet")], str(tmp_path / "out"))


def test_sentencepiece_is_trained_locally_and_round_trips(tmp_path):
    words = np.array("the data pipeline reads shards while every process trains its share of".split())
    rng = np.random.default_rng(2)
    docs = [" ".join(rng.choice(words, rng.integers(20, 80))) + "\n" for _ in range(60)]
    path, manifest = prepared(tmp_path, docs, tokenizer="sentencepiece", vocab_size=320, eval_fraction=0.0)
    assert manifest["tokenizer"]["vocab_size"] == 320 and manifest["dtype"] == "uint16"
    assert (path / "tokenizer.model").is_file()
    cfg = make_config(tmp_path, data={"source": "arrayrecord", "path": str(path)}, model={"vocab": 320})
    tokenizer = loader.tokenizer(cfg)
    tokens = sources.ArrayRecordTokens(path, manifest, "train")
    stream = np.asarray(tokens[0 : len(tokens)])
    pieces = np.split(stream, np.flatnonzero(stream == tokenizer.separator) + 1)[:-1]
    assert [tokenizer.decode(piece[:-1]) for piece in pieces] == docs
    assert len(stream) < 0.5 * sum(len(doc) for doc in docs)  # BPE merges: far fewer tokens than bytes


def test_split_follows_the_fraction_and_survives_moving_the_files(tmp_path):
    docs = random_documents(300, seed=3, shortest=5, longest=20)
    _, first = prepared(tmp_path / "here", docs, eval_fraction=0.25)
    _, moved = prepared(tmp_path / "elsewhere" / "deeper", docs, eval_fraction=0.25)
    assert 50 <= first["splits"]["eval"]["documents"] <= 100
    assert first["splits"] == moved["splits"]


def test_a_small_corpus_holds_out_its_smallest_hash_document(tmp_path):
    docs = random_documents(3, seed=6)
    names = [f"doc{index:03d}.txt" for index in range(3)]
    assert all(prepare.split_of(name, 0, 0.01) == "train" for name in names)  # the hash split holds out none
    path, manifest = prepared(tmp_path, docs, eval_fraction=0.01)
    assert (manifest["splits"]["train"]["documents"], manifest["splits"]["eval"]["documents"]) == (2, 1)
    held_out = min(range(3), key=lambda index: zlib.crc32(f"{names[index]}#0".encode()))
    tokens = sources.ArrayRecordTokens(path, manifest, "eval")
    assert bytes(tokens[0 : len(tokens)]) == docs[held_out].encode() + b"\0"
    _, again = prepared(tmp_path / "again", docs, eval_fraction=0.01)
    assert again["splits"] == manifest["splits"]
    _, one = prepared(tmp_path / "one", docs[:1], eval_fraction=0.01)  # a lone document stays in train
    assert one["splits"]["eval"]["documents"] == 0


def test_files_that_share_a_name_get_distinct_split_names(tmp_path, monkeypatch):
    for folder in ["corpus/en", "corpus/de", "extra"]:
        (tmp_path / folder).mkdir(parents=True)
    for path in ["corpus/en/train.txt", "corpus/de/train.txt", "corpus/de/other.txt", "extra/other.txt"]:
        (tmp_path / path).write_text(f"the text of {path}")
    monkeypatch.chdir(tmp_path / "corpus")
    inputs = ["en/train.txt", "de/train.txt", "de/other.txt", str(tmp_path / "extra")]
    names = ["en/train.txt", "de/train.txt", "de/other.txt", "extra/other.txt"]
    assert [name for _, name in prepare.input_files(inputs)] == names
    assert [name for _, name in prepare.input_files(["en/train.txt", str(tmp_path / "extra")])] == ["train.txt", "other.txt"]
    monkeypatch.chdir(tmp_path)  # the same files named from elsewhere keep their names, so their split
    assert [name for _, name in prepare.input_files([f"corpus/{path}" for path in inputs[:3]] + ["extra"])] == names
    manifest = prepare.prepare(["corpus/en/train.txt", "corpus/de/train.txt"], str(tmp_path / "out"))
    assert (manifest["splits"]["train"]["documents"], manifest["splits"]["eval"]["documents"]) == (1, 1)


def test_a_file_given_twice_is_refused(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("some text")
    with pytest.raises(UserError, match=r"docs/\.\./docs/a.txt is given twice \(also as .*/docs/a.txt\); pass each file once"):
        prepare.input_files([str(tmp_path / "docs"), str(tmp_path / "docs" / ".." / "docs" / "a.txt")])


def test_vocab_auto_takes_the_vocabulary_of_the_data(tmp_path):
    docs = random_documents(10, seed=7)
    tokenizer_file = huggingface_tokenizer(tmp_path / "tokenizer.json", docs, vocab_size=290)
    path, _ = prepared(tmp_path, docs, tokenizer=str(tokenizer_file), eval_fraction=0.0)
    np.savez(tmp_path / "tokens.npz", inputs=np.array([[1, 7], [3, 4]]), targets=np.array([[7, 9], [4, 2]]))
    np.savez(tmp_path / "images.npz", image=np.zeros((4, 2)), label=np.arange(4))
    auto = {"vocab": "auto"}
    for data, vocab in [
        ({"source": "stdlib"}, 256),
        ({"source": "arrayrecord", "path": str(path)}, 290),
        ({"source": "arrays", "path": str(tmp_path / "tokens.npz")}, 10),
    ]:
        assert loader.resolve_model(make_config(tmp_path, data=data, model=auto)).model.vocab == vocab
    fixed = make_config(tmp_path, model={"vocab": 512})
    assert loader.resolve_model(fixed) is fixed
    with pytest.raises(UserError, match=r"model.vocab=auto: data.path=.*images.npz has no integer inputs or targets"):
        loader.resolve_model(make_config(tmp_path, data={"source": "arrays", "path": str(tmp_path / "images.npz")}, model=auto))
    with pytest.raises(UserError, match=r"model.vocab = auto takes its value from the data, and bench runs on random"):
        timing.measure(make_config(tmp_path, model=auto))


def test_a_special_token_written_in_a_document_is_text_not_a_document_boundary(tmp_path):
    docs = ["GPT-2 data ends documents with <|endoftext|> and [SEP] marks.", "second document"]
    tokenizer_file = huggingface_tokenizer(tmp_path / "tokenizer.json", docs, special=("<|endoftext|>", "[SEP]"))
    path, manifest = prepared(tmp_path, docs, tokenizer=str(tokenizer_file), eval_fraction=0.0)
    tokenizer = tokenizer_lib.load(manifest["tokenizer"], path)
    tokens = sources.ArrayRecordTokens(path, manifest, "train")
    stream = np.asarray(tokens[0 : len(tokens)])
    special = [Tokenizer.from_file(str(tokenizer_file)).token_to_id(token) for token in ("<|endoftext|>", "[SEP]")]
    assert np.isin(stream, special).sum() == 2 and stream[-1] == tokenizer.separator
    pieces = np.split(stream, np.flatnonzero(stream == tokenizer.separator) + 1)[:-1]
    assert [tokenizer.decode(piece[:-1]) for piece in pieces] == docs


def test_a_nul_in_a_document_is_no_byte_separator(tmp_path):
    docs = ["a NUL \0 inside the first document", "second document"]
    path, manifest = prepared(tmp_path, docs, eval_fraction=0.0)
    tokens = sources.ArrayRecordTokens(path, manifest, "train")
    stream = np.asarray(tokens[0 : len(tokens)])
    assert np.flatnonzero(stream == 0).tolist() == [len(docs[0]) - 1, len(stream) - 1]


def test_huggingface_tokenizer_without_end_of_text_is_one_line_and_exit_2(tmp_path, capfd):
    docs = random_documents(5, seed=8)
    (tmp_path / "good.txt").write_text(docs[0])
    tokenizer_file = huggingface_tokenizer(tmp_path / "plain.json", docs, special=("[UNK]",))
    code, err = run_cli(["data", "prepare", str(tmp_path / "good.txt"), "--out", str(tmp_path / "out"),
                         "--tokenizer", str(tokenizer_file)], capfd)
    assert code == 2 and len(err) == 1, err
    assert f"tokenizer {tokenizer_file} has no end-of-text special token" in err[0]
    assert "<|endoftext|>, </s>, [SEP], <eos>" in err[0]
    assert not (tmp_path / "out").exists()


def write_config(tmp_path, **sections):
    path = tmp_path / "config.yaml"
    path.write_text(make_config(tmp_path / "run", **sections).to_yaml())
    return str(path)


@pytest.fixture
def shards(tmp_path):
    path, manifest = prepared(tmp_path, random_documents(40, seed=1), eval_fraction=0.0, chunk_tokens=64)
    return path, path / manifest["splits"]["train"]["files"][0]


def run_cli(args, capfd) -> tuple[int, list[str]]:
    code = cli.main(args)
    return code, capfd.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing input", "input {tmp}/nope.txt does not exist"),
        ("empty file", "{tmp}/empty.txt is empty"),
        ("unknown tokenizer", "--tokenizer='wordpiece' is not a known tokenizer; choose one of byte, sentencepiece"),
        ("corrupt jsonl", "{tmp}/bad.jsonl:2 is not valid JSON"),
        ("corrupt jsonl, sentencepiece", "{tmp}/bad.jsonl:2 is not valid JSON"),
        ("non-UTF-8 jsonl", "{tmp}/latin1.jsonl:900 is not UTF-8 text (byte 15 of the line)"),
        ("lone surrogate", "{tmp}/surrogate.jsonl:2 is not UTF-8 text: field 'text' holds the lone surrogate \\ud83d"),
        ("integer column", "{tmp}/ints.parquet column 'text' holds int64, not text; pass --text-key"),
        ("binary column, not UTF-8", "{tmp}/bytes.parquet row index 1 of column 'text' is not UTF-8 text (byte 2)"),
        ("empty texts, sentencepiece", "--tokenizer=sentencepiece: the train split's documents hold no text it can "
                                       "learn from (each is empty or longer than 16777216 bytes)"),
        ("vocabulary too large", "--vocab-size=5000 is too large: these files hold enough text for at most "),
        ("vocabulary too small", "--vocab-size=5 is too small: these files need 265 pieces for their characters, "
                                 "bytes and special ids; use --vocab-size=265 or more"),
    ],
)
def test_bad_prepare_input_is_one_line_and_exit_2(tmp_path, capfd, case, expected):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    lines = [json.dumps({"text": f"document {index}, with some words"}).encode() for index in range(1000)]
    lines[899] = lines[899].replace(b"document", b"docum\xe9nt")  # far past the first read's buffer
    (tmp_path / "latin1.jsonl").write_bytes(b"\n".join(lines))
    (tmp_path / "surrogate.jsonl").write_text('{"text": "fine"}\n{"text": "scraped \\ud83d text"}\n')  # valid JSON
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    pq.write_table(pa.table({"text": [b"fine", b"ok\xff"]}), tmp_path / "bytes.parquet")
    (tmp_path / "good.txt").write_text("some text")
    (tmp_path / "empty_texts.jsonl").write_text('{"text": ""}\n{"text": ""}\n{"text": ""}\n')
    inputs, tokenizer = {
        "missing input": ("nope.txt", "byte"),
        "empty file": ("empty.txt", "byte"),
        "unknown tokenizer": ("good.txt", "wordpiece"),
        "corrupt jsonl": ("bad.jsonl", "byte"),
        "corrupt jsonl, sentencepiece": ("bad.jsonl", "sentencepiece"),
        "non-UTF-8 jsonl": ("latin1.jsonl", "byte"),
        "lone surrogate": ("surrogate.jsonl", "byte"),
        "integer column": ("ints.parquet", "byte"),
        "binary column, not UTF-8": ("bytes.parquet", "byte"),
        "empty texts, sentencepiece": ("empty_texts.jsonl", "sentencepiece"),
        "vocabulary too large": ("good.txt", "sentencepiece"),
        "vocabulary too small": ("good.txt", "sentencepiece"),
    }[case]
    code, err = run_cli(
        ["data", "prepare", str(tmp_path / inputs), "--out", str(tmp_path / "out"), "--tokenizer", tokenizer,
         "--vocab-size", "5" if case == "vocabulary too small" else "5000"],
        capfd,
    )
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("jaxdist: error: data prepare: "), err
    assert expected.format(tmp=tmp_path) in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tokenizer", ["byte", "sentencepiece"])
def test_no_document_left_to_train_on_is_said_before_training(tmp_path, capfd, tokenizer):
    paths = [tmp_path / f"d{index}.txt" for index in range(3)]
    for path in paths:
        path.write_text(f"{path.name} with enough text to make a few windows of tokens for training")
    assert all(prepare.split_of(path.name, 0, 0.999) == "eval" for path in paths)
    code, err = run_cli(["data", "prepare", *map(str, paths), "--out", str(tmp_path / "out"), "--tokenizer", tokenizer,
                         "--vocab-size", "300", "--eval-fraction", "0.999"], capfd)
    assert code == 2 and len(err) == 1, err
    assert err[0] == ("jaxdist: error: data prepare: every document fell into the eval split, leaving none to train on; "
                      "lower --eval-fraction=0.999 or add documents")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["under_a_file", "a_file", "dot", "empty", "not_empty", "in_proc"])
def test_an_out_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, capfd, monkeypatch, case):
    (tmp_path / "good.txt").write_text("some text")
    (tmp_path / "a_file").write_text("")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    monkeypatch.chdir(tmp_path / "full")
    out, expected = {
        "under_a_file": (tmp_path / "a_file" / "sub", f"cannot be written: {tmp_path / 'a_file'} is a file, not a directory"),
        "a_file": (tmp_path / "a_file", "is a file; pass a new or empty directory"),
        "dot": (".", "--out='.' names no new directory; pass one, e.g. --out data/prepared"),
        "empty": ("", "--out='' names no new directory"),
        "not_empty": (tmp_path / "full", "is not empty; pass a new or empty directory"),
        "in_proc": ("/proc/jaxdist-data", "cannot be written (No such file or directory"),
    }[case]
    code, err = run_cli(["data", "prepare", str(tmp_path / "good.txt"), "--out", str(out)], capfd)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("jaxdist: error: data prepare: --out=") and expected in err[0], err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a_file", "full", "good.txt"]


def test_a_partial_folder_jaxdist_did_not_make_is_never_deleted(tmp_path, capfd):
    """`--out keep` writes into keep.partial/ first: a folder of that name that is the user's own is
    in the way (one line, exit 2, its files untouched); one a killed prepare left is removed."""
    (tmp_path / "a.txt").write_text("some text")
    mine = tmp_path / "keep.partial"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    code, err = run_cli(["data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "keep")], capfd)
    assert code == 2 and err == [
        f"jaxdist: error: data prepare: --out={tmp_path / 'keep'}: {mine} is in the way, and jaxdist did not make it "
        f"(a prepare writes there before renaming it to the output); move it away or pass another --out"]
    assert (mine / "notes.txt").read_text() == "my notes" and not (tmp_path / "keep").exists()

    left = tmp_path / "out.partial"  # what a killed prepare leaves: its marker and half its shards
    left.mkdir()
    (left / SCRATCH_MARKER).write_text("")
    (left / "train-00000.array_record").write_bytes(b"half a shard")
    assert run_cli(["data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out")], capfd)[0] == 0
    assert not left.exists() and (tmp_path / "out" / sources.MANIFEST).is_file()
    assert not (tmp_path / "out" / SCRATCH_MARKER).exists()


def truncate(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


@pytest.mark.parametrize(
    "case, overrides, expected",
    [
        ("missing path", ["data.path={tmp}/absent"], "data.path={tmp}/absent is not a directory"),
        ("truncated shard", [], "shard train-00000.array_record is corrupt"),
        ("seq_len too long", ["model.seq_len=8192"], "model.seq_len=8192 is longer than the train split"),
        ("vocab too small", ["model.vocab=100"], "model.vocab=100 is smaller than the vocabulary"),
    ],
)
def test_bad_train_data_is_one_line_and_exit_2_before_compiling(tmp_path, capfd, compiles, shards, case, overrides, expected):
    path, shard = shards
    if case == "truncated shard":
        truncate(shard)
    config = write_config(tmp_path, data={"source": "arrayrecord", "path": str(path)})
    code, err = run_cli(["train", config, *(o.format(tmp=tmp_path) for o in overrides)], capfd)
    assert code == 2 and len(err) == 1, err
    assert expected.format(tmp=tmp_path) in err[0], err
    assert compiles.count == 0


def test_corrupt_record_is_one_line_and_exit_2_before_compiling(tmp_path, capfd, compiles, shards):
    path, shard = shards
    data = bytearray(shard.read_bytes())
    for offset in range(100, 4000, 50):  # inside the compressed records, which precede the index
        data[offset] ^= 0xFF
    shard.write_bytes(bytes(data))
    config = write_config(tmp_path, data={"source": "arrayrecord", "path": str(path)})
    code, err = run_cli(["train", config], capfd)
    assert code == 2 and len(err) == 1, err
    assert "of shard train-00000.array_record is corrupt (Corrupted Riegeli" in err[0], err
    assert compiles.count == 0


@pytest.mark.parametrize("module, extra, suffix, tokenizer", [
    ("pyarrow", "parquet", ".parquet", "byte"),
    ("sentencepiece", "sentencepiece", ".txt", "sentencepiece"),
])
def test_a_missing_optional_dependency_names_its_extra(tmp_path, capfd, monkeypatch, module, extra, suffix, tokenizer):
    source = tmp_path / f"docs{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.table({"text": PARQUET_DOCS}), source)
    else:
        source.write_text("some text\n")
    for name in {module, *(name for name in sys.modules if name.startswith(f"{module}."))}:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules makes `import` fail
    code = cli.main(["data", "prepare", str(source), "--out", str(tmp_path / "out"), "--tokenizer", tokenizer])
    err = capfd.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert f"needs {module}; pip install 'jaxdist[{extra}]'" in err
