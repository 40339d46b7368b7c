"""Sliding-window attention's three forms and the choice between them (`model.nl_lm.attention`).

- `blocked`: `layers.local_attention`, queries in blocks of `window` over their block and the one
  before (scores [T / window, window, 2 * window] materialised in float32: linear in T, any
  backend, any dtype). With `model.remat` its scores are recomputed in the backward pass.
- `cudnn`: cuDNN's fused flash attention through `jax.nn.dot_product_attention(...,
  implementation="cudnn")`, its sliding window given as `local_window_size=(window - 1, 0)` with
  `is_causal=True`. The causal flag stays on: with it off, a `(L, 0)` window is passed to cuDNN as
  a left window only and the tokens after the query are seen too (jax PR #39576). No scores are
  kept (the backward pass recomputes them from the softmax's [B, H, T] statistics), so
  `model.remat=memory` does not wrap it in `jax.checkpoint`: that would run the fused forward
  twice for nothing (`model.remat=block` recomputes the whole sub-block, this call included).
- `pallas`: a Pallas flash attention (`attention_kernel.flash_attention`: an online softmax over
  only the key tiles each query tile's window touches, hand-written backward kernels; output and
  log-sum-exp kept, no scores, so `model.remat=memory` leaves it unwrapped as it does cudnn).
  Compiled through Triton on a GPU, for float32 too and head widths that are powers of two >= 16
  (`attention_kernel.gpu_unsupported`); on a CPU interpreted (slow: for checking a run).
- `auto`: on a CUDA GPU `pallas` when the kernel takes the shape and dtype, else `cudnn` when
  cuDNN does (`cudnn_refusal`), else `blocked`, each fused form only where it compiles
  (nljax/models/compiles.py); always `blocked` on a CPU, whose default job is then the program
  it always was. Pallas first because it was the faster on an H200 (2026-11-28, nl_350m's
  shapes, bf16: forward and backward 0.90 ms, cuDNN 1.06, blocked 4.07).

Scaling, masks and layout are the blocked form's: q, k, v [B, T, H, hd] (jax's [B, T, N, H]),
logits scaled by hd ** -0.5 (jax's default), token t sees t - window + 1 .. t.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nljax.errors import ConfigError
from nljax.models import compiles, platform
from nljax.models.attention_kernel import flash_attention, gpu_unsupported
from nljax.models.layers import local_attention, recomputed

CHOICES = ("auto", "blocked", "cudnn", "pallas")
CUDNN_MAX_HEAD_DIM = 128  # 256 on Hopper and later; 128 everywhere (jax's check_is_flash_attention)


def cudnn_refusal(dtype, head_dim: int) -> str | None:
    """Why cuDNN's flash attention does not take q, k, v of `dtype` with heads of `head_dim`
    (jax's own checks, fp8 aside), or None when it does."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN's flash attention takes bfloat16 or float16 inputs, not {jnp.dtype(dtype).name} (model.dtype)"
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        return (f"cuDNN's flash attention takes a head width that is a multiple of 8 and <= {CUDNN_MAX_HEAD_DIM}, "
                f"not {head_dim} (model.dim / model.heads)")
    return None


def resolve(choice: str, dtype, head_dim: int, cuda: bool, window: int = 64) -> str:
    """`blocked`, `cudnn` or `pallas` for the config's `choice` on this backend (`cuda`: a CUDA
    GPU). An explicit form that cannot run here is one line, at start-up, not a trace-time
    traceback; an explicit `pallas` off CUDA runs interpreted. `auto` on CUDA takes the first of
    the Pallas kernel and cuDNN that takes the shape and compiles here (`compiles.refusal`, at
    one row, one head and the `window`), else the blocked form."""
    if choice not in CHOICES:
        raise ConfigError(f"model.nl_lm.attention must be one of {', '.join(CHOICES)}, got '{choice}'")
    why = cudnn_refusal(dtype, head_dim) if cuda else "cuDNN runs on CUDA GPUs only, and this backend is " \
        f"{platform.backend()}"
    no_kernel = gpu_unsupported(dtype, head_dim) if cuda else None
    if choice == "cudnn" and why:
        raise ConfigError(f"model.nl_lm.attention=cudnn: {why}; use model.nl_lm.attention=auto "
                          "(a fused form where one runs, the blocked form elsewhere) or blocked")
    if choice == "pallas" and no_kernel:
        raise ConfigError(f"model.nl_lm.attention=pallas: {no_kernel}; use model.nl_lm.attention=auto "
                          "(the fastest form that takes the shape) or blocked")
    if choice == "auto":
        if not cuda:
            return "blocked"
        # the Pallas kernel first: its forward and backward took 0.90 ms against cuDNN's 1.06 ms at
        # nl_350m's shapes on an H200 (docs/benchmarks/2026-11-28-h200.md)
        fused = [f for f, refused in (("pallas", no_kernel), ("cudnn", why)) if not refused] + ["blocked"]
        for form, fallback in zip(fused, fused[1:]):
            failed = _compile_refusal(form, dtype, head_dim, window)
            if failed is None:
                return form
            compiles.warn_fallback("model.nl_lm.attention", FUSED_NAMES[form], failed, fallback)
        return "blocked"
    return choice


FUSED_NAMES = {"cudnn": "cuDNN's flash attention", "pallas": "the Pallas attention kernel"}


def _compile_refusal(form: str, dtype, head_dim: int, window: int) -> str | None:
    """Why `form`'s forward and backward do not compile here (at one row and one head), or None."""
    t = max(256, -(-2 * window // 64) * 64)  # two windows, in whole 64-token tiles
    x = jax.ShapeDtypeStruct((1, t, 1, head_dim), dtype)
    fn = functools.partial(sliding_window_attention, window=window, impl=form)
    return compiles.refusal(("attention", jnp.dtype(dtype).name, head_dim, window, form), compiles.grad_of_sum(fn),
                            (x, x, x))


def fused_local_attention(q, k, v, window: int, implementation: str = "cudnn"):
    """Causal sliding-window attention as one `jax.nn.dot_product_attention` call: what the
    `cudnn` form runs. `implementation="xla"` runs the same arguments through XLA's masked
    [T, T] form, which is how the mapping of the window is tested on a CPU."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(window - 1, 0),
                                        implementation=implementation)


def sliding_window_attention(q, k, v, window: int, impl: str = "blocked", recompute: bool = False):
    """q, k, v [B, T, H, hd] -> [B, T, H, hd] by the resolved form `impl` (blocked | cudnn |
    pallas); `recompute`: the blocked form's scores recomputed in the backward pass
    (`recomputed`; the fused forms keep no scores)."""
    if impl == "cudnn":
        return fused_local_attention(q, k, v, window)
    if impl == "pallas":
        return flash_attention(q, k, v, window)
    if impl != "blocked":
        raise ValueError(f"sliding_window_attention: impl must be blocked, cudnn or pallas, got '{impl}'")
    return recomputed(functools.partial(local_attention, window=window), recompute)(q, k, v)
