"""Image data for the `images` task: arrays in memory, epochs of shuffled batches.

Sources (`images.source`):
- `digits`: scikit-learn's bundled 8x8 digits (1797 images, 10 classes), shipped inside the
  package, so it works offline; the default.
- `file`: a user's `.npy` (images [N, H, W] or [N, H, W, C]) or `.npz` (`x`/`images`, optional
  `y`/`labels`), e.g. CIFAR-10 saved as arrays, or a folder of image files, flat or one subfolder
  per class (`nljax.data.imagefolder`: its subfolders' names are the class names). uint8 pixels
  (every folder's) are mapped to [-1, 1]; floats are used as given.
- `moons`, `gaussians`: 2-D toy distributions made by code, as "images" of shape [1, 1, 2].

Every round(1 / eval_fraction)-th example is held out for evaluation (a fixed split that does
not depend on the seed, so runs with different seeds are scored on the same images).

Batches: an epoch is a permutation of the training set drawn from (seed, epoch) alone; step s
reads rows [k B, (k + 1) B) of epoch s // steps_per_epoch's permutation, k = s % steps_per_epoch,
with steps_per_epoch = floor(N / B): the last partial batch of an epoch is dropped. A batch is
therefore a pure function of (seed, step), and each device builds only its own rows.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from pathlib import Path
from typing import Literal

import jax
import numpy as np

from nljax.data import imagefolder
from nljax.errors import ConfigError, first_line
from nljax.parallel.hostdev import rows_batch


@dataclasses.dataclass(frozen=True)
class ImagesConfig:
    """Config section `images`: the image data of the `images` task."""

    source: Literal["digits", "file", "moons", "gaussians"] = "digits"  # digits: scikit-learn's 8x8 set
    # source=file: a .npy (images), an .npz ('x' or 'images', optional 'y' or 'labels'), or a folder
    # of image files (PNG, JPEG, ...): flat, or one subfolder per class (torchvision's ImageFolder)
    path: str = ""
    eval_fraction: float = 0.2  # every round(1/eval_fraction)-th example is held out
    # a folder's class names in label order (label k: the k-th); its subfolders must be among them
    # (some may be missing: a test set without a class). Empty: its subfolders in sorted order
    # (torchvision's ImageFolder). nljax.evaluate and nljax.generate set it to the run's classes
    # for a folder holding some of them
    classes: tuple[str, ...] = ()
    toy_points: int = 8192  # size of the 2-D toy sets

    def check_used(self) -> None:
        """Rules that apply when a run reads this section (model.name=dit)."""
        # every round(1/f)-th example is held out: at most every 2nd (1e-9: 1/f stays a number)
        # one refusal each, with the value given: a combined line left the user to guess which
        if not 1e-9 <= self.eval_fraction <= 0.5:
            raise ConfigError(f"images.eval_fraction must be in [1e-9, 0.5], got {self.eval_fraction:g}")
        if self.toy_points < 2:
            raise ConfigError(f"images.toy_points must be >= 2, got {self.toy_points:,}")
        if self.source == "file" and not self.path:
            raise ConfigError("images.source=file needs images.path (a .npy or .npz file, or a folder of images)")
        if self.source != "file" and self.path:  # ignored without a word: trained on digits instead
            raise ConfigError(f"images.path is read only with images.source=file (images.source={self.source})")
        if self.toy_points > 10_000_000:  # made in memory at start-up: 2e9 points never finished
            raise ConfigError(f"images.toy_points must be <= 10,000,000, got {self.toy_points:,}")
        if self.classes and self.source != "file":
            raise ConfigError(f"images.classes names a folder's class subfolders (images.source=file); images.source="
                              f"{self.source} names none")
        if len(set(self.classes)) < len(self.classes) or "" in self.classes:
            twice = next((c for c in self.classes if self.classes.count(c) > 1), "")
            raise ConfigError(f"images.classes names {twice!r} twice" if twice else
                              "images.classes holds an empty name")


@dataclasses.dataclass(frozen=True, eq=False)
class ImageSet:
    train_x: np.ndarray  # float32 [N, H, W, C]
    train_y: np.ndarray  # int32 [N] (zeros when the data has no labels)
    eval_x: np.ndarray  # float32 [E, H, W, C]
    eval_y: np.ndarray  # int32 [E]
    num_classes: int  # 0: no labels
    # label k's name (a folder's class subfolders, sorted); None where the data do not name their
    # labels (an .npz's integers, digits, the toy sets)
    classes: tuple[str, ...] | None = None
    passed_over: tuple[str, ...] = ()  # a folder's files not of an image type (paths under it)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images / 8.0 - 1.0)[..., None], d.target  # pixels 0..16 -> [-1, 1]


def _moons(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, n)
    a = rng.uniform(0, np.pi, n)
    pts = np.where(y[:, None] == 0, np.stack([np.cos(a), np.sin(a)], 1), np.stack([1 - np.cos(a), 0.5 - np.sin(a)], 1))
    pts = pts + 0.05 * rng.normal(size=pts.shape)
    pts = (pts - [0.5, 0.25]) / [0.87, 0.5]  # roughly zero mean, unit scale
    return pts[:, None, None, :], y


def _gaussians(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 8, n)
    angle = y * (2 * np.pi / 8)
    pts = np.stack([np.cos(angle), np.sin(angle)], 1) + 0.08 * rng.normal(size=(n, 2))
    return pts[:, None, None, :], y


# first bytes of files a user may give in place of arrays: named, where numpy's own message
# spoke of pickled data ("allow_pickle=") and a folder was "not found"
NOT_ARRAYS = {b"\x89PNG": "a PNG image", b"\xff\xd8\xff": "a JPEG image", b"GIF8": "a GIF image",
              b"RIFF": "a RIFF (WebP?) file", b"BM": "a BMP image"}
ARRAY_MAGIC = (b"\x93NUMPY", b"PK\x03\x04", b"PK\x05\x06")  # .npy; .npz (a zip, or an empty one)


def _file(path: str) -> tuple[np.ndarray, np.ndarray | None, tuple[str, ...] | None, tuple[str, ...]]:
    """The pixels of `path` (a folder of images, or an array file) in [-1, 1] for uint8, the
    labels, their names (a folder's classes; None for an array file) and a folder's other files."""
    x, y, names, others = imagefolder.read(path) if Path(path).is_dir() else (*_arrays(path), None, ())
    if x.dtype == np.uint8:
        return _unit(x), y, names, others
    if not np.issubdtype(x.dtype, np.floating):
        raise ConfigError(f"images.path {path}: pixels must be uint8 or float, got {x.dtype}")
    return x, y, names, others


def _unit(x: np.ndarray) -> np.ndarray:
    """uint8 pixels mapped to [-1, 1] as float32, a block of images at a time: the same values as
    x / 127.5 - 1 (float64) cast whole, without that float64 copy of the data set."""
    out = np.empty(x.shape, np.float32)
    step = max(1, (64 << 20) // max(1, x[0].size * 8))  # about 64 MB of float64 per block
    for i in range(0, len(x), step):
        out[i : i + step] = x[i : i + step] / 127.5 - 1.0
    return out


def _arrays(path: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The images and labels of a .npy or .npz file, as stored."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"images.path not found: {path}")
    try:
        with open(p, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ConfigError(f"images.path {path}: cannot read it ({e.strerror})") from None
    if not head.startswith(ARRAY_MAGIC):
        what = next((name for magic, name in NOT_ARRAYS.items() if head.startswith(magic)), "" if head else "empty")
        raise ConfigError(f"images.path {path} is {what + ', ' if what else ''}not a .npy or .npz file of images "
                          "(or a folder of image files)")
    try:
        loaded = np.load(p, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one user error
        _objects(path, e)
        raise ConfigError(f"images.path {path} is not a readable .npy/.npz file: {e}")
    if isinstance(loaded, np.ndarray):
        x, y = loaded, None
    else:
        members = [n for n in loaded.zip.namelist() if not n.endswith("/")]
        if members and not any(n.endswith(".npy") for n in members):  # numpy's are NAME.npy: a zip of images
            raise ConfigError(f"images.path {path} is a zip archive of {len(members):,} files (e.g. {members[0]}), "
                              "not an .npz of arrays: unzip it and give the folder")
        keys = set(loaded.files)
        for pair in (("x", "images"), ("y", "labels")):
            if all(k in keys for k in pair):  # which one is meant is not for nljax to guess
                raise ConfigError(f"images.path {path} holds both '{pair[0]}' and '{pair[1]}': keep one of them")
        xk = next((k for k in ("x", "images") if k in keys), None)
        if xk is None:
            # the first names only: an .npz of thousands of arrays (one per image) filled the screen
            raise ConfigError(f"images.path {path} holds {imagefolder.short_list(sorted(keys))}; expected an array "
                              "named 'x' or 'images'")
        yk = next((k for k in ("y", "labels") if k in keys), None)
        try:
            x = loaded[xk]
            y = loaded[yk] if yk else None
        except Exception as e:  # noqa: BLE001 - an object array, a damaged member: one user error
            _objects(path, e)
            raise ConfigError(f"images.path {path}: cannot read its arrays ({first_line(e)})") from None
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4 or len(x) < 2 or 0 in x.shape[1:]:  # zero-size images: nothing to learn or to draw
        raise ConfigError(f"images.path {path}: expected images [N, H, W] or [N, H, W, C] of at least one pixel, "
                          f"got shape {x.shape}")
    if x.shape[1] in (1, 3, 4) and x.shape[2] == x.shape[3] > 4:
        # PyTorch's layout [N, C, H, W] read as [N, H, W, C]: 3 x 16 images of 16 channels, whose
        # refusal blamed model.dit.patch_size (or none came: a 4-row image trained)
        raise ConfigError(f"images.path {path}: images of shape {x.shape} look channels-first [N, C, H, W]; nljax "
                          "reads [N, H, W, C]: save np.moveaxis(x, 1, -1)")
    if y is not None and (y.shape != (len(x),) or not np.issubdtype(y.dtype, np.integer) or y.min() < 0):
        raise ConfigError(
            f"images.path {path}: labels must be non-negative integers [N={len(x)}], got {y.dtype} {y.shape}"
        )
    return x, y


def _objects(path: str, e: Exception) -> None:
    """An array of Python objects is what numpy saves from images of different sizes; its own
    message spoke of allow_pickle=, which nljax never sets (a pickle runs code when read)."""
    if "Object arrays cannot be loaded" in str(e):
        raise ConfigError(f"images.path {path} holds an array of Python objects (images of different sizes?): "
                          "save one uint8 or float array [N, H, W(, C)], every image resized to one size") from None


# Pixel magnitude a run accepts. The denoiser mixes data with N(0, 1) noise, so data far beyond
# unit scale is data nobody normalized (a float image of 0..65535, a corrupted file): 1e4 leaves
# room for any sane scaling (0..255 floats included) while squares and sums of the loss stay far
# from float32's overflow at 3e38 (1e30 overflowed, and every step was skipped).
MAX_ABS = 1e4
MAX_CLASSES = 2**20  # labels: a class embedding row each; a label near 2^31 overflowed int32 inside jit


def check_values(x: np.ndarray, where: str) -> None:
    """One line naming the first example (index in the source, before the held-out split) with a
    non-finite pixel or one above MAX_ABS; such data would only ever give skipped steps."""
    flat = x.reshape(len(x), -1)
    bad_finite = ~np.isfinite(flat).all(axis=1)
    if bad_finite.any():
        i = int(np.argmax(bad_finite))
        raise ConfigError(f"images {where}: example {i} has a non-finite pixel (NaN or inf)")
    big = np.abs(flat).max(axis=1) > MAX_ABS
    if big.any():
        i = int(np.argmax(big))
        raise ConfigError(
            f"images {where}: example {i} has a pixel of magnitude {np.abs(flat[i]).max():.3g}, above {MAX_ABS:g}; "
            "scale the data (e.g. to [-1, 1])"
        )


def spread(total: int, n: int) -> np.ndarray:
    """n positions of range(total) spread evenly over it, in order (all of them for n = total).
    The held-out images an evaluation of n samples scores, and a grid shows: not the first n,
    since a folder's images come class by class (a grid of 16 from 3 classes of 1,000 drew the
    first class alone, and meanflow.eval_samples scored it alone)."""
    return np.arange(n) * total // n


def label_ids(labels, names, classes: int) -> np.ndarray:
    """Sample labels as class ids [n] int32: a folder's class name (`names`, in label order) stands
    for its label, as Python's `generate(labels=)` and `nljax.generate labels=` take them; each a
    class 0 .. classes - 1, or `classes`, the null label (a sample of no class). `classes` 0: an
    unconditional model, which reads no label (any number is taken)."""
    names = tuple(names or ())
    ids = []
    for x in labels:
        if isinstance(x, str) and x in names:
            ids.append(names.index(x))
        elif hasattr(x, "__index__") and not isinstance(x, (bool, str)):  # int, numpy's, a 0-d jax array
            ids.append(operator.index(x))
        else:  # int('cat') raised a ValueError
            known = f"its classes: {', '.join(names)}" if names else "its data name no classes"
            raise ConfigError(f"labels must be class numbers or, for a run on a folder, class names ({known}); "
                              f"got {x!r:.60}")
    label = np.asarray(ids, np.int64)
    # a conditional DiT's classes 0..n-1 and n, its null label; a label beyond reads another row
    # of the label embedding (or none), silently
    bad = label[(label < 0) | (label > classes)] if classes else label[:0]
    if bad.size:
        which = "0" if classes == 1 else f"0 to {classes - 1}"
        raise ConfigError(f"labels must be a class, {which}, or {classes} for no class (unconditional samples), "
                          f"got {int(bad[0])}")
    return label.astype(np.int32)


def missing_labels(data: ImageSet) -> list[int]:
    """The labels in 0 .. num_classes - 1 that no image has (an .npz numbered from 1, or with gaps)."""
    if not data.num_classes:
        return []
    seen = np.unique(np.concatenate([data.train_y, data.eval_y]))
    return np.setdiff1d(np.arange(data.num_classes), seen).tolist()


def _in_order(path: str, y: np.ndarray | None, names: tuple[str, ...] | None,
              classes: tuple[str, ...]) -> tuple[np.ndarray, tuple[str, ...]]:
    """A folder's labels and names with `classes` as the label order (`ImagesConfig.classes`)."""
    if names is None:
        raise ConfigError(f"images.classes names a folder's class subfolders; images.path {path} has none (a flat "
                          "folder, or an array file): give images.classes=[] for its own labels")
    if other := [n for n in names if n not in classes]:
        raise ConfigError(f"images.path {path}: class folder {other[0]!r} is not one of images.classes "
                          f"({imagefolder.short_list(classes)})")
    return np.array([classes.index(n) for n in names], np.int64)[y], tuple(classes)


@functools.lru_cache(maxsize=4)
def load(cfg: ImagesConfig) -> ImageSet:
    """The configured data, split into training and held-out parts."""
    names, others = None, ()
    if cfg.source == "digits":
        x, y = _digits()
    elif cfg.source == "moons":
        x, y = _moons(cfg.toy_points)
    elif cfg.source == "gaussians":
        x, y = _gaussians(cfg.toy_points)
    else:
        try:
            x, y, names, others = _file(cfg.path)
        except MemoryError as e:  # the run's out-of-memory line blamed the model and train.batch_size
            raise ConfigError(f"images.path {cfg.path}: the images do not fit in memory ({first_line(e)}): the whole "
                              "set is read at start-up, 4 bytes a pixel value (nothing is resized): use smaller or "
                              "fewer images") from None
    if cfg.classes:
        y, names = _in_order(cfg.path, y, names, cfg.classes)
    if y is not None and y.max() >= MAX_CLASSES:  # the class embedding has a row per class (and the null one)
        raise ConfigError(f"images: labels must be < {MAX_CLASSES:,} (2^20), got {int(y.max()):,}")
    num_classes = len(names) if cfg.classes else 0 if y is None else int(y.max()) + 1
    y = np.zeros(len(x), np.int32) if y is None else y.astype(np.int32)
    x = x.astype(np.float32, copy=False)  # uint8 came as float32 (`_unit`): no second copy
    check_values(x, cfg.path if cfg.source == "file" else cfg.source)
    every = round(1 / cfg.eval_fraction)
    held = np.arange(len(x)) % every == every - 1
    if held.all() or not held.any():
        raise ConfigError(
            f"images: {len(x):,} example{'s' * (len(x) != 1)} leave{'s' * (len(x) == 1)} no training or no held-out "
            f"part at images.eval_fraction={cfg.eval_fraction}"
        )
    return ImageSet(x[~held], y[~held], x[held], y[held], num_classes, names, others)


@dataclasses.dataclass(frozen=True)
class EpochSampler:
    """Which training examples fill each row of each step's global batch."""

    n: int  # training examples
    batch_size: int  # global rows per step
    seed: int

    def __post_init__(self):
        if self.n < self.batch_size:
            # what to do too: a small folder of one's own meets this first (no partial batch is drawn)
            raise ConfigError(f"train.batch_size={self.batch_size} is larger than the {self.n} training images: lower "
                              f"train.batch_size to at most {self.n}, or add images")

    @property
    def steps_per_epoch(self) -> int:
        return self.n // self.batch_size  # the last partial batch is dropped

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of epoch `epoch`: a function of (seed, epoch) only.  [N]"""
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def indices(self, step: int) -> np.ndarray:
        """Training-example index of every row of the step's global batch.  [B]"""
        epoch, k = divmod(step, self.steps_per_epoch)
        return self.permutation(epoch)[k * self.batch_size : (k + 1) * self.batch_size]


def rows(data: ImageSet, sampler: EpochSampler, step: int, which: np.ndarray) -> dict[str, np.ndarray]:
    """Rows `which` (positions in the global batch) of step `step`.

    `index` is the row's global position step * B + row (modulo 2^31): the model derives its
    per-example random draws from it, so they do not depend on the mesh."""
    ex = sampler.indices(step)[which]
    return {
        "image": data.train_x[ex],
        "label": data.train_y[ex],
        "index": ((np.int64(step) * sampler.batch_size + which) % 2**31).astype(np.int32),
    }


def global_batch(data: ImageSet, sampler: EpochSampler, step: int, sharding: jax.sharding.Sharding) -> dict:
    """The step's global batch, split over rows; each device (and process) builds only its rows."""
    b = sampler.batch_size
    shapes = {"image": (b, *data.shape), "label": (b,), "index": (b,)}
    return rows_batch(shapes, sharding, lambda which: rows(data, sampler, step, which))
