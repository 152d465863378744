"""`jaxdist data prepare FOLDER`: class folders of PNG/JPEG files -> labeled-image shards, read back
by `data.source=images`; bad input is one line and exit code 2."""

import io
import json
import shutil
import sys
import zlib
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import make_config
from data_helpers import prepared, random_documents
from PIL import Image

from jaxdist import cli
from jaxdist.data import images, loader, sources
from jaxdist.errors import UserError
from jaxdist.parallel.feed import BatchRows

SIZE = 16
CLASS_SIZES = {"green": 80, "red": 100, "stripes": 60}
# Files other than 16 x 16 PNGs: JPEGs (one with an upper-case suffix), and 24 x 16 PNGs that are center-cropped.
JPEGS = {("red", 0): "r000.jpg", ("red", 1): "r001.jpg", ("green", 0): "g000.JPEG"}
WIDE = {("stripes", 0): "s000.png", ("stripes", 1): "nested/s001.png"}


def _pixels(name: str, rng: np.random.Generator, width: int) -> np.ndarray:
    """A class's look: a noisy red or green image, or gray horizontal stripes with noise."""
    noise = rng.integers(0, 60, (SIZE, width, 3))
    if name == "stripes":
        return (np.arange(SIZE)[:, None, None] % 4 < 2) * 180 + noise
    base = np.zeros(3, int)
    base["rg".index(name[0])] = 190
    return base + noise


def write_image_folder(folder, class_sizes=CLASS_SIZES) -> dict[tuple[str, str], np.ndarray]:
    """Class folders of images; returns (class, path in the class folder) -> the pixels Pillow decodes
    from that file, center-cropped to 16 x 16 (what `data prepare --image-size 16` must store)."""
    rng = np.random.default_rng(0)
    expected = {}
    for name, count in class_sizes.items():
        for index in range(count):
            file = {**JPEGS, **WIDE}.get((name, index), f"{name[0]}{index:03d}.png")
            path = folder / name / file
            path.parent.mkdir(parents=True, exist_ok=True)
            width = 24 if (name, index) in WIDE else SIZE
            Image.fromarray(_pixels(name, rng, width).astype(np.uint8)).save(path)
            decoded = np.asarray(Image.open(path).convert("RGB"))
            expected[name, file] = decoded[:, (width - SIZE) // 2 : (width + SIZE) // 2]
    (folder / "red" / ".DS_Store").write_bytes(b"\0junk")  # hidden files are skipped
    return expected


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(image folder, prepared directory, manifest, expected pixels): 240 images, 20% held out."""
    root = tmp_path_factory.mktemp("images")
    expected = write_image_folder(root / "photos")
    out = root / "prepared"
    assert cli.main(["data", "prepare", str(root / "photos"), "--out", str(out), "--image-size", str(SIZE),
                     "--eval-fraction", "0.2", "--records-per-shard", "64"]) == 0
    return root / "photos", out, json.loads((out / sources.MANIFEST).read_text()), expected


def images_config(tmp_path, path, **data):
    return make_config(tmp_path, data={"source": "images", "path": str(path), **data}, train={"global_batch": 8},
                       eval={"batches": None})  # the whole eval split


def test_manifest_counts_classes_and_a_stratified_split(folder):
    _, out, manifest, _ = folder
    assert manifest["format"] == "jaxdist-labeled-images/1"
    assert manifest["classes"] == {"green": 0, "red": 1, "stripes": 2}
    assert manifest["image_shape"] == [16, 16, 3]
    assert manifest["files_per_class"] == {"green": 80, "red": 100, "stripes": 60}
    train, held_out = manifest["splits"]["train"], manifest["splits"]["eval"]
    assert held_out["per_class"] == {"green": 16, "red": 20, "stripes": 12} and held_out["examples"] == 48
    assert train["per_class"] == {"green": 64, "red": 80, "stripes": 48} and train["examples"] == 192
    assert train["records"] == [64, 64, 64] and held_out["records"] == [48]
    assert train["files"] == ["train-00000.array_record", "train-00001.array_record", "train-00002.array_record"]
    assert not out.with_name("prepared.partial").exists()


def test_every_file_is_read_back_once_with_its_label_and_pixels(folder):
    _, out, manifest, expected = folder
    by_pixels = {pixels.tobytes(): key for key, pixels in expected.items()}
    assert len(by_pixels) == 240  # every image unique
    seen = {}
    for split in ("train", "eval"):
        split_images = sources.ArrayRecordImages(out, manifest, split)
        for index in range(len(split_images)):
            example = split_images[index]
            assert example["images"].dtype == np.uint8 and example["images"].shape == (16, 16, 3)
            assert example["labels"].dtype == np.int32 and example["labels"].shape == ()
            name, file = by_pixels[example["images"].tobytes()]
            assert int(example["labels"]) == manifest["classes"][name]
            seen[name, file] = split
    assert sorted(seen) == sorted(expected)  # each file once: 240 records, 240 distinct files
    for name, count in CLASS_SIZES.items():  # eval: the round(20%) files with the smallest CRC-32 of each class
        files = sorted((file for c, file in expected if c == name), key=lambda file: (zlib.crc32(file.encode()), file))
        assert {file for (c, file), split in seen.items() if c == name and split == "eval"} == set(files[: round(count * 0.2)])


def test_the_split_survives_moving_the_folder(folder, tmp_path):
    photos, _, manifest, _ = folder
    shutil.copytree(photos, tmp_path / "elsewhere" / "photos")
    moved = images.prepare(tmp_path / "elsewhere" / "photos", str(tmp_path / "out"), image_size=SIZE,
                           eval_fraction=0.2, records_per_shard=64)
    assert moved["splits"] == manifest["splits"]
    for split in ("train", "eval"):
        a = sources.ArrayRecordImages(folder[1], manifest, split)
        b = sources.ArrayRecordImages(tmp_path / "out", moved, split)
        for index in (0, 17, len(a) - 1):
            np.testing.assert_array_equal(a[index]["images"], b[index]["images"])


def test_grayscale_and_resizing_to_a_smaller_square(tmp_path):
    colours = {"dark": (40, 40, 40), "light": (200, 120, 10)}
    for name, colour in colours.items():
        (tmp_path / "in" / name).mkdir(parents=True)
        for index in range(3):
            Image.new("RGB", (40, 32), colour).save(tmp_path / "in" / name / f"{index}.png")
    manifest = images.prepare(tmp_path / "in", str(tmp_path / "out"), image_size=8, grayscale=True, eval_fraction=0)
    assert manifest["image_shape"] == [8, 8, 1] and manifest["splits"]["eval"]["examples"] == 0
    split = sources.ArrayRecordImages(tmp_path / "out", manifest, "train")
    gray = {name: Image.new("RGB", (1, 1), colour).convert("L").getpixel((0, 0)) for name, colour in colours.items()}
    assert gray == {"dark": 40, "light": 131}  # ITU-R 601-2 luma: 0.299 R + 0.587 G + 0.114 B
    for index, name in enumerate(["dark"] * 3 + ["light"] * 3):
        np.testing.assert_array_equal(split[index]["images"], np.full((8, 8, 1), gray[name]))
        assert split[index]["labels"] == (name == "light")


@pytest.mark.parametrize("grayscale", [False, True])
def test_16_bit_pngs_are_scaled_to_8_bits(tmp_path, grayscale):
    """Pillow opens a 16-bit grayscale PNG as mode I;16, which its `convert` to L or RGB clips at 255:
    a dark and a bright class would both be white."""
    for name, value in (("bright", 50000), ("dark", 10000)):
        (tmp_path / "in" / name).mkdir(parents=True)
        for index in range(2):
            Image.fromarray(np.full((6, 10), value, np.uint16)).save(tmp_path / "in" / name / f"{index}.png")
    assert Image.open(tmp_path / "in" / "dark" / "0.png").mode == "I;16"
    manifest = images.prepare(tmp_path / "in", str(tmp_path / "out"), image_size=4, grayscale=grayscale,
                              eval_fraction=0)
    split = sources.ArrayRecordImages(tmp_path / "out", manifest, "train")
    channels = 1 if grayscale else 3
    for index, value in enumerate([195, 195, 39, 39]):  # round(50000 / 257), round(10000 / 257)
        np.testing.assert_array_equal(split[index]["images"], np.full((4, 4, channels), value))


def test_32_bit_and_float_pixels_are_scaled_or_refused(tmp_path):
    # Older Pillow opens 16-bit PNGs as mode I (32-bit integers), as this Pillow opens a 16-bit PGM.
    Image.fromarray(np.arange(0, 65536, 4096, np.uint16).reshape(4, 4)).save(tmp_path / "gray.pgm")
    assert Image.open(tmp_path / "gray.pgm").mode == "I"
    pixels = images.load_image(tmp_path / "gray.pgm", 4, grayscale=True)
    np.testing.assert_array_equal(pixels[..., 0], np.rint(np.arange(0, 65536, 4096).reshape(4, 4) / 257))
    Image.fromarray(np.full((4, 4), 70000, np.int32)).save(tmp_path / "wide.tiff")
    with pytest.raises(UserError, match=r"wide.tiff holds pixel values outside 0 to 65535 \(16 bits\); save it as "
                                        r"an 8- or 16-bit PNG"):
        images.load_image(tmp_path / "wide.tiff", 4, grayscale=True)
    Image.fromarray(np.full((4, 4), 0.5, np.float32)).save(tmp_path / "float.tiff")
    with pytest.raises(UserError, match=r"float.tiff holds floating-point pixels, which have no fixed range; save it "
                                        r"as an 8- or 16-bit PNG"):
        images.load_image(tmp_path / "float.tiff", 4, grayscale=False)


def test_data_images_gives_the_classes_and_the_image_shape(folder, tmp_path):
    spec = loader.data_images(images_config(tmp_path, folder[1]))
    assert spec == loader.ImageData(3, (16, 16, 3), ("green", "red", "stripes"))
    np.savez(tmp_path / "mine.npz", images=np.zeros((10, 8, 6, 1), np.float32), labels=np.arange(10) % 4)
    cfg = make_config(tmp_path, data={"source": "arrays", "path": str(tmp_path / "mine.npz")})
    assert loader.data_images(cfg) == loader.ImageData(4, (8, 6, 1), ("0", "1", "2", "3"))
    with pytest.raises(UserError, match="data.source=stdlib holds no labeled images"):
        loader.data_images(make_config(tmp_path))
    for name, arrays in [("flat", {"images": np.zeros((10, 48)), "labels": np.arange(10)}),
                         ("unlabeled", {"images": np.zeros((10, 8, 6, 1))}),
                         ("float_labels", {"images": np.zeros((10, 8, 6, 1)), "labels": np.zeros(10)}),
                         ("no_images", {"labels": np.arange(10)})]:
        np.savez(tmp_path / f"{name}.npz", **arrays)
        bad = make_config(tmp_path, data={"source": "arrays", "path": str(tmp_path / f"{name}.npz")})
        with pytest.raises(UserError, match=r"needs an images array \[N, H, W, C\] and an integer labels array"):
            loader.data_images(bad)


def test_the_images_source_feeds_augmented_train_and_plain_eval_batches(folder, tmp_path):
    _, out, manifest, _ = folder
    cfg = images_config(tmp_path, out, augment={"crop_padding": 2, "flip": True})
    train, held_out = loader.open_split(cfg, "train", ("images", "labels")), loader.open_split(cfg, "eval")
    assert (len(train), len(held_out)) == (192, 48)
    rows = BatchRows(8, tuple(range(8)))
    running = loader.train_iterator(cfg, rows, source=train)
    batches = list(islice(running, 30))  # 240 examples: over an epoch boundary
    resumed = list(islice(loader.train_iterator(cfg, rows, start_example=20 * 8), 10))
    for a, b in zip(batches[20:], resumed, strict=True):
        np.testing.assert_array_equal(a["images"], b["images"])
        np.testing.assert_array_equal(a["labels"], b["labels"])
    assert batches[0]["images"].shape == (8, 16, 16, 3) and batches[0]["labels"].dtype == np.int32
    plain = {train[i]["images"].tobytes() for i in range(len(train))}
    changed = sum(image.tobytes() not in plain for batch in batches for image in batch["images"])
    assert changed > 0.8 * 240  # 1 in 50 draws is the identity (no shift, no flip)
    eval_batches = list(loader.eval_iterator(cfg, rows))
    assert len(eval_batches) == 6
    for b, batch in enumerate(eval_batches):
        np.testing.assert_array_equal(batch["images"], np.stack([held_out[b * 8 + r]["images"] for r in range(8)]))
        np.testing.assert_array_equal(batch["weights"], np.ones(8, np.float32))


def test_a_limited_eval_pass_samples_every_class(folder, tmp_path):
    """Records are stored class by class: eval.batches=1 reads a fixed shuffled order, not the first
    class only; the whole pass still reads every eval image once, in stored order."""
    _, out, _, _ = folder
    rows = BatchRows(8, tuple(range(8)))
    held_out = loader.open_split(images_config(tmp_path, out), "eval")
    stored = [int(held_out[i]["labels"]) for i in range(len(held_out))]
    assert stored == sorted(stored) and set(stored) == {0, 1, 2}
    limited = make_config(tmp_path, data={"source": "images", "path": str(out)}, train={"global_batch": 8},
                          eval={"every": 1, "batches": 1})
    (batch,) = loader.eval_iterator(limited, rows)
    assert len(set(batch["labels"].tolist())) > 1 and batch["weights"].sum() == 8
    whole = list(loader.eval_iterator(images_config(tmp_path, out), rows))
    assert [int(label) for b in whole for label in b["labels"]] == stored


def test_a_source_and_a_directory_of_another_kind_are_one_line(folder, tmp_path):
    out = folder[1]
    with pytest.raises(UserError, match=r"yields images and labels, but model.name=gpt reads inputs, targets"):
        loader.open_split(images_config(tmp_path, out), "train", ("inputs", "targets"))
    with pytest.raises(UserError, match=r"holds jaxdist-labeled-images/1 data, .*; set data.source=images"):
        loader.open_split(make_config(tmp_path, data={"source": "arrayrecord", "path": str(out)}), "train")
    tokens, _ = prepared(tmp_path / "tokens", random_documents(5), eval_fraction=0.0)
    with pytest.raises(UserError, match=r"holds jaxdist-packed-tokens/1 data, .*; set data.source=arrayrecord"):
        loader.open_split(images_config(tmp_path, tokens), "train")
    cfg = make_config(tmp_path, data={"source": "stdlib", "augment": {"flip": True}})
    with pytest.raises(UserError, match=r"data.augment changes images, but data.source=stdlib yields inputs, targets"):
        loader.train_iterator(cfg, BatchRows(8, tuple(range(8))))


@pytest.mark.parametrize("model, message", [
    ({"classes": 2, "image_shape": [16, 16, 3]},
     "holds 3 classes (green, red, stripes), more than model.classes=2; set model.classes=3 or auto"),
    ({"classes": 3, "image_shape": [32, 32, 3]},
     "holds images of shape [16, 16, 3], not model.image_shape=[32, 32, 3]; set model.image_shape=[16, 16, 3] or "
     "auto, or prepare the folder again"),
], ids=["classes", "image_shape"])
def test_model_sizes_the_prepared_images_do_not_fit_are_one_line(folder, tmp_path, model, message):
    out = folder[1]
    cfg = make_config(tmp_path, {}, model={"name": "mlp", **model}, data={"source": "images", "path": str(out)})
    with pytest.raises(UserError) as caught:
        loader.open_split(cfg, "train", ("images", "labels"))
    assert str(caught.value) == f"data.path={out} {message}"
    more = make_config(tmp_path, {}, model={"name": "mlp", "classes": 5, "image_shape": [16, 16, 3]},
                       data={"source": "images", "path": str(out)})
    assert len(loader.open_split(more, "train", ("images", "labels"))) == 192  # unused classes are allowed


def test_an_empty_eval_split_is_one_line(tmp_path):
    for name in ("a", "b"):
        (tmp_path / "in" / name).mkdir(parents=True)
        Image.new("RGB", (4, 4), name == "a").save(tmp_path / "in" / name / "0.png")
    images.prepare(tmp_path / "in", str(tmp_path / "out"), image_size=4, eval_fraction=0)
    with pytest.raises(UserError, match=r"the eval split of data.path=.* is empty; .* or set eval.every=0"):
        loader.open_split(images_config(tmp_path, tmp_path / "out"), "eval")


def _bad_folder(tmp_path, case):
    """An image folder under tmp_path/in with one mistake; returns the CLI's inputs."""
    root = tmp_path / "in"
    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        for index in range(3):
            Image.new("RGB", (6, 6), (index, 0, 0)).save(root / name / f"{index}.png")
    if case == "empty folder":
        shutil.rmtree(root)
        root.mkdir()
    elif case == "class without images":
        (root / "emu").mkdir()
        (root / "emu" / ".hidden.png").write_bytes(b"")
    elif case == "undecodable image":
        (root / "dog" / "broken.jpg").write_bytes(b"a text file named like a JPEG")
    elif case == "truncated image":
        buffer = io.BytesIO()
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)).save(buffer, "PNG")
        (root / "cat" / "1.png").write_bytes(buffer.getvalue()[:2000])
    elif case == "text in a class folder":
        (root / "cat" / "notes.txt").write_text("whiskers")
    elif case == "file beside the class folders":
        (root / "labels.csv").write_text("cat,dog")
    elif case == "loose images":
        shutil.rmtree(root / "dog")
        for path in (root / "cat").iterdir():
            path.rename(root / path.name)
        (root / "cat").rmdir()
    elif case == "images among text inputs":
        (tmp_path / "doc.txt").write_text("some text")
        return [str(tmp_path / "doc.txt"), str(root)]
    elif case == "too few images to split":
        for index in (1, 2):
            (root / "dog" / f"{index}.png").unlink()
    return [str(root)]


@pytest.mark.parametrize(
    "case, options, expected",
    [
        ("empty folder", [], "directory {root} holds no non-empty files; pass one with text files, or with a "
                             "subfolder of images per class"),
        ("class without images", [], "class folder {root}/emu holds no images"),
        ("undecodable image", [], "{root}/dog/broken.jpg is not a readable image (no format Pillow knows)"),
        ("truncated image", [], "{root}/cat/1.png is not a readable image (image file is truncated)"),
        ("text in a class folder", [], "{root}/cat/notes.txt is not a PNG or JPEG file"),
        ("file beside the class folders", [], "{root}/labels.csv lies beside the class folders of {root}"),
        ("loose images", [], "{root} holds images but no class folders"),
        ("images among text inputs", [], "{root}/cat/0.png is an image among other inputs"),
        ("too few images to split", ["--eval-fraction", "0.2"],
         "class folder {root}/dog holds 1 image(s), too few to keep some for both train and eval"),
        ("text option for images", ["--tokenizer", "sentencepiece"], "--tokenizer does not apply to an image folder"),
    ],
)
def test_bad_image_folder_is_one_line_and_exit_2(tmp_path, capfd, case, options, expected):
    inputs = _bad_folder(tmp_path, case)
    code = cli.main(["data", "prepare", *inputs, "--out", str(tmp_path / "out"), *options])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("jaxdist: error: data prepare: "), err
    assert expected.format(root=tmp_path / "in") in err[0], err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_a_text_corpus_with_an_image_is_text(tmp_path, capfd):
    """Inputs are an image folder when most of their files are images: a logo among a repository's
    docs leaves it text, and the text path skips the logo with a warning that counts it."""
    repo = tmp_path / "repo"
    for folder, name, text in (("docs", "page{}.md", "documentation {}"), ("src", "m{}.py", "def f{0}(): return {0}")):
        (repo / folder).mkdir(parents=True)
        for index in range(3):
            (repo / folder / name.format(index)).write_text(text.format(index))
    (repo / "docs" / "img").mkdir()
    Image.new("RGB", (4, 4)).save(repo / "docs" / "img" / "logo.png")
    assert images.image_folder([str(repo)]) is None
    assert images.image_folder([str(repo / "docs"), str(repo / "src")]) is None
    code = cli.main(["data", "prepare", str(repo), "--out", str(tmp_path / "out"), "--eval-fraction", "0"])
    out, err = capfd.readouterr()
    assert code == 0 and err.splitlines() == [
        f"jaxdist: warning: data prepare: skipped 1 image file(s) in {repo} (the first: docs/img/logo.png); "
        f"the text files beside them are prepared"]
    assert "train 6 documents" in out
    root = Path(_bad_folder(tmp_path, "text in a class folder")[0])  # 6 images and a stray notes.txt
    assert images.image_folder([str(root)]) == root


def test_an_image_option_for_text_is_one_line_and_exit_2(tmp_path, capfd):
    (tmp_path / "doc.txt").write_text("some text")
    code = cli.main(["data", "prepare", str(tmp_path / "doc.txt"), "--out", str(tmp_path / "out"), "--grayscale"])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["jaxdist: error: data prepare: --grayscale does not apply to text inputs; drop it"]


def test_without_pillow_an_image_folder_names_the_extra(tmp_path, capfd, monkeypatch):
    _bad_folder(tmp_path, "no mistake")
    for name in [name for name in sys.modules if name == "PIL" or name.startswith("PIL.")]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules makes `import` fail
    code = cli.main(["data", "prepare", str(tmp_path / "in"), "--out", str(tmp_path / "out")])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["jaxdist: error: data prepare: an image folder needs PIL; pip install 'jaxdist[images]'"]


def test_a_prepared_image_folder_trains_a_classifier(folder, tmp_path):
    """The prepared folder (3 classes, 192 train and 48 eval images) trains an MLP, its classes and
    image shape taken from the manifest, with augmented train images: the eval split is then
    classified almost perfectly, and every eval image is counted once."""
    from jaxdist import loop

    _, out, manifest, _ = folder
    cfg = make_config(
        tmp_path, {},
        model={"name": "mlp", "classes": "auto", "image_shape": "auto", "hidden": [32]},
        data={"source": "images", "path": str(out), "augment": {"crop_padding": 2, "flip": True}},
        mesh={"data": 8, "fsdp": 1}, rules={"preset": "dp"},
        train={"steps": 30, "global_batch": 32},
        optim={"name": "adamw", "lr": 3e-3, "warmup_steps": 0, "schedule": "constant"},
        precision={"compute": "float32"}, log={"every": 10}, eval={"every": 30},
    )
    loop.train(cfg)
    resolved = yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]
    assert resolved["classes"] == 3 and resolved["image_shape"] == [SIZE, SIZE, 3]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    final = logged[-1]
    assert final["step"] == 30 and manifest["splits"]["eval"]["examples"] == 48
    assert final["eval_accuracy"] >= 0.95, final
    assert final["eval_accuracy"] * 48 == pytest.approx(round(final["eval_accuracy"] * 48), abs=1e-6)  # whole images
    assert final["eval_loss"] < logged[0]["loss"] / 2, (logged[0], final)
