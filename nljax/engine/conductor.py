"""The Conductor: which CMS levels fire at which step.

Level l is active at step s iff s % C_l == 0. The Pulse is a pure function of the step, so every
device and process computes the same one with no communication; the Conductor's only state is
the step counter, which advances after the step's gradient synchronization and is saved in
checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from nljax.errors import ConfigError

MAX_LEVELS = 64  # cms.periods: levels are a handful (the default has 4)


@dataclasses.dataclass(frozen=True)
class CMSConfig:
    """Config section `cms`: the levels' periods, and what a frozen level does with its gradients."""

    # level l updates at the steps s with s % periods[l] == 0; any order and repeats are taken (a
    # level is its position, whose parameters the model's level_of names, not its rank by period)
    periods: tuple[int, ...] = (1, 8, 64, 512)
    # a frozen level's gradients: accumulate (into a rank-local error buffer, applied when the level
    # fires) | skip (not computed); a frozen level moves zero bytes either way
    frozen_grads: Literal["accumulate", "skip"] = "accumulate"
    # What `accumulate` buffers while a level is frozen (nljax/engine/frozen.py): `gradients`, one sum
    # applied as one optimizer step at the firing; `updates`, every step's gradient, on which the
    # optimizer runs step by step at the firing (the paper's sum of per-step optimizer outputs).
    accumulate: Literal["gradients", "updates"] = "gradients"

    def check(self) -> None:
        if not self.periods or any(p < 1 for p in self.periods):
            raise ConfigError(f"cms.periods must be a non-empty list of positive integers, got {list(self.periods)[:8]}")
        if len(self.periods) > MAX_LEVELS:  # the levels' split of the parameters is quadratic in them
            raise ConfigError(f"cms.periods has {len(self.periods):,} levels, more than the {MAX_LEVELS} nljax takes")


@dataclasses.dataclass(frozen=True)
class Pulse:
    step: int
    active: tuple[bool, ...]  # one flag per level

    @property
    def active_levels(self) -> list[int]:
        return [l for l, a in enumerate(self.active) if a]

    @property
    def name(self) -> str:
        return pattern_name(self.active)


def pattern_name(active: tuple[bool, ...]) -> str:
    """Stable label of an active set, e.g. 'L0+1'."""
    return "L" + "+".join(str(l) for l, a in enumerate(active) if a) if any(active) else "none"


def pulse(step: int, periods: tuple[int, ...]) -> Pulse:
    return Pulse(step, tuple(step % p == 0 for p in periods))


@dataclasses.dataclass(frozen=True)
class Conductor:
    periods: tuple[int, ...]
    step: int = 0

    @property
    def pulse(self) -> Pulse:
        return pulse(self.step, self.periods)

    def advance(self) -> "Conductor":
        return dataclasses.replace(self, step=self.step + 1)

    @property
    def cycle(self) -> int:
        """Steps after which the pattern of pulses repeats."""
        return math.lcm(*self.periods)

    def patterns(self) -> dict[tuple[bool, ...], int]:
        """Every distinct active set over one full cycle, with how often it occurs.

        Counted without walking the cycle, which for periods like [1, 997, 991, 983] is ~10^9
        steps long. Level l fires at s iff periods[l] divides s, so the set that fires at s is
        decided by the least common multiples of sets of periods that divide s: each distinct
        active set A is the set of periods dividing m_A = lcm(A), and it fires exactly at the
        multiples of m_A where no larger such lcm (a multiple of m_A) divides s. Counted from the
        largest lcm down: cycle / m_A minus the counts of those larger ones. The work is
        quadratic in the number of distinct sets (as many as the step programs a cycle
        compiles), not exponential in the number of levels."""
        periods, cycle = self.periods, self.cycle
        lcms = {1}
        for p in periods:
            lcms |= {math.lcm(m, p) for m in lcms}
        exact: dict[int, int] = {}
        for m in sorted(lcms, reverse=True):
            exact[m] = cycle // m - sum(n for big, n in exact.items() if big % m == 0)
        counts = {tuple(m % p == 0 for p in periods): n for m, n in exact.items() if n}
        return dict(sorted(counts.items(), key=lambda kv: sum(a << l for l, a in enumerate(kv[0]))))  # L0, L0+1, ...

    def state_dict(self) -> dict:
        return {"step": self.step, "periods": list(self.periods)}
