"""Sample figures written to the run directory as PNG (encoded here: no imaging dependency).

Images become a grid (one-step samples left, multi-step right); 2-D points become a scatter
raster (held-out data grey, samples black)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np


def write_png(path: Path, pixels: np.ndarray) -> None:
    """8-bit greyscale [H, W] or RGB [H, W, 3] PNG."""
    pixels = np.ascontiguousarray(pixels, np.uint8)
    h, w = pixels.shape[:2]
    color = 2 if pixels.ndim == 3 else 0
    raw = b"".join(b"\0" + pixels[i].tobytes() for i in range(h))  # filter type 0 on every row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, color, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + body)


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


def scatter(points: np.ndarray, reference: np.ndarray, size: int = 256, extent: float = 3.0) -> np.ndarray:
    """2-D points (black) over reference points (grey) on a [-extent, extent]^2 canvas.  uint8 [size, size]"""
    out = np.full((size, size), 255, np.uint8)
    for pts, shade in ((reference, 180), (points, 0)):
        ij = np.round((pts.reshape(-1, 2) + extent) / (2 * extent) * (size - 1)).astype(int)
        ok = ((ij >= 0) & (ij < size)).all(axis=1)
        out[size - 1 - ij[ok, 1], ij[ok, 0]] = shade
    return out


def sample_figure(one_step: np.ndarray, multi_step: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Side-by-side picture of one-step and multi-step samples."""
    if one_step.shape[1:] == (1, 1, 2):  # 2-D toy data
        a, b = scatter(one_step, reference), scatter(multi_step, reference)
    else:
        n = min(64, len(one_step))
        cols = int(np.ceil(np.sqrt(n)))
        scale = max(1, 64 // one_step.shape[1])
        a, b = grid(one_step[:n], cols, scale), grid(multi_step[:n], cols, scale)
    gap = np.full((a.shape[0], 8) + a.shape[2:], 255, np.uint8)
    return np.concatenate([a, gap, b], axis=1)
