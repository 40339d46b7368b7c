"""Image data, energy distance, sample figures and the MeanFlow command line."""

import json

import jax
import numpy as np
import pytest
from helpers import ROOT, cli

from nljax.config import ConfigError, ImagesConfig
from nljax.data import images
from nljax.measure.energy import energy_distance
from nljax.measure.figures import halves
from nljax.parallel.hostdev import gather_rows
from nljax.parallel.mesh import make_mesh, rows_sharding


def test_epochs_are_pure_in_seed_and_epoch_and_drop_the_last_partial_batch():
    s = images.EpochSampler(n=10, batch_size=3, seed=7)
    assert s.steps_per_epoch == 3  # 10 = 3 * 3 + 1: the 1 left over is dropped
    epoch0 = np.concatenate([s.indices(k) for k in range(3)])
    assert len(set(epoch0.tolist())) == 9  # no example twice within an epoch
    np.testing.assert_array_equal(epoch0, s.permutation(0)[:9])
    np.testing.assert_array_equal(s.indices(4), s.permutation(1)[3:6])  # step 4 = epoch 1, batch 1
    # a fresh sampler (another process, a resumed run) gives the same order
    np.testing.assert_array_equal(images.EpochSampler(10, 3, 7).indices(4), s.indices(4))
    assert not np.array_equal(s.permutation(0), s.permutation(1))  # reshuffled every epoch
    assert not np.array_equal(s.permutation(0), images.EpochSampler(10, 3, 8).permutation(0))
    with pytest.raises(ConfigError) as e:
        images.EpochSampler(2, 3, 0)
    assert str(e.value) == ("train.batch_size=3 is larger than the 2 training images: lower train.batch_size to at "
                            "most 2, or add images")


def test_global_batch_rows_are_split_over_devices():
    data = images.load(ImagesConfig(source="moons", toy_points=100))
    sampler = images.EpochSampler(len(data.train_x), 16, seed=3)
    mesh = make_mesh(2, 4)
    for step in (0, 6):  # 80 training points: step 6 is in epoch 1
        batch = images.global_batch(data, sampler, step, rows_sharding(mesh))
        full = images.rows(data, sampler, step, np.arange(16))
        np.testing.assert_array_equal(full["index"], step * 16 + np.arange(16))
        for key, arr in batch.items():
            assert arr.shape[0] == 16 and len(arr.addressable_shards) == 8
            for shard in arr.addressable_shards:
                assert shard.data.shape[0] == 2  # each device holds only its 2 rows
                np.testing.assert_array_equal(np.asarray(shard.data), full[key][shard.index])


def test_digits_default_and_held_out_split():
    data = images.load(ImagesConfig())
    assert data.shape == (8, 8, 1) and data.num_classes == 10
    assert len(data.train_x) + len(data.eval_x) == 1797 and len(data.eval_x) == 1797 // 5
    assert data.train_x.min() == -1.0 and data.train_x.max() == 1.0


def test_file_source(tmp_path):
    x = np.random.default_rng(0).integers(0, 256, (20, 4, 4, 3), dtype=np.uint8)
    np.savez(tmp_path / "set.npz", x=x, y=np.arange(20) % 4)
    data = images.load(ImagesConfig(source="file", path=str(tmp_path / "set.npz"), eval_fraction=0.25))
    assert data.shape == (4, 4, 3) and data.num_classes == 4 and len(data.eval_x) == 5
    np.testing.assert_allclose(data.eval_x[0], x[3] / 127.5 - 1, atol=1e-6)
    np.save(tmp_path / "gray.npy", x[..., 0])
    data = images.load(ImagesConfig(source="file", path=str(tmp_path / "gray.npy")))
    assert data.shape == (4, 4, 1) and data.num_classes == 0
    np.savez(tmp_path / "bad.npz", pixels=x)
    with pytest.raises(ConfigError, match=r"expected an array named 'x' or 'images'"):
        images.load(ImagesConfig(source="file", path=str(tmp_path / "bad.npz")))
    with pytest.raises(ConfigError, match="images.path not found"):
        images.load(ImagesConfig(source="file", path=str(tmp_path / "missing.npy")))


def test_a_picture_or_another_file_for_images_path_is_named(tmp_path):
    """A PNG or a text file "contains pickled (object) data ... allow_pickle=" (numpy's message):
    each is named for what it is."""
    (tmp_path / "cat.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(40))
    (tmp_path / "notes.txt").write_text("not pixels")
    (tmp_path / "empty.npy").write_bytes(b"")
    tail = "not a .npy or .npz file of images (or a folder of image files)"
    for name, line in [
        ("cat.png", f"images.path {tmp_path / 'cat.png'} is a PNG image, {tail}"),
        ("notes.txt", f"images.path {tmp_path / 'notes.txt'} is {tail}"),
        ("empty.npy", f"images.path {tmp_path / 'empty.npy'} is empty, {tail}"),
    ]:
        with pytest.raises(ConfigError) as e:
            images.load(ImagesConfig(source="file", path=str(tmp_path / name)))
        assert str(e.value) == line


def test_a_zip_of_images_or_an_npz_of_many_arrays_is_one_short_line(tmp_path):
    """A downloaded zip of PNGs (a zip, as an .npz is) and an .npz of an array per image were
    refused with the list of every name in them: one line of megabytes for 50,000 images."""
    import zipfile

    with zipfile.ZipFile(tmp_path / "pets.zip", "w") as z:
        for i in range(300):
            z.writestr(f"pets/cat/{i:04d}.png", b"\x89PNG")
    np.savez(tmp_path / "each.npz", **{f"img{i:03d}": np.zeros((4, 4), np.uint8) for i in range(300)})
    for name, line in [
        ("pets.zip", "is a zip archive of 300 files (e.g. pets/cat/0000.png), not an .npz of arrays: unzip it and "
                     "give the folder"),
        ("each.npz", "holds img000, img001, img002, img003, img004, img005, ..., img299; expected an array named 'x' "
                     "or 'images'"),
    ]:
        with pytest.raises(ConfigError) as e:
            images.load(ImagesConfig(source="file", path=str(tmp_path / name)))
        assert str(e.value) == f"images.path {tmp_path / name} {line}"


def test_images_that_do_not_fit_in_memory_are_named(tmp_path, monkeypatch):
    """A folder of 12000 x 12000 photos stopped with the trainer's out-of-memory line, which named
    the model, train.batch_size and train.seq_len, and exit 1."""
    np.save(tmp_path / "x.npy", np.zeros((4, 2, 2), np.uint8))
    too_big = "Unable to allocate 10.7 GiB for an array with shape (20, 12000, 12000, 1) and data type float32"
    monkeypatch.setattr(images, "_unit", lambda x: (_ for _ in ()).throw(MemoryError(too_big)))
    with pytest.raises(ConfigError) as e:
        images.load(ImagesConfig(source="file", path=str(tmp_path / "x.npy")))
    assert str(e.value) == (f"images.path {tmp_path / 'x.npy'}: the images do not fit in memory ({too_big}): the "
                            "whole set is read at start-up, 4 bytes a pixel value (nothing is resized): use smaller "
                            "or fewer images")


def test_large_photos_read_without_pillows_warning(tmp_path, monkeypatch):
    """Images over Pillow's 89M-pixel warning limit (a camera's) printed its DecompressionBombWarning,
    two lines naming Pillow's source, before the run's own lines; over twice that Pillow refuses
    them, one line naming the file. The limit lowered here to 100 pixels: 10 x 12 warns."""
    import warnings

    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    for c in ("a", "b"):
        (tmp_path / c).mkdir()
        for i in range(5):
            Image.fromarray(np.full((10, 12), 40 * i, np.uint8)).save(tmp_path / c / f"{i}.png")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        data = images.load(ImagesConfig(source="file", path=str(tmp_path)))
    assert data.shape == (10, 12, 1) and said == []
    Image.fromarray(np.zeros((10, 21), np.uint8)).save(tmp_path / "b" / "9.png")  # 210 pixels: refused
    # (another eval_fraction: images.load caches by config)
    with pytest.raises(ConfigError, match=r"b/9.png is not a readable image \(Image size \(210 pixels\) exceeds"):
        images.load(ImagesConfig(source="file", path=str(tmp_path), eval_fraction=0.25))


def test_images_of_different_sizes_are_named(tmp_path):
    """numpy saves a list of images of different sizes as an object array; reading it said
    "Object arrays cannot be loaded when allow_pickle=False", a setting nljax has no key for."""
    ragged = np.empty(2, object)
    ragged[0], ragged[1] = np.zeros((4, 4, 3), np.uint8), np.zeros((6, 6, 3), np.uint8)
    np.savez(tmp_path / "r.npz", x=ragged)
    np.save(tmp_path / "r.npy", ragged, allow_pickle=True)
    for name in ("r.npz", "r.npy"):
        with pytest.raises(ConfigError) as e:
            images.load(ImagesConfig(source="file", path=str(tmp_path / name)))
        assert str(e.value) == (f"images.path {tmp_path / name} holds an array of Python objects (images of different "
                                "sizes?): save one uint8 or float array [N, H, W(, C)], every image resized to one size")


def test_channels_first_images_are_named(tmp_path):
    """PyTorch's [N, C, H, W] read as [N, H, W, C] was refused for model.dit.patch_size (3 x 16
    images) or, for 4 channels, trained on 4-row images of 16 channels."""
    for c in (1, 3, 4):
        np.save(tmp_path / "nchw.npy", np.zeros((8, c, 16, 16), np.uint8))
        with pytest.raises(ConfigError) as e:
            images.load(ImagesConfig(source="file", path=str(tmp_path / "nchw.npy")))
        assert str(e.value) == (f"images.path {tmp_path / 'nchw.npy'}: images of shape (8, {c}, 16, 16) look "
                                "channels-first [N, C, H, W]; nljax reads [N, H, W, C]: save np.moveaxis(x, 1, -1)")
    np.save(tmp_path / "nhwc.npy", np.zeros((8, 16, 16, 3), np.uint8))
    assert images.load(ImagesConfig(source="file", path=str(tmp_path / "nhwc.npy"))).shape == (16, 16, 3)


def pngs(root, pixels, names):
    """`pixels` (uint8 [N, H, W] or [N, H, W, C]) written as PNG files `names` under `root`."""
    from PIL import Image

    for a, name in zip(pixels, names, strict=True):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(a).save(root / name)


def class_folders(root, seed: int, n: int, names: list[str], pair: tuple[str, str], renamed: list[str]) -> None:
    """Five folders under `root` of `n` random PNGs, labelled by cycling through class subfolders:
    `pair` (two of 4x4 RGB images, other pixels, the classes `names`), big (8x8 RGB), gray (4x4,
    one channel) and renamed (4x4 RGB, the classes `renamed`: as many, others)."""
    rng = np.random.default_rng(seed)
    for name, shape, classes in ((pair[0], (4, 4, 3), names), (pair[1], (4, 4, 3), names), ("big", (8, 8, 3), names),
                                 ("gray", (4, 4), names), ("renamed", (4, 4, 3), renamed)):
        pngs(root / name, rng.integers(0, 256, (n, *shape), dtype=np.uint8),
             [f"{classes[i % len(classes)]}/{i:02d}.png" for i in range(n)])


TOY = ["model.dim=16", "model.depth=1", "train.batch_size=8", "meanflow.sample_steps=2", "mesh.inter=1",
       "mesh.intra=2"]


def test_a_folder_of_pngs_trains_as_its_npz(tmp_path):
    """images.path=DIR of PNG files (flat: no labels) gives the arrays its .npz gives, the files
    in sorted order, other files ignored; meanflow_toy trains on both with the same losses."""
    from helpers import Setup, train

    from nljax import config

    x = np.random.default_rng(0).integers(0, 256, (20, 4, 4, 3), dtype=np.uint8)
    pngs(tmp_path / "pics", x, [f"img_{i:02d}.png" for i in range(20)])
    (tmp_path / "pics" / "README.txt").write_text("not a picture")
    (tmp_path / "pics" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    np.savez(tmp_path / "pics.npz", x=x)
    got = images.load(ImagesConfig(source="file", path=str(tmp_path / "pics")))
    want = images.load(ImagesConfig(source="file", path=str(tmp_path / "pics.npz")))
    assert got.shape == (4, 4, 3) and got.num_classes == 0 and len(got.train_x) == 16
    assert got.classes is None and want.classes is None  # nothing names the images: no class names
    for a, b in [(got.train_x, want.train_x), (got.eval_x, want.eval_x), (got.train_y, want.train_y)]:
        assert a.dtype == b.dtype and np.array_equal(a, b)
    np.testing.assert_array_equal(got.eval_x[0], (x[4] / 127.5 - 1).astype(np.float32))  # every 5th held out, in name order
    losses = []
    for path in ("pics", "pics.npz"):
        cfg = config.load(str(ROOT / "nljax/configs/meanflow_toy.yaml"),
                          [*TOY, "images.source=file", f"images.path={tmp_path / path}", f"run.dir={tmp_path / 'run'}"])
        setup = Setup.create(cfg, jax.devices()[:2])
        losses.append(train(setup, 3)[0])
    assert np.isfinite(losses[0]).all() and len(set(losses[0].tolist())) == 3
    np.testing.assert_array_equal(losses[0], losses[1])


def test_class_subfolders_are_the_labels(tmp_path):
    """One subfolder per class (torchvision's ImageFolder): sorted names -> 0..K-1, kept as the
    class names (torchvision's `classes`), images at any depth below their class; all grayscale:
    one channel; any colour image: RGB for all."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (7, 6, 4), dtype=np.uint8)  # grayscale 6x4 (height x width)
    names = ["dog/b.png", "dog/a.png", "cat/z.png", "cat/deep/er/a.png", "ant/1.png", "ant/0.png", "cat/.hidden/q.png"]
    pngs(tmp_path / "set", x, names)
    (tmp_path / "set" / "cat" / "._z.png").write_bytes(b"AppleDouble")  # hidden: not read
    got = images.load(ImagesConfig(source="file", path=str(tmp_path / "set"), eval_fraction=0.5))
    order = [5, 4, 3, 2, 1, 0]  # ant/0, ant/1, cat/deep/er/a, cat/z, dog/a, dog/b
    assert got.shape == (6, 4, 1) and got.num_classes == 3
    assert got.classes == ("ant", "cat", "dog")  # label k's name: the k-th subfolder
    np.testing.assert_array_equal(np.concatenate([got.train_y, got.eval_y]), [0, 1, 2, 0, 1, 2])  # every 2nd held out
    np.testing.assert_array_equal(got.train_x[..., 0], (x[order[::2]] / 127.5 - 1).astype(np.float32))
    # one RGBA image among them (neither first nor last): every image read as RGB (the gray ones
    # as three equal channels)
    from PIL import Image

    Image.fromarray(rng.integers(0, 256, (6, 4, 4), dtype=np.uint8)).save(tmp_path / "set" / "ant" / "2.png")
    images.load.cache_clear()
    got = images.load(ImagesConfig(source="file", path=str(tmp_path / "set"), eval_fraction=0.5))
    assert got.shape == (6, 4, 3) and got.num_classes == 3
    np.testing.assert_array_equal(got.train_x[0], np.repeat(x[5][..., None] / 127.5 - 1, 3, axis=-1).astype(np.float32))


def test_bad_folders_are_one_line(tmp_path, capsys):
    """Each is refused before any training with one line naming the folder and the file."""
    from PIL import Image

    rng = np.random.default_rng(2)
    d = tmp_path
    (d / "empty").mkdir()
    (d / "hidden_only").mkdir()
    (d / "hidden_only" / ".DS_Store").write_bytes(b"x")
    (d / "texts").mkdir()
    (d / "texts" / "a.txt").write_text("a")
    (d / "texts" / "b.npy").write_bytes(b"b")
    pngs(d / "corrupt", rng.integers(0, 256, (3, 4, 4), dtype=np.uint8), ["a.png", "b.png", "c.png"])
    (d / "corrupt" / "b.png").write_bytes((d / "corrupt" / "b.png").read_bytes()[:30])  # a truncated file
    pngs(d / "notpng", rng.integers(0, 256, (2, 4, 4), dtype=np.uint8), ["a.png", "b.png"])
    (d / "notpng" / "c.jpg").write_text("a text file named .jpg")
    pngs(d / "sizes", [np.zeros((4, 4), np.uint8), np.zeros((4, 4), np.uint8), np.zeros((8, 6), np.uint8)],
         ["a/0.png", "a/1.png", "b/0.png"])
    pngs(d / "loose", rng.integers(0, 256, (2, 4, 4), dtype=np.uint8), ["x.png", "cls/y.png"])
    pngs(d / "noclass", rng.integers(0, 256, (2, 4, 4), dtype=np.uint8), ["a/0.png", "a/1.png"])
    (d / "noclass" / "b").mkdir()
    (d / "noclass" / "b" / "notes.txt").write_text("no images here")
    (d / "deep").mkdir()
    Image.fromarray(np.zeros((4, 4), np.uint16)).save(d / "deep" / "a.png")
    exts = ".png, .jpg, .jpeg, .bmp, .gif, .webp, .tif, .tiff, .ppm, .pgm"
    for name, line in [
        ("empty", " is an empty folder"),
        ("hidden_only", " is an empty folder"),
        ("texts", f" holds no image files ({exts}); 2 other files, e.g. a.txt"),
        ("corrupt", ": b.png is not a readable image ("),
        ("notpng", ": c.jpg is not a readable image (cannot identify image file)"),
        ("sizes", ": b/0.png is 8x6 (height x width), a/0.png is 4x4: every image must have one size "
                  "(nljax does not resize them)"),
        ("loose", " holds image files (x.png) beside subfolders (cls/): put every image in a class subfolder, "
                  "or none in subfolders"),
        ("noclass", f": class folder b/ holds no image files (every subfolder is a class: {exts})"),
        ("deep", ": a.png has 16- or 32-bit pixels (Pillow mode I;16): a folder is read as 8-bit images; save "
                 "them as 8-bit, or as a float .npz"),
    ]:
        with pytest.raises(ConfigError) as e:
            images.load(ImagesConfig(source="file", path=str(d / name)))
        assert str(e.value).startswith(f"images.path {d / name}{line}") and "\n" not in str(e.value), (name, e.value)
    # through the command: exit 2, the line alone on stderr, before anything is built
    from nljax import train

    capsys.readouterr()
    assert train.main(["--config", "meanflow_toy", "images.source=file", f"images.path={d / 'sizes'}",
                       f"run.dir={d / 'run'}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"nljax.train: error: images.path {d / 'sizes'}: b/0.png is 8x6 (height x width), a/0.png is 4x4: every "
        "image must have one size (nljax does not resize them)"]
    # an images.path beside another source was ignored: digits trained instead
    with pytest.raises(ConfigError, match=r"^images.path is read only with images.source=file \(images.source=moons\)$"):
        ImagesConfig(source="moons", path=str(d / "sizes")).check_used()


def brute_force_energy(x, y):
    d = lambda a, b: np.linalg.norm(a - b)
    n, m = len(x), len(y)
    xy = sum(d(a, b) for a in x for b in y) / (n * m)
    xx = sum(d(x[i], x[j]) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    yy = sum(d(y[i], y[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    return 2 * xy - xx - yy


def test_energy_distance_is_the_u_statistic():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(7, 3)), rng.normal(size=(5, 3)) + 0.5
    assert energy_distance(x, y) == pytest.approx(brute_force_energy(x, y), rel=1e-10)
    assert energy_distance(x, y) == pytest.approx(energy_distance(y, x), rel=1e-12)
    # block boundaries do not change the result (diagonal removed in every block)
    from nljax.measure import energy

    big = rng.normal(size=(50, 2))
    blocked = energy._distance_sum(big, big, True, block=7)
    assert blocked == pytest.approx(energy._distance_sum(big, big, True), rel=1e-12)
    # unbiased: ~0 on average for two samples of one distribution (the V-statistic is not)
    same = [energy_distance(rng.normal(size=(8, 2)), rng.normal(size=(8, 2))) for _ in range(400)]
    assert abs(np.mean(same)) < 0.03
    far = energy_distance(rng.normal(size=(50, 2)), rng.normal(size=(50, 2)) + 3)
    assert far > 2


def test_gather_rows_with_uneven_counts():
    mesh = make_mesh(2, 4)
    rows = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    arr = jax.device_put(rows, rows_sharding(mesh))
    out = gather_rows(arr, 13)  # devices hold 2, 2, 2, 2, 2, 2, 1 and 0 real rows
    np.testing.assert_array_equal(out, rows[:13])


def test_sample_grids():
    """Each half a grid of the images (1-pixel white gaps, each image scaled to 64 pixels): grey
    one channel, RGB three, 2 channels as red and green (their picture was 2 bytes a pixel in a
    file saying 3)."""
    rng = np.random.default_rng(0)
    one, multi, cols, cell = halves(rng.uniform(-1, 1, (10, 8, 8, 1)), rng.uniform(-1, 1, (10, 8, 8, 1)))
    assert (cols, cell) == (4, 65) and one.shape == multi.shape == (3 * 65 + 1, 4 * 65 + 1)
    assert (one[0] == 255).all() and (one[1:9, 1:9] == one[1, 1]).all()  # a gap; one pixel scaled 8 times
    for c in (3, 2):
        pic, _, _, _ = halves(rng.uniform(-1, 1, (4, 4, 4, c)), rng.uniform(-1, 1, (4, 4, 4, c)))
        assert pic.shape == (2 * 65 + 1, 2 * 65 + 1, 3)
        assert c == 3 or set(np.unique(pic[..., 2])) == {0, 255}  # blue: none in the images, white gaps


@pytest.mark.slow
def test_meanflow_toy_cli_end_to_end(tmp_path):
    """python -m nljax.train --config meanflow_toy on 2 devices, tiny: summary.json holds
    both energy distances, a PNG per evaluation, and the loss changes."""
    d = tmp_path / "toy"
    base = ["--config", "meanflow_toy", "--cpu-devices", "2"]  # a packaged config, by name
    d.mkdir()
    (d / "samples_000100.png").write_bytes(b"a user's file")
    p = cli("nljax.train", *base, f"run.dir={d}", "train.steps=12", "eval.every=6", "train.batch_size=32",
            "model.dim=16", "model.depth=1", "meanflow.eval_samples=50", "images.toy_points=400",
            "meanflow.sample_steps=2", check=False, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "final eval: " in p.stdout and "eval_energy_1step" in p.stdout.split("final eval: ", 1)[1]
    summary = json.loads((d / "summary.json").read_text())
    assert summary["eval_energy_1step"] > 0 and summary["eval_energy_multistep"] > 0
    assert summary["eval_samples"] == 50 and summary["devices"] == 2
    assert sorted(f.name for f in d.glob("samples_*.png")) == ["samples_000006.png", "samples_000012.png",
                                                               "samples_000100.png"]
    recs = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()]
    assert "eval_energy_1step" in recs[5] and len(recs) == 12
    # run.overwrite=true removes the PNGs the run wrote, not the user's one with the same pattern
    from nljax.runtime.rundir import RunDir

    RunDir(str(d), overwrite=True, write=True)
    assert sorted(f.name for f in d.glob("samples_*.png")) == ["samples_000100.png"]
    # bad input: one line, exit 2
    bad = cli("nljax.train", *base, f"run.dir={tmp_path}/bad", "images.source=file", check=False, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "nljax.train: error: images.source=file needs images.path (a .npy or .npz file, or a folder of images)"]


def test_labels_past_int32_and_a_large_eval_fraction_are_refused(tmp_path):
    """A label of 3e9 wrapped to a negative int32 and the run died inside JAX; eval_fraction 0.7
    held out half the examples, not what the rule says."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.uniform(-1, 1, (20, 4, 4, 1)), y=np.array([0] * 19 + [3_000_000_000]))
    with pytest.raises(ConfigError, match=r"labels must be < 1,048,576 \(2\^20\), got 3,000,000,000"):
        images.load(ImagesConfig(source="file", path=str(tmp_path / "d.npz")))
    # a negative label (-1 for "unlabelled") read a row of the class embedding from its end: refused
    np.savez(tmp_path / "neg.npz", x=rng.uniform(-1, 1, (20, 4, 4, 1)), y=np.array([0] * 19 + [-1]))
    with pytest.raises(ConfigError, match=r"labels must be non-negative integers \[N=20\], got int64 \(20,\)"):
        images.load(ImagesConfig(source="file", path=str(tmp_path / "neg.npz")))
    with pytest.raises(ConfigError, match=r"images.eval_fraction must be in \[1e-9, 0.5\]"):
        ImagesConfig(eval_fraction=0.7).check_used()
    # too few examples to split, counted as said: a folder of one image read "1 examples leave"
    from PIL import Image

    (tmp_path / "one").mkdir()
    Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).save(tmp_path / "one" / "a.png")
    np.savez(tmp_path / "three.npz", x=rng.uniform(-1, 1, (3, 4, 4, 1)))
    for path, said in (("one", "1 example leaves"), ("three.npz", "3 examples leave")):
        with pytest.raises(ConfigError, match=f"^images: {said} no training or no held-out part at "
                                              f"images.eval_fraction={ImagesConfig().eval_fraction}$"):
            images.load(ImagesConfig(source="file", path=str(tmp_path / path)))


@pytest.mark.parametrize("poison, message", [
    (lambda x: x * np.nan, "example 0 has a non-finite pixel"),
    (lambda x: x.__setitem__((7, 1, 2, 0), np.nan) or x, "example 7 has a non-finite pixel"),
    (lambda x: x.__setitem__((3, 0, 0, 0), -np.inf) or x, "example 3 has a non-finite pixel"),
    (lambda x: x.__setitem__(slice(5, None), 1e30) or x, f"example 5 has a pixel of magnitude 1e+30, above {images.MAX_ABS:g}"),
])
def test_non_finite_or_huge_images_are_refused_at_load(tmp_path, poison, message):
    """Such data trained with every step skipped; now one line names the first bad example."""
    x = poison(np.random.default_rng(0).uniform(-1, 1, (20, 4, 4, 1)).astype(np.float32))
    np.save(tmp_path / "x.npy", x)
    with pytest.raises(ConfigError) as e:
        images.load(ImagesConfig(source="file", path=str(tmp_path / "x.npy")))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_images_classes_orders_a_folders_labels(tmp_path):
    """images.classes: a folder's class names in label order (torchvision's sorted subfolders by
    default); a folder may hold some of them, labelled by their places; refused in one line: a
    subfolder not among them, a folder without class subfolders, a name twice, another source."""
    from nljax import config

    x = np.random.default_rng(0).integers(0, 256, (12, 4, 4), dtype=np.uint8)
    pngs(tmp_path / "set", x, [f"{['b', 'd'][i % 2]}/{i:02d}.png" for i in range(12)])
    pngs(tmp_path / "flat", x, [f"{i:02d}.png" for i in range(12)])

    def load(*extra):
        cfg = config.load(None, ["model.name=dit", "cms.periods=[1]", "images.source=file", *extra])
        return images.load(cfg.images)

    own = load(f"images.path={tmp_path / 'set'}")
    data = load(f"images.path={tmp_path / 'set'}", "images.classes=[d, a, b, c]")
    assert own.classes == ("b", "d") and own.num_classes == 2
    assert data.classes == ("d", "a", "b", "c") and data.num_classes == 4
    from nljax.run.tasks import ImageTask

    task = ImageTask(config.load(None, ["model.name=dit", "cms.periods=[1]", "images.source=file", "train.batch_size=4",
                                        f"images.path={tmp_path / 'set'}", "images.classes=[d, a, b, c]"]),
                     make_mesh(1, 1, jax.devices()[:1]))
    assert task.notes == [f"note: images.path {tmp_path / 'set'}: no class folder for 'a', 'c' of images.classes (the "
                          "model keeps a class for each)"]
    np.testing.assert_array_equal(data.train_x, own.train_x)  # the same images, in the same order
    np.testing.assert_array_equal(data.train_y, np.where(own.train_y == 0, 2, 0))  # b: 2, d: 0
    np.testing.assert_array_equal(data.eval_y, np.where(own.eval_y == 0, 2, 0))
    for extra, line in [
        (["images.classes=[d, a]"], f"images.path {tmp_path / 'set'}: class folder 'b' is not one of images.classes "
                                    "(d, a)"),
        ([f"images.path={tmp_path / 'flat'}", "images.classes=[a]"],
         f"images.classes names a folder's class subfolders; images.path {tmp_path / 'flat'} has none (a flat folder, "
         "or an array file): give images.classes=[] for its own labels"),
        (["images.classes=[b, d, b]"], "images.classes names 'b' twice"),
    ]:
        with pytest.raises(ConfigError) as e:
            load(f"images.path={tmp_path / 'set'}", *extra)
        assert str(e.value) == line
    with pytest.raises(ConfigError) as e:
        config.load(None, ["model.name=dit", "cms.periods=[1]", "images.classes=[a, b]"])
    assert str(e.value) == ("images.classes names a folder's class subfolders (images.source=file); "
                            "images.source=digits names none")


def test_a_checkpoint_used_on_other_images_is_refused(tmp_path, capsys):
    """A DiT's parameters fit images of any size (its positions are computed), so a model trained
    on 4x4 images scored and sampled 8x8 ones without a word: the checkpoint records the image
    shape its data gave, and a use of the model on another is refused with one line naming both
    (nljax.evaluate here; nljax.generate reads them the same way, `trained.load(reads_data=True)`;
    export and nljax.load read none: the model the checkpoint recorded).
    So are images of other channels, named as the images' (the output layer's shape was named),
    and a folder whose classes are others (as many: they were taken for the trained ones)."""
    from helpers import saved_run

    from nljax import evaluate
    from nljax.checkpoint import contents
    from nljax.run import trained

    names = ["ant", "bee", "cat", "dog"]
    class_folders(tmp_path, 3, 40, names, ("small", "other_small"), ["ant", "bee", "cow", "dog"])
    dit = ["model.name=dit", "model.dim=16", "model.depth=1", "model.heads=2", "model.hidden_mult=2",
           "model.dit.patch_size=1", "images.source=file", f"images.path={tmp_path / 'small'}", "cms.periods=[1]",
           "train.batch_size=16", "meanflow.sample_steps=2"]
    saved_run(tmp_path / "run", dit, 1, 2, steps=1)
    ck = tmp_path / "run" / "checkpoints" / "1"
    for other, line in [
        ("big", "images.shape=[4, 4, 3], this run's data give images.shape=[8, 8, 3]"),
        ("gray", "images.shape=[4, 4, 3], this run's data give images.shape=[4, 4, 1] (3-channel images there, "
                 "1-channel here)"),
        ("renamed", "images.classes[2]='cat', this run's data give images.classes[2]='cow': label 2 would stand "
                    "for another class (a folder's labels are its class subfolders in sorted order, or in "
                    "images.classes' order)"),
    ]:
        capsys.readouterr()
        assert evaluate.main([f"run.dir={tmp_path / 'run'}", f"images.path={tmp_path / other}"]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"nljax.evaluate: error: checkpoint {ck} was trained on data with {line}"), other
    # other images of its size and classes: the model is used (what they are is the user's to choose)
    t = trained.load(tmp_path / "run", overrides=[f"images.path={tmp_path / 'other_small'}"],
                     devices=jax.devices()[:1], reads_data=True)
    assert t.step == 1 and t.run.task.data.shape == (4, 4, 3) and t.run.task.data.classes == tuple(names)
    # a folder of some of its classes (a test set without 'ant' and 'cat'): labelled as the run
    # labelled them, bee 1 and dog 3 (it was refused as another class count; its own order gave 0, 1)
    x = np.random.default_rng(5).integers(0, 256, (20, 4, 4, 3), dtype=np.uint8)
    pngs(tmp_path / "some", x, [f"{'bee' if i % 2 else 'dog'}/{i:02d}.png" for i in range(20)])
    t = trained.load(tmp_path / "run", overrides=[f"images.path={tmp_path / 'some'}"], devices=jax.devices()[:1],
                     reads_data=True)
    d = t.run.task.data
    assert d.classes == tuple(names) and d.num_classes == 4 and t.warnings("nljax.evaluate") == []
    assert sorted(set(d.eval_y.tolist())) == [1, 3] and sorted(set(d.train_y.tolist())) == [1, 3]
    capsys.readouterr()
    assert evaluate.main([f"run.dir={tmp_path / 'run'}", f"images.path={tmp_path / 'some'}"]) == 0
    # its export (nljax.evaluate run.dir=EXPORT): the same checks, of the record in its config.json
    from nljax import export

    exp = tmp_path / "exp"
    assert export.main([f"run.dir={tmp_path / 'run'}", f"out={exp}"]) == 0
    capsys.readouterr()
    assert evaluate.main([f"run.dir={exp}", f"images.path={tmp_path / 'big'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"nljax.evaluate: error: export {exp} was trained on data with images.shape=[4, 4, 3], this run's data give "
        "images.shape=[8, 8, 3]")
    d = evaluate.load(str(exp), overrides=[f"images.path={tmp_path / 'some'}"], devices=jax.devices()[:1]).run.task.data
    assert d.classes == tuple(names) and sorted(set(d.eval_y.tolist())) == [1, 3]
    # a checkpoint saved before the record was kept is not checked
    contents.check_built(ck, {"config": {}}, {"images": {"shape": [8, 8, 3], "num_classes": 4}})


def test_a_folder_reached_again_through_a_link_is_read_once(tmp_path):
    """Links to folders are followed (as torchvision does), but a link back up (to the class
    folder or its parent) is not walked round again: it gave each image some 40 times, and the
    other classes' images under this class's label."""
    from nljax.data import imagefolder

    x = np.random.default_rng(4).integers(0, 256, (3, 4, 4), dtype=np.uint8)
    pngs(tmp_path / "set", x, ["cat/a.png", "cat/b.png", "dog/a.png"])
    (tmp_path / "set" / "cat" / "up").symlink_to("..")  # cat/up/cat/up/... and cat/up/dog
    (tmp_path / "set" / "cat" / "again").symlink_to(".")
    files, labels, names, _ = imagefolder.listing(tmp_path / "set", str(tmp_path / "set"))
    assert [f.relative_to(tmp_path / "set").as_posix() for f in files] == ["cat/a.png", "cat/b.png", "dog/a.png"]
    np.testing.assert_array_equal(labels, [0, 0, 1])
    assert names == ("cat", "dog")


def test_a_link_to_nothing_in_the_folder_is_one_line(tmp_path):
    """A class folder (or a flat folder's image) that is a link whose target is gone, an
    unmounted disk, was left out without a word: a set of one class fewer, its labels shifted."""
    from nljax.data import imagefolder

    x = np.random.default_rng(5).integers(0, 256, (2, 4, 4), dtype=np.uint8)
    pngs(tmp_path / "set", x, ["dog/a.png", "dog/b.png"])
    (tmp_path / "set" / "cat").symlink_to(tmp_path / "unmounted" / "cat")
    pngs(tmp_path / "flat", x, ["a.png", "b.png"])
    (tmp_path / "flat" / "c.png").symlink_to(tmp_path / "gone.png")
    for name, entry, target in (("set", "cat", tmp_path / "unmounted" / "cat"),
                                ("flat", "c.png", tmp_path / "gone.png")):
        with pytest.raises(ConfigError) as e:
            imagefolder.listing(tmp_path / name, str(tmp_path / name))
        assert str(e.value) == (f"images.path {tmp_path / name}: {entry} is a symbolic link to {target}, which does "
                                "not exist (a class folder or an image): fix the link, or remove it")
    # below a class folder: a linked folder of its images (or a linked image) whose target is gone
    (tmp_path / "set" / "cat").unlink()
    pngs(tmp_path / "set", x, ["cat/a.png", "cat/b.png"])
    (tmp_path / "set" / "cat" / "more").symlink_to(tmp_path / "unmounted" / "more")
    with pytest.raises(ConfigError) as e:
        imagefolder.listing(tmp_path / "set", str(tmp_path / "set"))
    gone = tmp_path / "unmounted" / "more"
    assert str(e.value) == (f"images.path {tmp_path / 'set'}: cat/more is a symbolic link to {gone}, which does not "
                            "exist (a folder or an image of the class): fix the link, or remove it")


def test_a_class_subfolder_that_cannot_be_listed_is_one_line(tmp_path, monkeypatch):
    """os.walk passes over a folder it cannot list (its permissions): its images were left out
    without a word. Root lists any folder, so the refusal is simulated where os.walk lists it."""
    import os

    from nljax.data import imagefolder

    for cls in ("cat", "dog"):
        (tmp_path / cls / "inner").mkdir(parents=True)
    locked = str(tmp_path / "cat" / "inner")
    real = os.scandir

    def scandir(path="."):
        if os.fspath(path) == locked:
            raise PermissionError(13, "Permission denied", locked)
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(ConfigError, match=f"^images.path: cannot read the folder {locked} \\(Permission denied\\)$"):
        imagefolder.listing(tmp_path, str(tmp_path))



@pytest.mark.slow
def test_a_folders_class_names_are_recorded_and_a_resume_on_others_is_refused(tmp_path, capsys, monkeypatch):
    """A run on a folder of class subfolders says its class names at start-up (label order) and
    records them in summary.json, every checkpoint and its sample grids' caption. A resume on
    images of another size (the run trained on 8x8 ones from then on, warned only of the path and
    digest), other channels or other class names (as many: taken for the trained ones) is refused
    with one line before anything is written; on other images of the same classes it goes on."""
    from helpers import tree_hash

    from nljax import evaluate, train
    from nljax.checkpoint import storage
    from nljax.run import tasks

    names = ["ant", "bee", "cat"]
    class_folders(tmp_path, 5, 30, names, ("pets", "more_pets"), ["ant", "bee", "cow"])
    run = tmp_path / "run"
    args = ["--config", "meanflow_toy", "model.dim=16", "model.depth=1", "train.batch_size=8",
            "meanflow.sample_steps=1", "throughput.reps=0", "run.plots=false", "eval.every=0", "checkpoint.every=2", "images.source=file",
            f"run.dir={run}"]
    drawn = []
    real = tasks.write_samples
    monkeypatch.setattr(tasks, "write_samples", lambda *a: (drawn.append(a[-1]), real(*a))[1])
    capsys.readouterr()
    assert train.main([*args, f"images.path={tmp_path / 'pets'}", "train.steps=2"]) == 0
    out = capsys.readouterr().out
    assert f"images {tmp_path / 'pets'}: 24 training and 6 held-out, 4x4x3, classes 3 (ant, bee, cat), digest " in out
    assert json.loads((run / "summary.json").read_text())["data"]["classes"] == names
    assert storage.read_meta(run / "checkpoints" / "2")["built"]["images"]["classes"] == names
    assert drawn == [tuple(names)]  # the final evaluation's grid names the classes in its caption
    assert evaluate.main([f"run.dir={run}"]) == 0
    assert f"images {tmp_path / 'pets'} (6 held-out, classes 3 (ant, bee, cat), digest " in capsys.readouterr().err
    ck = run / "checkpoints" / "2"
    for other, line in [
        ("big", "images.shape=[4, 4, 3], this run's data give images.shape=[8, 8, 3]"),
        ("gray", "images.shape=[4, 4, 3], this run's data give images.shape=[4, 4, 1] (3-channel images there, "
                 "1-channel here)"),
        ("renamed", "images.classes[2]='cat', this run's data give images.classes[2]='cow': label 2 would stand "
                    "for another class (a folder's labels are its class subfolders in sorted order, or in "
                    "images.classes' order)"),
    ]:
        before = tree_hash(tmp_path)
        capsys.readouterr()
        assert train.main([*args, "--resume", f"images.path={tmp_path / other}", "train.steps=4"]) == 2, other
        assert capsys.readouterr().err.strip().splitlines() == [
            f"nljax.train: error: checkpoint {ck} was trained on data with {line}; a resume continues the run on its "
            "own data (a new run may start from its parameters: checkpoint.init_params)"], other
        assert tree_hash(tmp_path) == before, other  # nothing written, nothing lost
    assert train.main([*args, "--resume", f"images.path={tmp_path / 'more_pets'}", "train.steps=4"]) == 0
    assert storage.read_meta(run / "checkpoints" / "4")["built"]["images"]["classes"] == names


def test_labels_with_a_gap_are_said_at_start_up(tmp_path):
    """Labels numbered from 1 (or with gaps) give a class per number up to the largest, some of
    which no image has: the run went on with `classes 4` for three classes and said nothing."""
    from nljax.config import load
    from nljax.run.tasks import ImageTask

    x = np.random.default_rng(0).integers(0, 256, (40, 4, 4, 1), dtype=np.uint8)
    np.savez(tmp_path / "from1.npz", x=x, y=np.arange(40) % 3 + 1)  # 1, 2, 3: no 0
    np.savez(tmp_path / "from0.npz", x=x, y=np.arange(40) % 3)
    mesh = make_mesh(1, 1, jax.devices()[:1])
    base = ["model.name=dit", "cms.periods=[1]", "images.source=file", "train.batch_size=4"]
    task = ImageTask(load(None, [*base, f"images.path={tmp_path / 'from1.npz'}"]), mesh)
    assert task.data.num_classes == 4 and task.notes == [
        f"note: images {tmp_path / 'from1.npz'}: no image has label 0; the model has a class for each of 0 .. 3 "
        "(number the labels from 0 without gaps)"]
    assert ImageTask(load(None, [*base, f"images.path={tmp_path / 'from0.npz'}"]), mesh).notes == []
    # a model that reads no labels has no classes to leave untrained
    assert ImageTask(load(None, [*base, f"images.path={tmp_path / 'from1.npz'}", "meanflow.class_cond=false"]),
                     mesh).notes == []


def class_sorted(tmp_path):
    """Overrides for a DiT on 300 images sorted by class (3 x 100): held out every 5th, 20 of each."""
    x = np.random.default_rng(0).integers(0, 256, (300, 4, 4, 1), dtype=np.uint8)
    np.savez(tmp_path / "sorted.npz", x=x, y=np.repeat([0, 1, 2], 100))
    return ["model.name=dit", "model.dim=16", "model.depth=1", "model.heads=2", "model.hidden_mult=2",
            "model.dit.patch_size=1", "cms.periods=[1]", "images.source=file", f"images.path={tmp_path / 'sorted.npz'}",
            "meanflow.eval_samples=12", "meanflow.sample_steps=1", f"run.dir={tmp_path / 'run'}"]


def test_samples_are_drawn_for_held_out_images_spread_over_them(tmp_path):
    """A folder's images come class by class, and so do its held-out images: n samples (an
    evaluation's meanflow.eval_samples, nljax.generate's samples=) were drawn for the first n
    held-out images, the first class's alone, and a grid showed the first 64 samples, that class
    again. Both take them spread over the held-out images (all of them for as many)."""
    from nljax.config import load
    from nljax.measure import figures
    from nljax.run.tasks import ImageTask

    task = ImageTask(load(None, class_sorted(tmp_path)), make_mesh(1, 1, jax.devices()[:1]))
    assert np.bincount(task.data.eval_y[task.chosen(12)]).tolist() == [4, 4, 4]
    np.testing.assert_array_equal(task.chosen(60), np.arange(60))
    # a grid's 64 of 200 samples drawn class by class: every class shown; fewer than 64 all shown
    assert np.bincount(np.repeat([0, 1, 2, 3], 50)[figures.shown(200)]).tolist() == [16, 16, 16, 16]
    np.testing.assert_array_equal(figures.shown(10), np.arange(10))


@pytest.mark.slow
def test_an_evaluation_of_a_class_sorted_set_scores_every_class(tmp_path, monkeypatch):
    """meanflow.eval_samples=12 of 60 held-out images sorted by class: the samples (and the PNG's
    labels) are drawn for 4 images of each class and scored against those images."""
    from helpers import make

    from nljax.run import tasks

    setup = make(class_sorted(tmp_path))
    drawn = {}
    monkeypatch.setattr(tasks, "write_samples", lambda _path, one, _multi, ref, _steps, labels, *_a: drawn.update(
        labels=labels, ref=ref))
    assert setup.evaluate(setup.state.params, 0)["eval_samples"] == 12
    assert np.bincount(drawn["labels"]).tolist() == [4, 4, 4]
    np.testing.assert_array_equal(drawn["ref"], setup.task.data.eval_x[::5])


def test_files_passed_over_in_a_folder_are_said_at_start_up(tmp_path):
    """A .jfif (a JPEG as Windows saves one) or .heic photo beside the .jpg ones, and any other file,
    was left out without a word (a class trained on fewer images than it has); hidden files
    (.DS_Store) stay silent."""
    from nljax.config import load
    from nljax.run.tasks import ImageTask

    x = np.random.default_rng(6).integers(0, 256, (20, 4, 4), dtype=np.uint8)
    pngs(tmp_path / "set", x, [f"{c}/{i}.png" for c in ("cat", "dog") for i in range(10)])
    for name in ("cat/9.jfif", "dog/deep/7.heic", "dog/.DS_Store"):
        (tmp_path / "set" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "set" / name).write_bytes(b"\xff\xd8\xff")
    pngs(tmp_path / "flat", x[:10], [f"{i}.png" for i in range(10)])
    (tmp_path / "flat" / "labels.csv").write_text("0,cat")
    mesh = make_mesh(1, 1, jax.devices()[:1])
    base = ["model.name=dit", "cms.periods=[1]", "images.source=file", "train.batch_size=4"]
    read = "read: .png, .jpg, .jpeg, .bmp, .gif, .webp, .tif, .tiff, .ppm, .pgm"
    for name, said in (("set", f"2 files passed over, not of an image type read here (e.g. cat/9.jfif; {read})"),
                       ("flat", f"1 file passed over, not of an image type read here (e.g. labels.csv; {read})")):
        task = ImageTask(load(None, [*base, f"images.path={tmp_path / name}"]), mesh)
        assert task.notes == [f"note: images.path {tmp_path / name}: {said}"]
        assert len(task.data.train_x) + len(task.data.eval_x) == (20 if name == "set" else 10)


def test_class_folders_named_by_numbers_are_said_to_be_labelled_as_text(tmp_path):
    """Folders 0 .. 10 are labelled in the order of their names as text (torchvision's: label 2 is
    folder 10), which a start-up note says; names that sort alike as numbers (00 .. 10) say nothing."""
    from nljax.config import load
    from nljax.run.tasks import ImageTask

    x = np.random.default_rng(7).integers(0, 256, (22, 4, 4), dtype=np.uint8)
    mesh = make_mesh(1, 1, jax.devices()[:1])
    base = ["model.name=dit", "cms.periods=[1]", "images.source=file", "train.batch_size=4"]
    for width, notes in ((1, ["the class folders are numbers, labelled in the order of their names as text (label 2 "
                              "is folder 10); for labels in number order name them 00, 01, ..., or give "
                              "images.classes=\"['0', '1', '2', '3', '4', '5', '6', '7', '8', '9', '10']\""]), (2, [])):
        where = tmp_path / str(width)
        pngs(where, x, [f"{k:0{width}d}/{i}.png" for k in range(11) for i in range(2)])
        task = ImageTask(load(None, [*base, f"images.path={where}"]), mesh)
        assert task.notes == [f"note: images.path {where}: {n}" for n in notes]
    # given in number order: labels in that order, nothing said
    order = [str(k) for k in range(11)]
    task = ImageTask(load(None, [*base, f"images.path={tmp_path / '1'}", f"images.classes={order}"]), mesh)
    assert task.notes == [] and task.data.classes == tuple(order)
    own = images.load(load(None, [*base, f"images.path={tmp_path / '1'}"]).images)  # folder 10: label 2
    number = np.array([int(n) for n in own.classes])  # own label -> the folder's number
    np.testing.assert_array_equal(task.data.train_y, number[own.train_y])
    np.testing.assert_array_equal(task.data.eval_y, number[own.eval_y])


def test_one_held_out_image_is_refused_at_start_up(tmp_path):
    """Energy distance needs 2 held-out images: 1 is refused when the task is built, before step
    0 (where an evaluation would take fewer: meanflow.eval_samples is 0 or >= 2)."""
    from nljax.config import load
    from nljax.run.tasks import ImageTask

    np.savez(tmp_path / "four.npz", x=np.random.default_rng(0).uniform(-1, 1, (4, 4, 4, 1)))
    cfg = load(None, ["model.name=dit", "cms.periods=[1]", "images.source=file", f"images.path={tmp_path / 'four.npz'}",
                      "images.eval_fraction=0.25", "train.batch_size=1"])
    with pytest.raises(ConfigError, match=r"^evaluation needs at least 2 held-out images, got 1$"):
        ImageTask(cfg, make_mesh(1, 1, jax.devices()[:1]))


def test_a_run_built_to_evaluate_takes_fewer_images_than_its_training_batch(tmp_path):
    """`nljax.evaluate run.dir=... images.path=FEW` (and generate, export, load) scores or samples
    the held-out images alone: a set smaller than the run's train.batch_size was refused with
    "train.batch_size=64 is larger than the 48 training images", which a training run says."""
    from nljax.config import load
    from nljax.run import tasks

    x = np.random.default_rng(0).integers(0, 256, (20, 4, 4, 1), dtype=np.uint8)
    np.savez(tmp_path / "few.npz", x=x, y=np.arange(20) % 2)
    cfg = load(None, ["model.name=dit", "cms.periods=[1]", "images.source=file", f"images.path={tmp_path / 'few.npz'}",
                      "train.batch_size=64"])
    mesh = make_mesh(1, 1, jax.devices()[:1])
    task = tasks.build("images", cfg, mesh, trains=False)
    assert len(task.data.eval_x) == 4
    with pytest.raises(TypeError, match="draws no training batches"):
        task.batch(0)
    with pytest.raises(ConfigError, match=r"train.batch_size=64 is larger than the 16 training images"):
        tasks.build("images", cfg, mesh)  # a run that trains still says so before step 0


def test_the_comparison_script_says_each_run_as_it_starts(tmp_path):
    """examples/meanflow_vs_flow_matching.sh trains both losses with --quiet: minutes without a
    line (41 s at 10 steps on the 2-core CPU), which reads as a hang. A stand-in `python` makes
    the runs instant: what is checked is what the script says."""
    import os
    import subprocess
    import sys

    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(f"""#!/bin/bash
if [ "$1" = -m ]; then  # a training run: its summary.json alone
  for a; do case $a in run.dir=*) d=${{a#run.dir=}};; esac; done
  mkdir -p "$d"
  echo '{{"eval_energy_1step": 1, "eval_energy_multistep": 2, "eval_sample_steps": 4, "steps": 3}}' > "$d/summary.json"
  exit 0
fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "OUT": str(tmp_path / "runs")}
    p = subprocess.run(["bash", str(ROOT / "examples" / "meanflow_vs_flow_matching.sh"), "train.steps=3"], env=env,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines() == [
        f"meanflow_vs_flow_matching.sh: training with meanflow.loss={loss} into {tmp_path / 'runs'}/{loss} ..."
        for loss in ("meanflow", "flow_matching")]
    assert "meanflow       energy distance: 1-step 1.0000  4-step 2.0000  (3 steps)" in p.stdout
