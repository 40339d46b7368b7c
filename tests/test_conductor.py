import pytest

from nljax.engine.conductor import MAX_LEVELS, CMSConfig, Conductor, pattern_name, pulse
from nljax.errors import ConfigError


def test_pulse_is_step_mod_period():
    periods = (1, 2, 3)
    for s in range(20):
        assert pulse(s, periods).active == (True, s % 2 == 0, s % 3 == 0)


def test_non_nested_periods_and_cycle():
    c = Conductor((1, 4, 6))
    assert c.cycle == 12
    pats = c.patterns()
    assert sum(pats.values()) == 12
    # in the order of the levels' bits, lowest first (the order reports list them in): L0, L0+1, L0+2, L0+1+2
    assert list(pats) == [(True, False, False), (True, True, False), (True, False, True), (True, True, True)]
    assert pats[(True, True, True)] == 1  # steps 0 only (lcm 12)
    assert pats[(True, False, False)] == 12 - 3 - 2 + 1


def test_advance_and_state():
    c = Conductor((1, 8))
    assert c.pulse.active == (True, True)
    c = c.advance()
    assert c.step == 1 and c.pulse.active == (True, False) and c.pulse.name == "L0"
    assert c.state_dict() == {"step": 1, "periods": [1, 8]}


def brute_force(periods):
    counts = {}
    for s in range(Conductor(periods).cycle):
        a = pulse(s, periods).active
        counts[a] = counts.get(a, 0) + 1
    return counts


def test_pattern_counts_match_walking_the_cycle():
    for periods in [(1,), (1, 2, 3), (1, 8, 64, 512), (2, 3), (1, 4, 6, 10), (3, 3, 5)]:
        assert Conductor(periods).patterns() == brute_force(periods)


def test_pattern_counts_for_a_huge_cycle_are_instant():
    c = Conductor((1, 997, 991, 983))
    pats = c.patterns()
    assert c.cycle == 997 * 991 * 983 and sum(pats.values()) == c.cycle
    assert pats[(True, True, True, True)] == 1


def test_pattern_counts_of_many_levels_are_instant():
    """Nested periods, as CMS levels are: one pattern per level however many levels (the count
    by subsets of levels took 13 s at 14 levels, hours at 20)."""
    import time

    t = time.perf_counter()
    pats = Conductor(tuple(2 ** l for l in range(40))).patterns()
    assert time.perf_counter() - t < 1.0
    assert len(pats) == 40 and sum(pats.values()) == 2 ** 39
    assert pats[(True,) * 40] == 1 and pats[(True,) + (False,) * 39] == 2 ** 38
    mixed = (1, 2, 3, 4, 6, 12, 5)
    assert Conductor(mixed).patterns() == brute_force(mixed)


def test_max_levels_is_the_most_taken():
    CMSConfig(periods=(1,) * MAX_LEVELS).check()
    with pytest.raises(ConfigError, match=f"has {MAX_LEVELS + 1} levels, more than the {MAX_LEVELS}"):
        CMSConfig(periods=(1,) * (MAX_LEVELS + 1)).check()


def test_the_default_periods_give_the_patterns_the_docs_count():
    """README and the Conductor page: the default [1, 8, 64, 512] repeat every 512 steps, in which
    L0 fires 448 times, L0+1 56, L0+1+2 7 and L0+1+2+3 once; the default job's train.steps meets
    all four, compiled in the order of their first step (variant 3 of 4 is L0+1, at step 8)."""
    from nljax.runtime.runsettings import TrainConfig

    c = Conductor(CMSConfig().periods)
    assert c.cycle == 512
    assert {pattern_name(a): n for a, n in c.patterns().items()} == {
        "L0": 448, "L0+1": 56, "L0+1+2": 7, "L0+1+2+3": 1}
    first: dict[str, int] = {}
    for s in range(TrainConfig().steps):
        first.setdefault(pulse(s, c.periods).name, s)
    assert first == {"L0+1+2+3": 0, "L0": 1, "L0+1": 8, "L0+1+2": 64}
