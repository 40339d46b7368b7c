"""A folder of image files as the `images` task's data (`images.path=DIR`), read with Pillow.

The layout is torchvision's `ImageFolder` convention, or a flat folder:

- image files directly in DIR: no labels;
- one subfolder per class: the classes are the subfolders' names in sorted order, labelled
  0 .. K-1 (torchvision's `classes`; its `class_to_idx` is their positions); a class's images may
  lie at any depth below its folder. The names are the run's record of what each label is
  (summary.json, the checkpoints), and another folder's names refused where the checkpoint's
  are others (`nljax.checkpoint.contents.check_built`).

Image files are those named with one of `EXTENSIONS` (any case); other files are passed over (and
counted: a note says so, where a `.jfif` or `.heic` photo would otherwise vanish), and every name
that starts with '.' (macOS's `._x.png` and `.DS_Store`, editors' backups) silently. Files come in
sorted order of their paths, class by class, which fixes the held-out split.

Pixels: every image must have the size of the first one (nothing is resized: a silent resize
changes the data a run claims to train on). All grayscale ('1', 'L', 'LA'): one channel;
otherwise every image is converted to RGB (palettes expanded; alpha dropped, not blended). 16-bit
and float images are refused: their values do not map to uint8 without a choice of scale. The
result is uint8, scaled by the caller as a uint8 array file is (`nljax.data.images`).

Two passes: the first opens every file's header only (size and mode: a file of another size or a
corrupt header is named before any pixel is decoded), the second decodes each image into one
preallocated uint8 array [N, H, W, C]. Errors are one line (ConfigError) naming the file.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import numpy as np

from nljax.errors import ConfigError, first_line

# torchvision's IMG_EXTENSIONS, and GIF (its first frame, as every multi-frame file: Pillow's default)
EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
GRAY = ("1", "L", "LA")  # Pillow modes read as one channel
WIDE = ("I", "F")  # mode prefixes of 16/32-bit integer and float pixels ("I", "I;16", "F")


def is_image(p: Path) -> bool:
    return p.suffix.lower() in EXTENSIONS and not p.name.startswith(".")


def read(path: str) -> tuple[np.ndarray, np.ndarray | None, tuple[str, ...] | None, tuple[str, ...]]:
    """The images under the folder `path` (uint8 [N, H, W, 1 or 3]), their labels (int64 [N]) and
    the class names (label k: names[k]), both None for a flat folder; and the other files passed
    over (their paths under `path`)."""
    root = Path(path)
    files, labels, names, others = listing(root, path)
    (h, w), gray = _survey(root, files, path)
    x = np.empty((len(files), h, w, 1 if gray else 3), np.uint8)  # the only copy of the pixels
    for i, f in enumerate(files):
        x[i] = _decode(root, f, path, "L" if gray else "RGB").reshape(x.shape[1:])
    return x, labels, names, tuple(_rel(root, f) for f in others)


def listing(root: Path, path: str) -> tuple[list[Path], np.ndarray | None, tuple[str, ...] | None, list[Path]]:
    """The image files in order, their labels, the class names in label order (None: flat) and
    the other files (not hidden) passed over."""
    try:
        entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    except OSError as e:
        raise ConfigError(f"images.path {path}: cannot read the folder ({e.strerror})") from None
    if not entries:
        raise ConfigError(f"images.path {path} is an empty folder")
    # A link whose target is gone is neither a folder nor a file: a class folder linked from an
    # unmounted disk was passed over without a word (the other classes took its labels), and so
    # was a linked image of a flat folder, where one in a class folder is refused.
    for p in entries:
        _refuse_dangling(p, path, p.name, "a class folder or an image")
    classes = [p for p in entries if p.is_dir()]
    loose = [p for p in entries if p.is_file() and is_image(p)]
    others = [p for p in entries if p.is_file() and not is_image(p)]
    if not classes:
        if not loose:
            raise ConfigError(f"images.path {path} holds no image files ({', '.join(EXTENSIONS)}); "
                              f"{len(entries)} other file{'s' if len(entries) > 1 else ''}, e.g. {entries[0].name}")
        return loose, None, None, others
    if loose:  # which class would they be? not for nljax to guess
        raise ConfigError(f"images.path {path} holds image files ({loose[0].name}) beside subfolders "
                          f"({classes[0].name}/): put every image in a class subfolder, or none in subfolders")
    files, labels = [], []
    for k, d in enumerate(classes):
        mine, theirs = _below(d)
        others += theirs
        if not mine:  # the classes after it would take its label: said instead
            raise ConfigError(f"images.path {path}: class folder {d.name}/ holds no image files "
                              f"(every subfolder is a class: {', '.join(EXTENSIONS)})")
        files += mine
        labels += [k] * len(mine)
    return files, np.array(labels, np.int64), tuple(d.name for d in classes), others


def short_list(names, most: int = 8) -> str:
    """Class names for a line of text, in label order: all of them up to `most`, else the first
    ones, '...' and the last (ImageNet's 1000 would fill a screen)."""
    names = list(names)
    return ", ".join(names if len(names) <= most else [*names[: most - 2], "...", names[-1]])


def _refuse_dangling(p: Path, root, shown: str, what: str) -> None:
    """One line for `p`, a symbolic link to nothing (`shown` as named under images.path `root`)."""
    if p.is_symlink() and not p.exists():
        raise ConfigError(f"images.path {root}: {shown} is a symbolic link to {os.readlink(p)}, which does not exist "
                          f"({what}): fix the link, or remove it")


def _below(d: Path) -> tuple[list[Path], list[Path]]:
    """Image files at any depth below `d` (links to folders followed, as torchvision does),
    sorted by their path, and the other files (not hidden); hidden folders skipped. A folder
    reached again through a link (the class folder itself, a second link to one folder) is read
    once, and a link to a folder above `d` (`..`: the other classes) not at all: walked round, a
    loop gave each image some 40 times (until the links' nesting limit), and the other classes'
    images this class's label."""
    out, others, seen = [], [], {str(p) for p in Path(os.path.realpath(d)).parents}
    for top, dirs, names in os.walk(d, followlinks=True, onerror=_unreadable):
        real = os.path.realpath(top)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = [n for n in dirs if not n.startswith(".")]
        for n in names:  # os.walk lists a link to nothing as a file: a linked folder of the class's images
            if not n.startswith("."):
                p = Path(top) / n
                _refuse_dangling(p, d.parent, p.relative_to(d.parent).as_posix(), "a folder or an image of the class")
        out += [Path(top) / n for n in names if is_image(Path(n))]
        others += [Path(top) / n for n in names if not n.startswith(".") and not is_image(Path(n))]
    return sorted(out, key=lambda p: p.relative_to(d).parts), sorted(others)


def _unreadable(e: OSError) -> None:
    """os.walk's error: a folder below a class that cannot be listed (its permissions) would
    leave its images out without a word."""
    raise ConfigError(f"images.path: cannot read the folder {e.filename} ({e.strerror})")


def _survey(root: Path, files: list[Path], path: str) -> tuple[tuple[int, int], bool]:
    """(height, width) shared by every image, and whether every one is grayscale; from the
    headers alone."""
    first = size = None
    gray = True
    for f in files:
        try:
            with _opened(f) as im:
                mode, (w, h) = im.mode, im.size
        except Exception as e:  # noqa: BLE001 - not an image, a damaged header, a decompression bomb
            raise ConfigError(f"images.path {path}: {_rel(root, f)} is not a readable image ({_why(e, f)})") from None
        if mode.startswith(WIDE):
            raise ConfigError(f"images.path {path}: {_rel(root, f)} has 16- or 32-bit pixels (Pillow mode {mode}): "
                              "a folder is read as 8-bit images; save them as 8-bit, or as a float .npz")
        if size is None:
            first, size = f, (h, w)
        elif (h, w) != size:
            raise ConfigError(f"images.path {path}: {_rel(root, f)} is {h}x{w} (height x width), {_rel(root, first)} "
                              f"is {size[0]}x{size[1]}: every image must have one size (nljax does not resize them)")
        gray = gray and mode in GRAY
    return size, gray


def _decode(root: Path, f: Path, path: str, mode: str) -> np.ndarray:
    try:
        with _opened(f) as im:
            return np.asarray(im.convert(mode))
    except Exception as e:  # noqa: BLE001 - a truncated or damaged body: one user error
        raise ConfigError(f"images.path {path}: {_rel(root, f)} is not a readable image ({_why(e, f)})") from None


@contextlib.contextmanager
def _opened(f: Path):
    """Pillow's image `f`, without its DecompressionBombWarning for an image over 89M pixels: two
    lines naming Pillow's own source before the run's (a user's large photo is no attack; one
    over 179M pixels Pillow refuses, which is named as an unreadable image)."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(f) as im:
            yield im


def _rel(root: Path, f: Path) -> str:
    return f.relative_to(root).as_posix()


def _why(e: Exception, f: Path) -> str:
    """Pillow's reason, without the full path it repeats ("cannot identify image file '/a/b.png'")."""
    why = first_line(e).replace(f" {str(f)!r}", "").replace(f" {str(f)}", "")
    return why or type(e).__name__
