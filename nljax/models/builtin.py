"""nljax's own models, registered through the same `register_model` a plugin calls.

| name      | model                                                      | section         | task   |
|-----------|------------------------------------------------------------|-----------------|--------|
| `nl_lm`   | attention + neural memory + CMS chains (models/nl_lm.py)    | `model.nl_lm.*` | text   |
| `cms_mlp` | embedding + CMS chains, position-wise (models/cms_mlp.py)  | shared keys     | text   |
| `dit`     | DiT denoiser trained by MeanFlow (models/dit.py)           | `model.dit.*`   | images |
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from nljax.data.images import load
from nljax.data.recall import attention_reach
from nljax.errors import ConfigError
from nljax.models import attention as attention_form
from nljax.models import embedding, memory_forms, platform
from nljax.models.base import Model
from nljax.models.cms_mlp import CMSMLP
from nljax.models.dit import DiT, DiTConfig, DiTNet
from nljax.models.nl_lm import NLLM, NLNet, NlLmConfig
from nljax.models.specs import register_model

Config = Any  # nljax.config.Config (not imported: nljax.config imports the sections registered here)


def cms_mlp(cfg: Config) -> Model:
    m = cfg.model
    return CMSMLP(m.vocab_size, m.dim, m.dim * m.hidden_mult, m.depth, len(cfg.cms.periods))


def check_cms_mlp(cfg: Config) -> None:
    if cfg.model.remat == "block":
        raise ConfigError("model.remat=block recomputes nl_lm's and dit's blocks; cms_mlp has none to recompute")
    if cfg.model.dtype != "float32":  # cms_mlp takes no dtype: it trained in float32 without a word
        raise ConfigError(f"model.dtype={cfg.model.dtype} is nl_lm's and dit's compute dtype; cms_mlp computes in "
                          "float32")


def nl_lm(cfg: Config) -> Model:
    m, nl = cfg.model, cfg.model.nl_lm
    memory = dict(heads=nl.memory_heads, dk=nl.memory_dim, hidden=nl.memory_hidden, kind=nl.memory_kind,
                  chunk=nl.memory_chunk, lr_max=nl.memory_lr_max, conv=nl.memory_conv, out_norm=nl.memory_out_norm,
                  out_gate=nl.memory_out_gate, unroll=nl.memory_unroll, impl=nl.memory_impl)
    # the backend-dependent choices are made here, after the devices are set up, once per build
    # (on a GPU, attention `auto` compiles a fused form alone before it takes it: nljax/models/compiles.py)
    if nl.memory_layers:
        memory["impl"] = memory_forms.select(nl.memory_impl, nl.memory_kind, nl.memory_chunk, nl.memory_dim,
                                             nl.memory_hidden)
    attention = attention_form.resolve(nl.attention, m.dtype, m.dim // m.heads, platform.on_cuda(), nl.window)
    embed_grad = embedding.resolve(nl.embed_grad, m.vocab_size, platform.backend())
    return NLLM(NLNet(m.vocab_size, m.dim, m.dim * m.hidden_mult, m.depth, len(cfg.cms.periods), m.heads, nl.window,
                      tuple(nl.memory_layers), memory, jnp.dtype(m.dtype), m.remat, memory_embed=nl.memory_embed,
                      scan=nl.scan_layers, attention=attention, embed_grad=embed_grad, loss_chunk=nl.loss_chunk))


GPU_ONLY_FORMS = {"attention": ("cudnn", "pallas"), "memory_impl": ("pallas", "parallel_pallas")}  # model.nl_lm.*


def interpreted(cfg: Config, model: Model) -> list[str]:
    """The start-up's note for each Pallas form `cfg` names that runs interpreted here (not on a
    GPU): the run trains by it as asked, only slowly (cudnn is refused here instead). Another
    `model` than nl_lm's reads none of them: no note."""
    if not isinstance(model, NLLM) or platform.backend() == "gpu":
        return []
    nl = cfg.model.nl_lm
    return [f"note: model.nl_lm.{k}={getattr(nl, k)} is a GPU kernel: on {platform.backend()} it runs in Pallas's "
            "interpret mode, slowly (for checking; auto takes the forms that run here)"
            for k in GPU_ONLY_FORMS if "pallas" in getattr(nl, k)]


def for_this_backend(cfg: Config, keep=()) -> Config:
    """`cfg` with the GPU forms it names (model.nl_lm.attention cudnn or pallas, memory_impl
    pallas or parallel_pallas) as `auto` when the platform (`platform.backend()`) is not a GPU: a model trained on a GPU and read for
    inference elsewhere (generate, lm_eval, nljax.load, an export) computes the same outputs by
    the forms that run here (cuDNN does not run on a CPU; the Pallas kernels only interpreted,
    slowly). `keep`: the dotted keys a user set, left as they are."""
    nl = getattr(cfg.model, "nl_lm", None)
    if platform.backend() == "gpu" or nl is None:
        return cfg
    portable = {k: "auto" for k, forms in GPU_ONLY_FORMS.items()
                if getattr(nl, k) in forms and f"model.nl_lm.{k}" not in keep}
    if not portable:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, nl_lm=dataclasses.replace(nl, **portable)))


def check_nl_lm(cfg: Config) -> None:
    m, nl = cfg.model, cfg.model.nl_lm
    nl.check_with(m.dim, m.heads, m.depth)
    if nl.memory_layers and cfg.train.seq_len % nl.memory_chunk:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} must be a multiple of model.nl_lm.memory_chunk="
                          f"{nl.memory_chunk}")
    # the conv pads each window with zeros: a tap beyond train.seq_len only ever reads padding (and
    # every tap is one traced term: a kernel of 10^13 never finished building the step)
    if nl.memory_layers and nl.memory_conv > cfg.train.seq_len:
        raise ConfigError(f"model.nl_lm.memory_conv={nl.memory_conv:,} is longer than train.seq_len="
                          f"{cfg.train.seq_len}: its taps beyond the window read only zero padding")


def nl_lm_flops(cfg: Config, model: Model, param_shapes) -> dict:
    """Attention over min(window, seq_len) tokens, and the neural memory's inner loop (an estimate:
    nljax.measure.flops)."""
    nl = cfg.model.nl_lm
    h, d, hid = nl.memory_heads, nl.memory_dim, nl.memory_hidden
    per_layer = 48.0 * h * d * hid if nl.memory_kind == "mlp" else 24.0 * h * d * d
    return {"context": min(nl.window, cfg.train.seq_len), "inner_memory_per_token": per_layer * len(nl.memory_layers)}


def dit(cfg: Config, shape: tuple[int, int, int] | None = None, num_classes: int | None = None,
        classes: tuple[str, ...] | None = None) -> Model:
    """The DiT of `cfg` for images of `shape` (H, W, C) with `num_classes` labels (0: none), named
    `classes` where the data name them (a folder's class subfolders), as its data decide them
    (read from the data when not given; an export records them: `nljax.load_model` reads no data)."""
    if shape is None or num_classes is None:
        data = load(cfg.images)  # the data decide the image shape and the label count
        shape, num_classes, classes = data.shape, data.num_classes, data.classes
    m = cfg.model
    h, w, _ = shape
    patch = m.dit.patch_size
    if h % patch or w % patch:
        raise ConfigError(f"model.dit.patch_size={patch} does not divide the {h}x{w} images")
    mf = cfg.meanflow
    n_classes = num_classes if mf.class_cond else 0
    if not n_classes and (mf.cfg_omega != 1.0 or mf.cfg_kappa != 0.0):
        why = "meanflow.class_cond=false" if not mf.class_cond else "the images have no labels"
        raise ConfigError(f"meanflow.cfg_omega={mf.cfg_omega}, cfg_kappa={mf.cfg_kappa} guide by labels, and {why}: "
                          "leave them at 1, 0")
    names = tuple(classes) if classes is not None and n_classes else None  # unconditional: no label to name
    return DiT(DiTNet(tuple(shape), patch, m.dim, m.depth, m.heads, m.dim * m.hidden_mult, n_classes,
                      dtype=jnp.dtype(m.dtype), remat=m.remat), mf, cfg.seed, classes=names)


def dit_record(model: Model) -> dict:
    """What the DiT's data decided, for an export's config.json and every checkpoint: the image
    shape and the label count (0: unconditional), so that `nljax.load_model` reads no data, and
    the labels' names where the data named them (`classes`: a folder's class subfolders, in label
    order; absent otherwise), so that a use of the model on data whose label k is another class
    is refused (`checkpoint.contents.check_built`)."""
    images = {"shape": list(model.net.image), "num_classes": model.net.num_classes}
    if model.classes is not None:
        images["classes"] = list(model.classes)
    return {"images": images}


def dit_rebuild(cfg: Config, info: dict) -> Model:
    images = info.get("images")  # an export written before it was recorded: read from its data
    if not images:
        return dit(cfg)
    return dit(cfg, tuple(images["shape"]), images["num_classes"], images.get("classes"))


# DiT parameters applied once per image to its conditioning vector, not to every patch token.
DIT_PER_IMAGE = ("adaln", "t_embed", "h_embed", "label_embed")


def dit_flops(cfg: Config, model: Model, param_shapes) -> dict:
    """Attention over all of an image's patches; the conditioning parameters count once per image."""
    hh, ww, _ = model.net.image
    patches = (hh // cfg.model.dit.patch_size) * (ww // cfg.model.dit.patch_size)
    return {"context": patches, "tokens_per_unit": patches,
            "per_unit_param": lambda name: any(k in name for k in DIT_PER_IMAGE)}


def check_dit(cfg: Config) -> None:
    cfg.model.dit.check_with(cfg.model.dim, cfg.model.heads)


def register() -> None:
    register_model("nl_lm", nl_lm, NlLmConfig, check=check_nl_lm, flops=nl_lm_flops,
                   reach=lambda cfg: attention_reach(cfg.model.depth, cfg.model.nl_lm.window))
    # nl_lm reads every shared key; the others say which (a key set that they do not read: a warning)
    register_model("cms_mlp", cms_mlp, check=check_cms_mlp, shared=("vocab_size", "dim", "hidden_mult", "depth"))
    register_model("dit", dit, DiTConfig, task="images", check=check_dit, describe=dit_record,
                   rebuild=dit_rebuild, flops=dit_flops,
                   shared=("dim", "hidden_mult", "depth", "heads", "dtype", "remat"))
