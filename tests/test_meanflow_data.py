"""Image data, energy distance, sample figures and the MeanFlow command line."""

import json
import zlib

import jax
import numpy as np
import pytest
from helpers import ROOT, cli

from nljax.config import ConfigError, ImagesConfig
from nljax.data import images
from nljax.measure.energy import energy_distance
from nljax.measure.figures import sample_figure, write_png
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
    with pytest.raises(ConfigError, match="larger than the 2 training images"):
        images.EpochSampler(2, 3, 0)


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


def test_a_folder_or_a_picture_for_images_path_is_named(tmp_path):
    """A folder of images was "not found", and a PNG or a text file "contains pickled (object)
    data ... allow_pickle=" (numpy's message): each is named for what it is."""
    (tmp_path / "pics").mkdir()
    (tmp_path / "cat.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(40))
    (tmp_path / "notes.txt").write_text("not pixels")
    (tmp_path / "empty.npy").write_bytes(b"")
    tail = "not a .npy or .npz file of images (a folder of images: save it as an .npz, docs/guides/meanflow.md#data)"
    for name, line in [
        ("pics", f"images.path {tmp_path / 'pics'} is a directory: images.source=file reads one .npy or .npz file "
                 "(a folder of images: save it as an .npz, docs/guides/meanflow.md#data)"),
        ("cat.png", f"images.path {tmp_path / 'cat.png'} is a PNG image, {tail}"),
        ("notes.txt", f"images.path {tmp_path / 'notes.txt'} is {tail}"),
        ("empty.npy", f"images.path {tmp_path / 'empty.npy'} is empty, {tail}"),
    ]:
        with pytest.raises(ConfigError) as e:
            images.load(ImagesConfig(source="file", path=str(tmp_path / name)))
        assert str(e.value) == line


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


def test_the_guides_folder_to_npz_snippet_runs_as_written(tmp_path, monkeypatch):
    """docs/guides/meanflow.md's recipe for a folder of pictures (class subfolders; grayscale,
    RGBA and another size among them) gives an .npz that images.source=file reads, labels by
    subfolder."""
    import re

    from PIL import Image

    rng = np.random.default_rng(0)
    for k, cls in enumerate(["cat", "dog"]):
        (tmp_path / "my_images" / cls).mkdir(parents=True)
        for i, mode in enumerate(["RGB", "L", "RGBA", "RGB"]):
            side = 8 if i < 3 else 12
            Image.fromarray(rng.integers(0, 256, (side, side, 3), np.uint8)).convert(mode).save(
                tmp_path / "my_images" / cls / f"{i}.png")
    block = re.search(r"```python\n(.*?)```", (ROOT / "docs/guides/meanflow.md").read_text(), re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(block, {})
    data = images.load(ImagesConfig(source="file", path=str(tmp_path / "my_images.npz"), eval_fraction=0.25))
    assert data.shape == (32, 32, 3) and data.num_classes == 2 and len(data.train_x) == 6
    np.testing.assert_array_equal(np.load(tmp_path / "my_images.npz")["y"], [0, 0, 0, 0, 1, 1, 1, 1])


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


def test_png_figures(tmp_path):
    rng = np.random.default_rng(0)
    pic = sample_figure(rng.uniform(-1, 1, (10, 8, 8, 1)), rng.uniform(-1, 1, (10, 8, 8, 1)), None)
    write_png(tmp_path / "a.png", pic)
    raw = (tmp_path / "a.png").read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    assert (h, w) == pic.shape
    idat = raw[raw.index(b"IDAT") + 4 : raw.index(b"IEND") - 8]
    decoded = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, w + 1)[:, 1:]
    np.testing.assert_array_equal(decoded, pic)
    toy = sample_figure(rng.normal(size=(30, 1, 1, 2)), rng.normal(size=(30, 1, 1, 2)), rng.normal(size=(30, 1, 1, 2)))
    assert toy.ndim == 2 and (toy == 0).any() and (toy == 180).any()
    # RGB, and 2 channels as red and green (their picture was 2 bytes a pixel in a file saying 3)
    for c in (3, 2):
        pic = sample_figure(rng.uniform(-1, 1, (4, 4, 4, c)), rng.uniform(-1, 1, (4, 4, 4, c)), None)
        write_png(tmp_path / "c.png", pic)
        raw = (tmp_path / "c.png").read_bytes()
        w, h = int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
        assert pic.shape == (h, w, 3) and raw[25] == 2  # colour type 2: RGB
        idat = raw[raw.index(b"IDAT") + 4 : raw.index(b"IEND") - 8]
        decoded = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)[:, 1:].reshape(h, w, 3)
        np.testing.assert_array_equal(decoded, pic)
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
        "nljax.train: error: images.source=file needs images.path (a .npy or .npz file)"]


def test_labels_past_int32_and_a_large_eval_fraction_are_refused(tmp_path):
    """A label of 3e9 wrapped to a negative int32 and the run died inside JAX; eval_fraction 0.7
    held out half the examples, not what the rule says."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.uniform(-1, 1, (20, 4, 4, 1)), y=np.array([0] * 19 + [3_000_000_000]))
    with pytest.raises(ConfigError, match=r"labels must be < 1,048,576 \(2\^20\), got 3,000,000,000"):
        images.load(ImagesConfig(source="file", path=str(tmp_path / "d.npz")))
    with pytest.raises(ConfigError, match=r"images.eval_fraction must be in \[1e-9, 0.5\]"):
        ImagesConfig(eval_fraction=0.7).check_used()


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
