"""Will the run fit? Bytes per device estimated before anything is allocated, against the memory
a device has; a run that cannot fit is refused with one line naming its biggest term.

Two checks, both before any array exists:

- `check_config`: from the config alone, before the model is built (so `model.dim=1e9` never
  reaches Flax or XLA): the CMS MLPs and embeddings, which every model has, and the activations'
  floor below.
- `check_engine`: once the Engine knows the exact parameter shapes (`jax.eval_shape`, nothing
  allocated): parameters, gradients, optimizer state, error buffers and inner-loop memory as the
  strategy shards them, plus the activations' floor.

Activations are a floor, not an estimate: the micro-batch's residual stream saved at every block
(input and normalized input, float32) and the logits with their log-softmax (one chunk of
tokens' under `model.nl_lm.loss_chunk`). The true need is
larger (attention, MLP hidden layers, XLA's temporaries), so a refused run certainly does not
fit, and one that passes may still run out of memory: XLA's RESOURCE_EXHAUSTED is then reported
as one line by the CLI (`nljax.cli`). A run that only uses a trained model (`nljax.load`,
generate, export, lm_eval) counts what it holds (`in_use`): no gradients, optimizer state (but
under optim.ema_decay, whose average it reads) or error buffers. Available memory: `bytes_limit` of the device's
`memory_stats()` on accelerators; on CPU the host's MemAvailable shared by its local devices.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np

from nljax.config import Config, ConfigError
from nljax.engine import frozen, optim
from nljax.models import registry

F32 = 4


def available_bytes(used: int | None = None, device=None) -> int | None:
    """Memory one of the run's devices (`device`; default: this process's first) may use, or None
    when it cannot be told (a compile-only device: benchmarks/gpu_compile.py). On CPU the host's
    memory is shared by the `used` local devices the run's mesh holds (default: all of them)."""
    dev = device or jax.local_devices()[0]
    if dev.platform != "cpu":
        try:
            stats = dev.memory_stats() or {}
        except jax.errors.JaxRuntimeError:  # a device this process compiles for but cannot hold arrays on
            return None
        return int(stats["bytes_limit"]) if "bytes_limit" in stats else None
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return free // (used or jax.local_device_count())  # emulated CPU devices share the host's memory


def _activations(cfg: Config, n_devices: int) -> int:
    m, t = cfg.model, cfg.train
    rows = max(t.batch_size // n_devices // t.accum_steps, 1)  # one micro-batch at a time
    # DiT: an image's patches are not known before the data (train.seq_len does not apply): one,
    # so that the floor stays a floor
    text = registry.task_of(cfg) == "text"
    tokens = rows * (t.seq_len if text else 1)
    # the logits: all of them, or one chunk of tokens at a time under model.nl_lm.loss_chunk
    chunk = getattr(getattr(m, "nl_lm", None), "loss_chunk", 0) if m.name == "nl_lm" else 0
    logits = (min(tokens, chunk) if chunk else tokens) * 2 * m.vocab_size if text else 0
    return (tokens * 2 * m.depth * m.dim + logits) * F32


def config_floor(cfg: Config, n_devices: int) -> dict[str, int]:
    """Bytes per device that any model of this config needs at least (Python ints: no overflow)."""
    m, c = cfg.model, cfg.cms
    # one MLP per level per block, its hidden width split over the tensor-parallel shards
    level_mlp = m.depth * 2 * m.hidden_mult * m.dim * m.dim // cfg.mesh.model
    params = (len(c.periods) * level_mlp + m.vocab_size * m.dim) * F32
    shard = n_devices if cfg.sync.strategy == "fsdp" else 1
    opt = optim.state_vectors(cfg.optim) * params
    # a frozen level's rank-local error buffer: its MLPs once, or C_l - 1 times under `updates`
    # (`frozen.width`); never sharded
    slots = lambda p: (p - 1 if c.accumulate == "updates" else 1) if p > 1 and c.frozen_grads == "accumulate" else 0
    err = sum(slots(p) for p in c.periods) * level_mlp * F32
    return {"parameters": params // shard, "gradients": params // shard,
            "optimizer state": opt // (1 if cfg.sync.strategy == "replicated" else n_devices),
            "error buffers": err, "activations (floor)": _activations(cfg, n_devices)}


def engine_terms(cfg: Config, engine) -> dict[str, int]:
    """Bytes per device from the exact parameter shapes (`engine.flats`: one device's
    tensor-parallel shard) and memory shapes."""
    n = engine.n_devices
    sizes = [engine.flats[l].size for l in range(engine.n_levels)]
    params = sum(size * F32 for size in sizes)  # flat float32 vectors per level
    shard_p = n if cfg.sync.strategy == "fsdp" else 1
    shard_o = 1 if cfg.sync.strategy == "replicated" else n
    opt = optim.state_vectors(cfg.optim) * params
    err = sum(frozen.width(engine, l) * F32 for l in range(engine.n_levels) if engine.buffered(l))
    rows = max(cfg.train.batch_size // n, 1)
    memory = jax.eval_shape(lambda: engine.local_model.init_memory(rows))  # this device's heads
    mem = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(memory))
    return {"parameters": params // shard_p, "gradients": params // shard_p, "optimizer state": opt // shard_o,
            "error buffers": err, "inner-loop memory": 2 * mem,  # this step's and the next step's
            "activations (floor)": _activations(cfg, n)}


# What a use of a trained model holds (`nljax.load`, generate, export, lm_eval): its parameters
# restored alone (`nljax.checkpoint.restore.restore_params`), no gradients, optimizer state or
# error buffers; the optimizer state too where the model is the parameters' moving average
# (optim.ema_decay), which is read from it
IN_USE = ("parameters", "inner-loop memory", "activations (floor)")


def in_use(terms: dict[str, int], average: bool = False) -> dict[str, int]:
    """The terms of `config_floor` or `engine_terms` that a use of the model needs (`IN_USE`;
    `average`: and the optimizer state)."""
    return {k: v for k, v in terms.items() if k in IN_USE or (average and k == "optimizer state")}


def check(terms: dict[str, int], available: int | None, trains: bool = True) -> None:
    """One line when the terms exceed the memory available per device; `trains`: what the line
    suggests is a training run's remedies (a load's: fewer rows or other devices)."""
    need = sum(terms.values())
    if available is None or need <= available:
        return
    gib = lambda b: f"{b / 2**30:,.1f} GiB" if b >= 2**30 else f"{b / 2**20:,.0f} MiB"
    name, biggest = max(terms.items(), key=lambda kv: kv[1])
    remedy = ("make the model, train.batch_size or train.seq_len smaller, raise train.accum_steps or use more devices"
              if trains else "the trained model does not fit this device: load it on one with more memory")
    raise ConfigError(
        f"the {'run' if trains else 'load'} needs at least {gib(need)} per device, more than the {gib(available)} "
        f"available (biggest: {name} {gib(biggest)}); {remedy}"
    )
