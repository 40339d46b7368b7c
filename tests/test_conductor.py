from nljax.conductor import Conductor, pulse


def test_pulse_is_step_mod_period():
    periods = (1, 2, 3)
    for s in range(20):
        assert pulse(s, periods).active == (True, s % 2 == 0, s % 3 == 0)


def test_non_nested_periods_and_cycle():
    c = Conductor((1, 4, 6))
    assert c.cycle == 12
    pats = c.patterns()
    assert sum(pats.values()) == 12
    assert pats[(True, True, True)] == 1  # steps 0 only (lcm 12)
    assert pats[(True, False, False)] == 12 - 3 - 2 + 1


def test_advance_and_state():
    c = Conductor((1, 8))
    assert c.pulse.active == (True, True)
    c = c.advance()
    assert c.step == 1 and c.pulse.active == (True, False) and c.pulse.name == "L0"
    assert c.state_dict() == {"step": 1, "periods": [1, 8]}
