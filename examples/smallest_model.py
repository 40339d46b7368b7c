"""The smallest complete nljax model, in one file: a settings section, a flax network with a slow
CMS level, an inner-loop memory carried per stream row, the `nljax.Model` contract, and its
registration. The file registers it in its own process, then runs nljax's command of your choice:

    python examples/smallest_model.py train run.dir=runs/smallest            # the default data, CPU
    python examples/smallest_model.py train run.dir=runs/smallest --resume train.steps=400
    python examples/smallest_model.py generate run.dir=runs/smallest prompt="The "
    python examples/smallest_model.py evaluate run.dir=runs/smallest

(`python -m nljax.generate` alone would not know the model: a model lives in the process that
registers it. A package's entry point registers it in every process: docs/guides/write-your-own-model.md.)

The memory is deliberately plain, a cache: how often each token has occurred in the row's
document before this window, read as a learnt bias on the next token's logits. It shows what the
engine does for any memory: the state has the rows axis first, stays with its row on its device,
restarts where the row starts a new document (`reset`), and is checkpointed with the run. It helps
a little: over 200 steps of the default job, carried (`model.smallest.carry=true`) it lowers the
streaming held-out loss (`eval_loss_stream`) from 2.0164 to 2.0128 (seed 0) and from 2.0264 to
2.0233 (seed 1) against counting within the window only (2026-11-29, CPU).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

import nljax
from nljax.errors import ConfigError
from nljax.models.blocks import cms_level_of, token_loss


@dataclasses.dataclass(frozen=True)
class SmallestConfig:
    """The section `model.smallest.*`: what only this model reads."""

    carry: bool = True  # the cache counts the whole document (the memory); false: this window's tokens only
    hidden: int = 256  # width of the slow level's MLP

    def check(self) -> None:
        if self.hidden < 1:
            raise ConfigError(f"model.smallest.hidden={self.hidden} must be at least 1")


class SlowMLP(nn.Module):
    dim: int
    hidden: int

    @nn.compact
    def __call__(self, h):
        return nn.Dense(self.dim, name="down")(nn.gelu(nn.Dense(self.hidden, name="up")(nn.LayerNorm(name="norm")(h))))


class Net(nn.Module):
    vocab: int
    dim: int
    hidden: int

    @nn.compact
    def __call__(self, tokens, before):
        """tokens [B, T], before [B, V] (the memory: each token's count in the row's document before
        this window) -> logits [B, T, V], the counts after this window [B, V]."""
        x = nn.Embed(self.vocab, self.dim, name="embed")(tokens)
        prev = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]  # the token before: causal
        h = nn.Dense(self.dim, name="mix")(jnp.concatenate([x, prev], -1))
        # a module named cms1 is CMS level 1 (`cms_level_of`): updated every cms.periods[1] steps
        h = h + SlowMLP(self.dim, self.hidden, name="cms1")(h)
        logits = nn.Dense(self.vocab, name="out")(nn.LayerNorm(name="norm")(h))
        # a cache: what the document has said so far, up to and including each position
        counts = before[:, None] + jnp.cumsum(jax.nn.one_hot(tokens, self.vocab), axis=1)
        gain = self.param("cache_gain", nn.initializers.zeros, (self.vocab,))
        return logits + gain * jnp.log1p(counts), counts[:, -1]


@dataclasses.dataclass(frozen=True)  # frozen: the compiled steps close over the model
class Smallest:
    vocab: int
    dim: int
    hidden: int
    carry: bool

    def _net(self) -> Net:
        return Net(self.vocab, self.dim, self.hidden)

    def init(self, key):
        return self._net().init(key, jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, self.vocab)))["params"]

    def level_of(self, path: str) -> int:
        return cms_level_of(path)  # "cms1/..." -> 1, everything else (the embedding, ...) -> 0

    def init_memory(self, rows: int):
        return {"counts": jnp.zeros((rows, self.vocab), jnp.float32)}  # rows axis first: the engine splits it

    def logits(self, params, memory, batch, key=None):
        # a row whose stream starts a new document starts from an empty memory
        before = jnp.where(batch["reset"][:, None] | (not self.carry), 0.0, memory["counts"])
        logits, counts = self._net().apply({"params": params}, batch["tokens"][:, :-1], before)
        return logits, {"counts": counts}

    def apply(self, params, memory, batch, key):
        logits, new_memory = self.logits(params, memory, batch, key)
        return (*token_loss(logits, batch["tokens"][:, 1:], batch.get("mask"), batch.get("weight")), new_memory)


def build(cfg) -> Smallest:
    """The model of a whole config: the shared keys it reads and its own section."""
    return Smallest(cfg.model.vocab_size, cfg.model.dim, cfg.model.smallest.hidden, cfg.model.smallest.carry)


COMMANDS = ("train", "generate", "evaluate", "export", "bench")


def command_line(argv: list[str]) -> tuple[str, list[str]]:
    """The nljax command to run and its arguments, with this model's settings where the command
    builds a model from a config (train, bench: without them, nljax's default model). Given on the
    command line, yours win: they come after these."""
    command, rest = (argv[0], argv[1:]) if argv and argv[0] in COMMANDS else ("train", argv)
    if command not in ("train", "bench"):
        return command, rest
    # this model, in a new run and in a resume alike (the run's own name: no change); a run that
    # --resume=auto starts trained nl_lm without it
    defaults = ["model.name=smallest"]
    if not any(a in ("--resume", "--config") or a.startswith(("checkpoint.resume=", "--config=")) for a in rest):
        # a new run's levels (a resume has its run's and a --config file may set its own, which
        # these would override): two, the slow MLP's gradients wait in its error buffer and cross
        # devices every 4th step. --resume=auto gets them too: a job script's one line starts the
        # run and continues it, with the same levels both times (without them its start trained
        # cms.periods=[1,8,64,512], two levels empty)
        defaults.append("cms.periods=[1,4]")
    return command, [*defaults, *rest]


def main(argv: list[str]) -> int:
    nljax.register_model("smallest", build, settings=SmallestConfig, shared=("vocab_size", "dim"))
    command, rest = command_line(argv)
    return importlib.import_module(f"nljax.{command}").main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
