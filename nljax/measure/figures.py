"""Sample figures written to the run directory as PNG.

One-step samples left, multi-step right: images as a grid (its pixels made here), 2-D points as
dots (black) over the held-out points (grey); `write_samples` draws them titled and labelled with
matplotlib."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from nljax.data.images import spread
from nljax.data.imagefolder import short_list
from nljax.runtime.resultfile import temp_for


# In every samples PNG nljax writes (a PNG text chunk): `nljax.generate` replaces such a file, never
# a user's PNG of the same name
MARK = {"Software": "nljax"}


def written_by_nljax(path: Path) -> bool:
    """Whether the PNG at `path` carries `MARK` (its text chunks come before the pixels)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    return b"tEXtSoftware\x00nljax" in head


def grid(images: np.ndarray, cols: int, scale: int) -> np.ndarray:
    """Images [n, H, W, C] in [-1, 1] -> one uint8 picture, 1-pixel gaps, each pixel `scale`d."""
    n, h, w, c = images.shape
    rows = -(-n // cols)
    pix = np.clip((images + 1.0) * 127.5, 0, 255).astype(np.uint8)
    pix = pix.repeat(scale, 1).repeat(scale, 2)
    if c == 2:  # two channels (a field, grey + alpha): red and green
        pix = np.concatenate([pix, np.zeros_like(pix[..., :1])], axis=-1)
    pix = pix[..., : 1 if c == 1 else 3]  # grey, or RGB: the first three channels
    hs, ws = h * scale, w * scale
    out = np.full((rows * (hs + 1) + 1, cols * (ws + 1) + 1, pix.shape[-1]), 255, np.uint8)
    for i in range(n):
        r, k = divmod(i, cols)
        out[1 + r * (hs + 1) : 1 + r * (hs + 1) + hs, 1 + k * (ws + 1) : 1 + k * (ws + 1) + ws] = pix[i]
    return out[..., 0] if c == 1 else out


GRID_MAX = 64  # images shown per half


def shown(n: int) -> np.ndarray:
    """Which of n samples a grid shows: GRID_MAX at most, spread over them (an evaluation's are in
    the held-out images' order, a folder's class by class: the first 64 were the first class's)."""
    return spread(n, min(GRID_MAX, n))


def halves(one_step: np.ndarray, multi_step: np.ndarray):
    """Images [n, H, W, C] -> (one-step grid, multi-step grid, grid columns, cell size in pixels)."""
    pick = shown(len(one_step))
    cols = int(np.ceil(np.sqrt(len(pick))))
    scale = max(1, 64 // one_step.shape[1])
    return grid(one_step[pick], cols, scale), grid(multi_step[pick], cols, scale), cols, one_step.shape[1] * scale + 1


def write_samples(path: Path, one_step: np.ndarray, multi_step: np.ndarray, reference: np.ndarray, steps: int,
                  labels: np.ndarray | None = None, title: str = "", classes=None) -> None:
    """The samples PNG a MeanFlow run writes (samples_<step>.png, generate's grid): one-step
    samples left, multi-step (`steps` steps) right, each half titled, every image of a grid
    with its class (`labels`, when the model is conditional) in its corner; `classes`: the
    labels' names (a folder's class subfolders), those of the classes shown said in the caption."""
    from nljax.measure.plots import figure  # Agg, outside pyplot: the user's backend is left as it is

    dots = one_step.shape[1:] == (1, 1, 2)  # 2-D toy data: dots over the held-out points, no grid
    a, b, cols, cell = (None, None, 0, 0) if dots else halves(one_step, multi_step)
    h, w = (0, 0) if dots else a.shape[:2]
    fig = figure((2 * max(3.2, w / 80), max(3.2, h / 80) + 0.6))
    axes = fig.subplots(1, 2)
    for ax, pic, pts, name in zip(axes, (a, b), (one_step, multi_step),
                                  ("one step (1 network evaluation)", f"multi-step ({steps} steps)")):
        if cols:
            ax.imshow(pic, cmap="gray" if pic.ndim == 2 else None, vmin=0, vmax=255, interpolation="nearest")
        else:  # 2-D points on [-3, 3]^2
            ref, pts = reference.reshape(-1, 2), pts.reshape(-1, 2)
            ax.scatter(ref[:, 0], ref[:, 1], s=4, color="0.7", lw=0)
            ax.scatter(pts[:, 0], pts[:, 1], s=6, color="black", lw=0)
            ax.set_xlim(-3, 3)
            ax.set_ylim(-3, 3)
            ax.set_aspect("equal")
        ax.set_title(name, fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
        if cols and labels is not None:
            for i, y in enumerate(np.asarray(labels)[shown(len(one_step))]):
                r, k = divmod(i, cols)
                ax.text(k * cell + 2, r * cell + 2, str(int(y)), color="yellow", fontsize=7, va="top", ha="left",
                        bbox={"facecolor": "black", "alpha": 0.6, "pad": 0.5, "lw": 0})
    if not cols:
        fig.text(0.5, 0.02, "black: samples; grey: held-out points", ha="center", fontsize=8)
    elif labels is not None:
        key = ""
        if classes is not None:  # a number's name: the classes drawn in the grid, in label order
            drawn = sorted({int(y) for y in np.asarray(labels)[shown(len(labels))]})
            key = f" ({short_list([f'{k} {classes[k]}' for k in drawn if k < len(classes)])})"
        fig.text(0.5, 0.02, f"the number in each corner: the class the sample was drawn for{key}", ha="center",
                 fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    with warnings.catch_warnings():
        # a class name in a script the font lacks (a folder named 日本) is drawn as boxes, its
        # number still in the corners and its name in summary.json: matplotlib's warning per
        # missing character (two lines each, naming this file) said nothing more, at every evaluation
        warnings.filterwarnings("ignore", "Glyph .* missing from font", UserWarning)
        fig.tight_layout(rect=(0, 0.05, 1, 1))
        # beside it under a temporary name, renamed into place: a write cut short (Ctrl-C, a full
        # disk) leaves the earlier grid whole, not a partial PNG the next nljax.generate would
        # refuse to replace (it lacks the mark of one nljax wrote)
        temp = temp_for(path)
        try:
            fig.savefig(temp, dpi=100, metadata=MARK, format="png")
            os.replace(temp, path)
        except OSError as e:  # said of the file asked for, not of the temporary one
            raise OSError(e.errno, e.strerror, str(path)) from e
        finally:
            temp.unlink(missing_ok=True)
