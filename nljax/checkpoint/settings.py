"""Config section `checkpoint`: where, how often and how many checkpoints are kept, and what
a run resumes or takes its initial parameters from (nljax/checkpoint/lifecycle.py, initparams.py)."""

from __future__ import annotations

import dataclasses
import math

from nljax.errors import ConfigError, check_at_least


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""  # empty: <run.dir>/checkpoints
    every: int = 100  # save every N steps and at the end; 0: never save
    keep: int = 3  # newest checkpoints kept on disk
    # also keep for good every checkpoint whose step is a multiple of this (a trajectory to score
    # or fine-tune from later; Orbax's keep_period); a multiple of checkpoint.every; 0: off
    keep_every: int = 0
    # "" (fresh run) | "latest" (newest in checkpoint.dir) | a step number (that checkpoint in
    # checkpoint.dir) | a checkpoint or checkpoints directory
    resume: str = ""
    # a new run from that checkpoint's parameters only (a step, checkpoints or run directory: its
    # newest complete checkpoint): step 0, fresh optimizer state, this run's schedule and data from
    # the start; the trained parameters, not their optim.ema_decay average (kept with the optimizer
    # state); refused with a checkpoint.resume of another run's, ignored by --resume of this run
    init_params: str = ""
    async_save: bool = True  # training continues while a save is written (false: each save waits until on disk)

    def check(self) -> None:
        check_at_least("checkpoint", self, every=0, keep=1, keep_every=0)
        if self.keep_every and self.every and self.keep_every % self.every:
            # only the saves at multiples of both would be kept: fewer than asked, without a word
            raise ConfigError(f"checkpoint.keep_every={self.keep_every} is not a multiple of checkpoint.every="
                              f"{self.every}: only a checkpoint every {math.lcm(self.keep_every, self.every)} steps "
                              "would be kept for good; give a multiple of checkpoint.every")
