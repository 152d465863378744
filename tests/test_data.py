"""Grain pipelines: each process reads the rows it holds, epochs reshuffle, a position restores exactly."""

import json
import shutil
from itertools import islice

import numpy as np
import pytest
from conftest import make_classifier_config, make_config
from data_helpers import prepared, random_documents, window_ids

from jaxdist import cli
from jaxdist.config import TrainConfig
from jaxdist.data import loader, prepare, sources
from jaxdist.data import stream as data_stream
from jaxdist.data.tokenizer import ByteTokenizer
from jaxdist.errors import UserError
from jaxdist.parallel import feed
from jaxdist.parallel.feed import BatchRows

SEQ_LEN = 16
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """40 random documents as byte-token shards: small records, several shard files per split."""
    docs = random_documents(40, seed=1)
    path, manifest = prepared(
        tmp_path_factory.mktemp("data"), docs, eval_fraction=0.2, chunk_tokens=64, records_per_shard=8
    )
    return path, manifest, docs


def data_config(tmp_path, path, data=(), **sections):
    return make_config(
        tmp_path, data={"source": "arrayrecord", "path": str(path), **dict(data)},
        model={"seq_len": SEQ_LEN}, train={"global_batch": GLOBAL_BATCH}, **sections,
    )


def expected_tokens(docs: list[str], split: str, eval_fraction: float) -> np.ndarray:
    """The split's packed stream, built without the prepare code: bytes of each document + NUL."""
    chosen = [doc for i, doc in enumerate(docs) if prepare.split_of(f"doc{i:03d}.txt", 0, eval_fraction) == split]
    return np.concatenate([np.append(np.frombuffer(doc.encode(), np.uint8), 0) for doc in chosen])


def window_index(source: data_stream.TokenWindows) -> dict[bytes, int]:
    index = {source[i]["inputs"].tobytes(): i for i in range(len(source))}
    assert len(index) == len(source), "test data must have unique windows"
    return index


def shares(process_count: int) -> list[BatchRows]:
    """The rows of each of `process_count` processes that split the batch in contiguous parts."""
    local = GLOBAL_BATCH // process_count
    return [BatchRows(GLOBAL_BATCH, tuple(range(p * local, (p + 1) * local))) for p in range(process_count)]


def global_stream(source, process_count: int, steps: int, seed: int = 0, start_example: int = 0) -> list[int]:
    """Window ids in global stream order, reassembled from what each simulated process read."""
    order = [0] * (steps * GLOBAL_BATCH)
    for rows in shares(process_count):
        batches = data_stream.train_batches(source, rows, seed, start_example)
        for step, ids in enumerate(window_ids([batch], window_index(source)) for batch in islice(batches, steps)):
            for row, window in zip(rows.rows, ids, strict=True):  # row r of batch s: stream position s * G + r
                order[step * GLOBAL_BATCH + row] = window
    return order


def test_prepared_shards_hold_the_packed_documents(tmp_path, dataset):
    path, manifest, docs = dataset
    for split in ("train", "eval"):
        expected = expected_tokens(docs, split, 0.2)
        entry = manifest["splits"][split]
        assert entry["tokens"] == len(expected) and sum(entry["records"]) == -(-len(expected) // 64)
        assert entry["documents"] == int((expected == 0).sum())
        tokens = sources.ArrayRecordTokens(path, manifest, split)
        np.testing.assert_array_equal(tokens[0 : len(tokens)], expected)
        np.testing.assert_array_equal(tokens[60:200], expected[60:200])  # a range across records
    assert len(manifest["splits"]["train"]["files"]) > 1
    assert manifest["splits"]["eval"]["documents"] >= 4

    source = loader.open_split(data_config(tmp_path, path), "train")
    window = source[7]
    stream = expected_tokens(docs, "train", 0.2)
    np.testing.assert_array_equal(window["inputs"], stream[7 * SEQ_LEN : 8 * SEQ_LEN])
    np.testing.assert_array_equal(window["targets"], stream[7 * SEQ_LEN + 1 : 8 * SEQ_LEN + 1])


@pytest.mark.parametrize("process_count", [1, 2, 4])
def test_each_epoch_reads_every_example_once_under_any_process_count(tmp_path, dataset, process_count):
    source = loader.open_split(data_config(tmp_path, dataset[0]), "train")
    n = len(source)
    steps = -(-2 * n // GLOBAL_BATCH)  # two whole epochs
    stream = global_stream(source, process_count, steps)
    assert n > 100 and n % GLOBAL_BATCH  # an epoch ends inside a global batch
    for epoch in range(2):
        part = stream[epoch * n : (epoch + 1) * n]
        assert sorted(part) == list(range(n))  # every example once: no duplicates, nothing lost
        local = GLOBAL_BATCH // process_count
        held = [{i for s, i in enumerate(part) if ((epoch * n + s) % GLOBAL_BATCH) // local == p} for p in range(process_count)]
        assert sum(len(share) for share in held) == n  # the processes' shares are disjoint
    assert stream == global_stream(source, 1, steps)  # the same global stream at any process count


def test_processes_that_hold_the_same_rows_read_the_same_examples(tmp_path, dataset):
    """Rows held by two processes (a non-batch axis across them) are read alike by both, and a
    process holding scattered rows reads exactly those positions of the stream."""
    source = loader.open_split(data_config(tmp_path, dataset[0]), "train")
    index = window_index(source)
    stream = global_stream(source, 1, 6, start_example=5)
    replica = [window_ids(list(islice(data_stream.train_batches(source, shares(2)[1], 0, 5), 6)), index) for _ in range(2)]
    assert replica[0] == replica[1] == [w for s in range(6) for w in stream[s * 8 + 4 : s * 8 + 8]]
    scattered = BatchRows(GLOBAL_BATCH, (0, 1, 6, 7))
    ids = window_ids(list(islice(data_stream.train_batches(source, scattered, 0, 5), 6)), index)
    assert ids == [stream[s * 8 + r] for s in range(6) for r in scattered.rows]


def test_epochs_reshuffle_and_the_seed_fixes_the_order(tmp_path, dataset):
    source = loader.open_split(data_config(tmp_path, dataset[0]), "train")
    n = len(source)
    steps = -(-2 * n // GLOBAL_BATCH)  # two whole epochs
    stream = global_stream(source, 1, steps, seed=0)
    first, second = stream[:n], stream[n : 2 * n]
    assert first != second and sorted(first) == sorted(second)
    assert sum(a == b for a, b in zip(first, second)) < n // 10
    assert stream == global_stream(source, 1, steps, seed=0)
    assert stream[:n] != global_stream(source, 1, steps, seed=1)[:n]


def test_restored_iterator_yields_the_same_next_20_batches(tmp_path, dataset):
    cfg = data_config(tmp_path, dataset[0])
    source = loader.open_split(cfg, "train")
    done = len(source) // GLOBAL_BATCH - 5  # the next 20 batches cross into the next epoch
    everything = shares(1)[0]
    running = loader.train_iterator(cfg, everything)
    for _ in range(done):
        next(running)
    expected = list(islice(running, 20))
    restored = list(islice(loader.train_iterator(cfg, everything, start_example=done * GLOBAL_BATCH), 20))
    for a, b in zip(expected, restored, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
        np.testing.assert_array_equal(a["targets"], b["targets"])
    # Restored onto 2 processes, the global batches are the same examples in the same order.
    index = window_index(source)
    two = global_stream(source, 2, 20, start_example=done * GLOBAL_BATCH)
    assert two == window_ids(expected, index)


@pytest.mark.parametrize("process_count", [1, 2, 4])
def test_eval_pass_covers_the_split_once_with_padding_weighted_zero(tmp_path, dataset, process_count):
    source = loader.open_split(data_config(tmp_path, dataset[0]), "eval")
    n = len(source)
    index = window_index(source)
    real, padding, batches = [], 0, 0
    for rows in shares(process_count):
        for batch in data_stream.eval_batches(source, rows):
            assert batch["inputs"].shape == (GLOBAL_BATCH // process_count, SEQ_LEN)
            ids = window_ids([batch], index)
            real += [i for i, w in zip(ids, batch["weights"]) if w == 1]
            padding += int((batch["weights"] == 0).sum())
            batches += 1
    assert n % GLOBAL_BATCH and sorted(real) == list(range(n))
    assert padding == -(-n // GLOBAL_BATCH) * GLOBAL_BATCH - n
    assert batches == -(-n // GLOBAL_BATCH) * process_count


def test_eval_batches_limits_the_pass_to_a_fixed_sample(tmp_path, dataset):
    """The split is stored document by document: a limited pass reads a fixed shuffled order, the same
    on every process and under any seed, so its batches sample the whole split."""
    source = loader.open_split(data_config(tmp_path, dataset[0]), "eval")
    index = window_index(source)

    def sample(process_count: int, seed: int) -> list[int]:
        cfg = data_config(tmp_path, dataset[0], eval={"every": 5, "batches": 2}, seed=seed)
        windows = [-1] * (2 * GLOBAL_BATCH)
        for rows in shares(process_count):
            batches = list(loader.eval_iterator(cfg, rows, source))
            assert len(batches) == 2 and all(b["weights"].sum() == len(rows.rows) for b in batches)
            for b, ids in enumerate(window_ids([batch], index) for batch in batches):
                for row, window in zip(rows.rows, ids, strict=True):
                    windows[b * GLOBAL_BATCH + row] = window
        return windows

    windows = sample(1, seed=0)
    assert len(source) > 4 * GLOBAL_BATCH and len(set(windows)) == 2 * GLOBAL_BATCH
    assert max(windows) >= len(source) // 2  # not the first documents only
    assert sample(2, seed=0) == windows == sample(1, seed=7)


def test_in_memory_arrays_split_rows_between_train_and_eval(tmp_path):
    rows = np.arange(200, dtype=np.int32)
    np.savez(tmp_path / "rows.npz", x=rows[:, None] * np.ones((1, 3), np.int32), label=rows % 7)
    cfg = make_config(tmp_path, data={"source": "arrays", "path": str(tmp_path / "rows.npz"), "eval_fraction": 0.1})
    train, held_out = loader.open_split(cfg, "train"), loader.open_split(cfg, "eval")
    train_rows = [int(train[i]["x"][0]) for i in range(len(train))]
    eval_rows = [int(held_out[i]["x"][0]) for i in range(len(held_out))]
    assert len(eval_rows) == 20 and sorted(train_rows + eval_rows) == list(range(200))
    assert all(held_out[i]["label"] == eval_rows[i] % 7 for i in range(20))
    rows = BatchRows(16, tuple(range(16)))
    seen = [int(x) for b in islice(loader.train_iterator(cfg, rows), len(train) // 16) for x in b["x"][:, 0]]
    assert len(seen) == len(set(seen)) == 180 // 16 * 16 and set(seen) <= set(train_rows)


def test_epochs_decide_the_number_of_steps(tmp_path, dataset):
    cfg = data_config(tmp_path, dataset[0], data={"epochs": 3})
    cfg = cfg.model_copy(update={"train": TrainConfig(global_batch=GLOBAL_BATCH)})  # train.steps left out
    n = len(loader.open_split(cfg, "train"))
    assert loader.resolve_steps(cfg, n).train.steps == 3 * n // GLOBAL_BATCH
    # Resumed after 10 steps at half this batch: the run still ends after 3 passes of examples.
    resumed = loader.resolve_steps(cfg, n, start_step=10, start_example=10 * GLOBAL_BATCH // 2)
    assert resumed.train.steps == 10 + (3 * n - 10 * GLOBAL_BATCH // 2) // GLOBAL_BATCH
    assert loader.resolve_steps(cfg, n, start_step=50, start_example=3 * n + 5).train.steps == 50


def with_steps(cfg, steps: int):
    """`cfg` with train.steps given by the user (as a file or an override would)."""
    return cfg.model_copy(update={"train": TrainConfig(global_batch=GLOBAL_BATCH, steps=steps)})


def test_train_steps_given_with_epochs_end_the_run_at_the_earlier_and_a_line_says_so(tmp_path, dataset):
    cfg = with_steps(data_config(tmp_path, dataset[0], data={"epochs": 1}), 3)
    n = len(loader.open_split(cfg, "train"))
    epoch_steps = n // GLOBAL_BATCH
    assert epoch_steps > 3
    said = []
    assert loader.resolve_steps(cfg, n, log=said.append).train.steps == 3
    assert said == [f"data.epochs=1 ends the run at step {epoch_steps} and train.steps=3 at step 3: the run ends at "
                    f"the earlier, where train.steps says (data.epochs is not reached)"]
    longer = with_steps(cfg, epoch_steps + 5)
    said.clear()
    assert loader.resolve_steps(longer, n, log=said.append).train.steps == epoch_steps
    assert said == [f"data.epochs=1 ends the run at step {epoch_steps} and train.steps={epoch_steps + 5} at step "
                    f"{epoch_steps + 5}: the run ends at the earlier, where data.epochs says (train.steps is not "
                    f"reached)"]


def test_worker_processes_yield_the_same_batches(dataset, tmp_path):
    source = loader.open_split(data_config(tmp_path, dataset[0]), "train")
    rows = BatchRows(GLOBAL_BATCH, (1, 2, 5, 6))
    threads = list(islice(data_stream.train_batches(source, rows, seed=3, start_example=11), 6))
    workers = list(islice(data_stream.train_batches(source, rows, seed=3, start_example=11, workers=2), 6))
    for a, b in zip(threads, workers, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_byte_tokenizer_round_trips():
    text = "déf f(x):\n\treturn x  # ok"
    assert ByteTokenizer().decode(ByteTokenizer().encode(text)) == text


def test_unequal_arrays_name_the_file(tmp_path):
    np.savez(tmp_path / "bad.npz", x=np.zeros((5, 2)), y=np.zeros(4))
    cfg = make_config(tmp_path, data={"source": "arrays", "path": str(tmp_path / "bad.npz")})
    with pytest.raises(UserError, match=r"data.path=.*bad.npz: need one or more non-empty arrays of equal length"):
        loader.open_split(cfg, "train")


@pytest.mark.parametrize("key, ids, message", [
    ("targets", [0, 255, 256], "targets holds the id 256, beyond model.vocab=256 (ids 0 to 255); set model.vocab=257 or auto, or fix the data"),
    ("inputs", [3, -1, 7], "inputs holds the id -1; ids count from 0 (model.vocab=256): fix the data"),
    ("inputs", [0.0, 1.5, 2.0], "inputs must hold integers (ids of model.vocab), not float64"),
])
def test_token_ids_outside_the_vocabulary_are_refused(tmp_path, key, ids, message):
    arrays = {"inputs": np.zeros((6, 32), np.int64), "targets": np.zeros((6, 32), np.int64)}
    arrays[key] = np.resize(np.array(ids), (6, 32))
    np.savez(tmp_path / "tokens.npz", **arrays)
    cfg = make_config(tmp_path, data={"source": "arrays", "path": str(tmp_path / "tokens.npz")})
    with pytest.raises(UserError) as caught:
        loader.open_split(cfg, "train", ("inputs", "targets"))
    assert str(caught.value) == f"data.path={tmp_path / 'tokens.npz'}: {message}"


@pytest.mark.parametrize("inputs, targets, key, smallest", [
    (np.full((6, 32), -300), np.full((6, 32), -300), "inputs", -300),  # all negative: the largest id + 1 is -299
    (np.zeros((6, 32), np.int64), np.resize(np.arange(-100, 50), (6, 32)), "targets", -100),  # an ignore id
])
def test_negative_token_ids_under_vocab_auto_are_named(tmp_path, inputs, targets, key, smallest):
    np.savez(tmp_path / "tokens.npz", inputs=inputs, targets=targets)
    cfg = make_config(tmp_path, data={"source": "arrays", "path": str(tmp_path / "tokens.npz")},
                      model={"vocab": "auto"})
    with pytest.raises(UserError) as caught:
        loader.resolve_model(cfg)
    assert str(caught.value) == (
        f"model.vocab=auto: data.path={tmp_path / 'tokens.npz'}: {key} holds negative token ids (the smallest is "
        f"{smallest}); ids count from 0, and there is no ignore id such as -100: save the arrays with ids 0 to "
        f"vocab - 1")


def test_labels_outside_the_classes_are_refused(tmp_path):
    np.savez(tmp_path / "digits.npz", images=np.zeros((8, 4, 4, 1), np.float32), labels=np.arange(8) % 5)
    cfg = make_classifier_config(tmp_path, {"name": "mlp", "classes": 4, "image_shape": [4, 4, 1]},
                                 data={"source": "arrays", "path": str(tmp_path / "digits.npz")})
    with pytest.raises(UserError, match=r"labels holds the id 4, beyond model.classes=4 \(ids 0 to 3\)"):
        loader.open_split(cfg, "train", ("images", "labels"))


class Unreadable:
    """`source` with example `bad` failing to read, as a corrupt record of a shard does."""

    def __init__(self, source, bad: int):
        self.source, self.bad = source, bad

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):
        if index == self.bad:
            raise UserError(f"example {index} is unreadable")
        return self.source[index]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_read_error_surfaces_as_itself_from_read_threads_and_workers(tmp_path, dataset, workers):
    source = Unreadable(loader.open_split(data_config(tmp_path, dataset[0]), "train"), bad=5)
    batches = data_stream.train_batches(source, BatchRows(GLOBAL_BATCH, tuple(range(GLOBAL_BATCH))), 0, workers=workers)
    with pytest.raises(UserError) as caught:
        for _ in range(len(source) // GLOBAL_BATCH + 1):  # one epoch reads every example
            next(batches)
    assert str(caught.value) == "example 5 is unreadable"  # grain only adds notes, which the CLI leaves out


@pytest.mark.parametrize("shape, message", [
    ((6, 64), "inputs holds rows of 64 tokens, not model.seq_len=32; set model.seq_len=64"),
    ((6, 16), "inputs holds rows of 16 tokens, not model.seq_len=32; set model.seq_len=16"),
    ((6, 4, 8), "inputs has shape [N, 4, 8]; a language model reads rows of token ids, [N, model.seq_len=32]"),
])
def test_token_rows_of_another_length_than_seq_len_are_refused(tmp_path, shape, message):
    tokens = np.zeros(shape, np.int32)
    np.savez(tmp_path / "tokens.npz", inputs=tokens, targets=tokens)
    cfg = make_config(tmp_path, data={"source": "arrays", "path": str(tmp_path / "tokens.npz")})
    with pytest.raises(UserError) as caught:
        loader.open_split(cfg, "train", ("inputs", "targets"))
    assert str(caught.value) == f"data.path={tmp_path / 'tokens.npz'}: {message}"


def classifier_arrays(tmp_path, images, labels, image_shape=(4, 4, 1)):
    np.savez(tmp_path / "images.npz", images=images, labels=labels)
    return make_classifier_config(tmp_path, {"name": "mlp", "classes": 3, "image_shape": list(image_shape)},
                                  data={"source": "arrays", "path": str(tmp_path / "images.npz"), "eval_fraction": 0})


@pytest.mark.parametrize("dtype", [np.uint8, np.int64])
def test_integer_images_are_fed_as_8_bit_pixels(tmp_path, dtype):
    pixels = np.arange(6 * 16).reshape(6, 4, 4, 1) % 256
    source = loader.open_split(classifier_arrays(tmp_path, pixels.astype(dtype), np.arange(6) % 3), "train")
    for i in range(6):
        assert source[i]["images"].dtype == np.uint8
        np.testing.assert_array_equal(source[i]["images"], pixels[i])


def test_integer_images_beyond_8_bits_are_refused(tmp_path):
    cfg = classifier_arrays(tmp_path, np.full((6, 4, 4, 1), 4095, np.uint16), np.arange(6) % 3)
    with pytest.raises(UserError) as caught:
        loader.open_split(cfg, "train")
    assert str(caught.value) == (
        f"data.path={tmp_path / 'images.npz'}: images holds integers from 4095 to 4095; integer images are read as "
        f"8-bit pixels (0 to 255, divided by 255): save them as uint8, or as float32 in [0, 1]")


@pytest.mark.parametrize("images, labels, message", [
    (np.zeros((6, 4, 4, 1)), np.zeros((6, 1), np.int64),
     "labels has shape [N, 1]; a classifier reads one class id per example, [N]: save labels.reshape(-1)"),
    (np.zeros((6, 4, 4, 1)), np.zeros((6, 3), np.int64),
     "labels has shape [N, 3]; a classifier reads one class id per example, [N]"),
    (np.zeros((6, 1, 4, 4)), np.zeros(6, np.int64),
     "images has shape [N, 1, 4, 4], not [N, *model.image_shape] = [N, 4, 4, 1]; they look channels-first "
     "(N, C, H, W): save images.transpose(0, 2, 3, 1)"),
    (np.zeros((6, 8, 8, 1)), np.zeros(6, np.int64),
     "images has shape [N, 8, 8, 1], not [N, *model.image_shape] = [N, 4, 4, 1]; set model.image_shape=[8, 8, 1] "
     "or auto"),
    (np.zeros((6, 16)), np.zeros(6, np.int64),
     "images has shape [N, 16], not [N, *model.image_shape] = [N, 4, 4, 1]; save them as [N, height, width, "
     "channels]"),
], ids=["column_labels", "one_hot_labels", "channels_first", "other_size", "flat"])
def test_classifier_arrays_of_other_shapes_are_refused(tmp_path, images, labels, message):
    with pytest.raises(UserError) as caught:
        loader.open_split(classifier_arrays(tmp_path, images, labels), "train", ("images", "labels"))
    assert str(caught.value) == f"data.path={tmp_path / 'images.npz'}: {message}"


def test_channels_first_images_are_named_when_the_image_shape_is_taken_from_them(tmp_path, capsys):
    np.savez(tmp_path / "chw.npz", images=np.zeros((6, 3, 16, 16), np.float32), labels=np.arange(6) % 3)
    cfg = make_classifier_config(tmp_path, {"name": "mlp"}, data={"source": "arrays", "path": str(tmp_path / "chw.npz")})
    assert loader.data_images(cfg).image_shape == (3, 16, 16)
    assert capsys.readouterr().err == (
        f"jaxdist: warning: data.path={tmp_path / 'chw.npz'}: images [N, 3, 16, 16] are read as [N, height, width, "
        f"channels], 16 channels; if they are channels-first (N, C, H, W), save images.transpose(0, 2, 3, 1)\n")
    np.savez(tmp_path / "hwc.npz", images=np.zeros((6, 3, 16, 4), np.float32), labels=np.arange(6) % 3)
    loader.data_images(make_classifier_config(tmp_path, {"name": "mlp"}, data={"source": "arrays", "path": str(tmp_path / "hwc.npz")}))
    assert capsys.readouterr().err == ""


def test_arrays_the_model_does_not_read_are_left_out_and_named(tmp_path, capsys):
    rows = 6
    np.savez(tmp_path / "extra.npz", images=np.zeros((rows, 4, 4, 1), np.float32), labels=np.arange(rows) % 3,
             names=np.array([f"img{i}.png" for i in range(rows)]), weights=np.zeros(rows, np.float32),
             notes=np.array([{"any": "object"}] * rows, dtype=object))  # readable only with pickle
    cfg = make_classifier_config(tmp_path, {"name": "mlp", "classes": 3, "image_shape": [4, 4, 1]},
                                 data={"source": "arrays", "path": str(tmp_path / "extra.npz"), "eval_fraction": 0.5})
    train, held_out = (loader.open_split(cfg, split, ("images", "labels")) for split in ("train", "eval"))
    assert set(train[0]) == set(held_out[0]) == {"images", "labels"}
    assert capsys.readouterr().err == (  # once, for the train split
        f"jaxdist: warning: data.path={tmp_path / 'extra.npz'}: the array(s) names, weights, notes are not fed to "
        f"the model (model.name=mlp reads images, labels)\n")


def sentencepiece_manifest(tmp_path, model_bytes: bytes | None):
    """Prepared shards whose manifest names a SentencePiece tokenizer file holding `model_bytes`
    (None: no file)."""
    path, manifest = prepared(tmp_path, random_documents(4), eval_fraction=0.0)
    manifest["tokenizer"] = {"name": "sentencepiece", "vocab_size": 256, "separator": 0, "file": "tokenizer.model"}
    (path / "manifest.json").write_text(json.dumps(manifest))
    if model_bytes is not None:
        (path / "tokenizer.model").write_bytes(model_bytes)
    return path


def test_a_corrupt_tokenizer_file_is_one_line(tmp_path):
    path = sentencepiece_manifest(tmp_path, b"garbage\n")
    with pytest.raises(UserError) as caught:
        loader.tokenizer(data_config(tmp_path, path))
    assert str(caught.value) == (f"data.path={path}: tokenizer file tokenizer.model is corrupt (it does not load as a "
                                 f"sentencepiece tokenizer); prepare the data again")


def test_the_sample_tokenizer_is_read_before_compiling(tmp_path, compiles):
    from jaxdist import loop

    cfg = data_config(tmp_path / "run", sentencepiece_manifest(tmp_path, None), sample={"tokens": 8}, eval={"every": 0})
    with pytest.raises(UserError, match=r"tokenizer file tokenizer.model is missing; prepare the data again"):
        loop.train(cfg)
    assert compiles.count == 0 and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("eval_fraction", [0.01, 0.05, 0.3])
def test_appending_rows_moves_no_row_between_the_arrays_splits(tmp_path, eval_fraction):
    rows = np.arange(2200, dtype=np.int32)[:, None]
    splits = []
    for count in (1000, 1100, 2200):  # the same rows, then 10% appended, then doubled
        np.savez(tmp_path / f"{count}.npz", x=rows[:count])
        splits.append({split: set(loader._array_split(tmp_path / f"{count}.npz", split, eval_fraction)["x"][:, 0])
                       for split in ("train", "eval")})
        assert abs(len(splits[-1]["eval"]) - count * eval_fraction) <= 3  # the share held out is accurate
        assert splits[-1]["train"] | splits[-1]["eval"] == set(range(count))
    for before, after in zip(splits, splits[1:]):
        assert before["eval"] <= after["eval"] and before["train"] <= after["train"]


def test_processes_whose_data_differ_are_told_apart(tmp_path):
    """Each process's (examples, checksum of a few of them) per split, compared across processes:
    another length or other contents name the split and the processes."""
    rows = np.arange(1100 * 4, dtype=np.int32).reshape(1100, 4)
    fingerprints = {}
    for name, data in {"old": rows[:1000], "new": rows, "same": rows.copy(), "edited": rows + (rows == 4399)}.items():
        fingerprints[name] = loader.fingerprint(sources.ArraySource({"x": data}))
    assert fingerprints["new"] == fingerprints["same"] and fingerprints["old"][0] == 1000
    assert fingerprints["edited"][0] == 1100 and fingerprints["edited"][1] != fingerprints["new"][1]  # the last row
    table = lambda *names: np.array([[*fingerprints[n], 7, 9] for n in names])  # noqa: E731 (eval split: alike)
    names = ["the train split", "the eval split"]
    assert feed.disagreeing_sources(table("new", "same", "new"), names) is None
    assert feed.disagreeing_sources(table("old", "new", "new"), names) == (
        "the train split holds 1000 examples on processes 0, 1100 examples on processes 1,2")
    assert feed.disagreeing_sources(table("new", "edited", "new"), names) == (
        "the train split holds 1100 examples on every process, but they differ between processes 0,2 vs processes 1")
    eval_differs = np.array([[*fingerprints["new"], 7, 9], [*fingerprints["new"], 7, 8]])
    assert feed.disagreeing_sources(eval_differs, names) == (
        "the eval split holds 7 examples on every process, but they differ between processes 0 vs processes 1")


@pytest.fixture(scope="module")
def no_eval_split(tmp_path_factory):
    """Byte-token shards of 6 short documents, none held out."""
    return prepared(tmp_path_factory.mktemp("no_eval"), random_documents(6), eval_fraction=0.0)[0]


def _tampered(manifest: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        manifest = manifest[key]
    manifest[last] = value


@pytest.mark.parametrize("dotted, value, expected", [
    ("dtype", "float64", "dtype='float64': Input should be 'uint8', 'uint16' or 'uint32'"),
    ("dtype", 5, "dtype=5: Input should be 'uint8', 'uint16' or 'uint32'"),
    ("chunk_tokens", "64", "chunk_tokens='64': Input should be a valid integer"),
    ("chunk_tokens", 0, "chunk_tokens=0: Input should be greater than 0"),
    ("tokenizer.vocab_size", "256", "tokenizer.vocab_size='256': Input should be a valid integer"),
    ("splits.train.records", ["1"], "splits.train.records.0='1': Input should be a valid integer"),
    ("splits.train.files", ["../../elsewhere.array_record"],
     "splits.train.files.0='../../elsewhere.array_record': a shard is a file name in the folder, not a path"),
    ("splits.train.records", [], "splits.train: lists 1 file(s) but 0 record count(s)"),
], ids=["dtype-name", "dtype-number", "chunk-string", "chunk-zero", "vocab-string", "records-strings", "file-outside",
        "records-missing"])
def test_a_tampered_manifest_is_one_line_naming_the_value(tmp_path, no_eval_split, capsys, compiles, dotted, value,
                                                          expected):
    path = tmp_path / "edited"
    shutil.copytree(no_eval_split, path)
    manifest = json.loads((path / "manifest.json").read_text())
    _tampered(manifest, dotted, value)
    (path / "manifest.json").write_text(json.dumps(manifest))
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps(make_config(tmp_path / "run", data={"source": "arrayrecord", "path": str(path)},
                                             model={"seq_len": 16, "vocab": "auto"}).model_dump(mode="json")))
    assert cli.main(["train", str(config)]) == 2
    assert capsys.readouterr().err == (f"jaxdist: error: data.path={path}: manifest.json: {expected}; prepare the data "
                                       f"again\n")
    assert compiles.count == 0


@pytest.mark.parametrize("case", ["manifest_key", "arrays_on_prepared", "images_on_npz", "arrays_on_text",
                                  "arrays_on_empty_file", "arrayrecord_on_text", "empty_prepared_eval"])
def test_misdirected_or_incomplete_data_says_what_to_do(tmp_path, no_eval_split, case):
    source, path, split = {
        "manifest_key": ("arrayrecord", tmp_path / "edited", "train"),
        "arrays_on_prepared": ("arrays", no_eval_split, "train"),
        "images_on_npz": ("images", tmp_path / "x.npz", "train"),
        "arrays_on_text": ("arrays", tmp_path / "d.txt", "train"),
        "arrays_on_empty_file": ("arrays", tmp_path / "empty.npz", "train"),
        "arrayrecord_on_text": ("arrayrecord", tmp_path / "d.txt", "train"),
        "empty_prepared_eval": ("arrayrecord", no_eval_split, "eval"),
    }[case]
    if case == "manifest_key":
        shutil.copytree(no_eval_split, path)
        manifest = json.loads((path / "manifest.json").read_text())
        del manifest["chunk_tokens"]
        (path / "manifest.json").write_text(json.dumps(manifest))
    np.savez(tmp_path / "x.npz", images=np.zeros((4, 8, 8, 1), np.float32), labels=np.arange(4) % 2)
    (tmp_path / "d.txt").write_text("some text\n")
    (tmp_path / "empty.npz").write_bytes(b"")
    expected = {
        "manifest_key": f"data.path={path}: manifest.json lacks the key chunk_tokens; prepare the data again",
        "arrays_on_prepared": f"data.path={path} is a directory written by `jaxdist data prepare`, which "
                              f"data.source=arrayrecord reads; set data.source=arrayrecord",
        "images_on_npz": f"data.path={path} is an .npz file, which data.source=arrays reads; set data.source=arrays",
        "arrays_on_text": f"data.path={path} is not an .npz file; data.source=arrays reads arrays saved by numpy.savez "
                          f"(for text, run `jaxdist data prepare` and set data.source=arrayrecord)",
        "arrayrecord_on_text": f"data.path={path} is a file, not a prepared directory; run `jaxdist data prepare "
                               f"{path} --out DIR` and set data.path=DIR",
        "empty_prepared_eval": f"the eval split of data.path={path} is empty; prepare the data again with "
                               f"`jaxdist data prepare --eval-fraction` above 0, or set eval.every=0",
    }
    expected["arrays_on_empty_file"] = expected["arrays_on_text"].replace(str(tmp_path / "d.txt"), str(path))
    with pytest.raises(UserError) as caught:
        loader.open_split(make_config(tmp_path, data={"source": source, "path": str(path)}, model={"seq_len": 16}), split)
    assert str(caught.value) == expected[case]
