"""Training steps kept as files and loaded instead of compiled (NLJAX_EXECUTABLES,
nljax/engine/executables.py): a loaded step trains exactly as the compiled one, another program
is another key, a damaged file costs a warning and a compilation, never a run, and without the
variable nothing is read or written."""

import jax
import numpy as np
import pytest
from helpers import assert_trees_equal, make, train

from nljax.bench import built
from nljax.engine import executables
from nljax.run.phases import compile_announcer

STEPS = 3  # periods [1, 2]: steps 0 and 2 run pattern L0+1, step 1 pattern L0
OVERRIDES = ["cms.periods=[1,2]"]


def trained(overrides=OVERRIDES, announced=None):
    """(the run, each step's metrics, the final state) of STEPS steps on 2 devices, as host arrays."""
    setup = make(overrides, intra=2)
    if announced is not None:
        setup.cache.announce = compile_announcer(setup.cfg.cms.periods, announced.append)
    metrics = []
    _, state = train(setup, STEPS, metrics=metrics)
    return setup, jax.device_get(metrics), jax.device_get(state)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A directory the steps of a run were written to (NLJAX_EXECUTABLES_WRITE=1), and that run's
    metrics and final state."""
    directory = tmp_path_factory.mktemp("executables")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(executables.ENV, str(directory))
        mp.setenv(executables.WRITE_ENV, "1")
        setup, metrics, state = trained()
    assert setup.cache.loaded == {}  # nothing was there to load: compiled, then written
    return directory, metrics, state


def loading_from(monkeypatch, directory):
    monkeypatch.setenv(executables.ENV, str(directory))
    monkeypatch.delenv(executables.WRITE_ENV, raising=False)


def test_a_loaded_step_trains_bit_identically_to_the_compiled_one(written, monkeypatch):
    directory, metrics, state = written
    files = sorted(directory.glob(f"*{executables.SUFFIX}"))
    assert len(files) == 2  # one per pulse pattern
    loading_from(monkeypatch, directory)

    def no_compiling(self):
        raise AssertionError("compiled although its executable was there to load")

    monkeypatch.setattr(jax.stages.Lowered, "compile", no_compiling)
    said = []
    setup, loaded_metrics, loaded_state = trained(announced=said)
    assert sorted(setup.cache.loaded.values()) == files
    assert_trees_equal(loaded_metrics, metrics)
    assert_trees_equal(loaded_state, state)
    # the run says where each variant came from, not that it compiled it: neither after (it said
    # "compiled") nor before, when it cannot know yet (it said "compiling step variant ...")
    done = [line for line in said if not line.endswith("...")]
    assert len(done) == 2 and all(line.startswith("loaded step variant") and str(directory) in line for line in done)
    assert [line for line in said if line.endswith("...")] == \
        ["building step variant 1 of 2 (pattern L0+1) ...", "building step variant 2 of 2 (pattern L0) ..."], said
    # and the bench's JSON, per pattern: its compile_s is then a load time
    assert {built(setup.cache, a, setup.batch(0)) for a in ((True, True), (True, False))} == \
        {f"loaded from {f}" for f in files}


def test_another_program_is_another_key(written, monkeypatch):
    directory, _, _ = written
    loading_from(monkeypatch, directory)
    before = set(directory.iterdir())
    setup, _, _ = trained([*OVERRIDES, "model.dim=8"])
    assert setup.cache.loaded == {}  # compiled: no file of its key
    assert set(directory.iterdir()) == before  # and none written without NLJAX_EXECUTABLES_WRITE


def test_the_key_leaves_out_flags_that_change_no_program():
    lowered = jax.jit(lambda x: x * 2).lower(np.ones(3, np.float32))
    devices = jax.devices()[:1]
    key = lambda flags: executables.key(lowered, devices, flags)
    assert key("") == key("--xla_dump_to=/tmp/a --xla_gpu_per_fusion_autotune_cache_dir=/x")
    assert key("") != key("--xla_backend_optimization_level=0")
    assert key("") != executables.key(jax.jit(lambda x: x * 3).lower(np.ones(3, np.float32)), devices, "")


def test_a_damaged_file_warns_once_and_the_step_compiles(written, tmp_path, monkeypatch, capsys):
    directory, metrics, state = written
    truncated, flipped = sorted(directory.glob(f"*{executables.SUFFIX}"))
    data = truncated.read_bytes()
    (tmp_path / truncated.name).write_bytes(data[: len(data) // 2])
    data = flipped.read_bytes()
    (tmp_path / flipped.name).write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    loading_from(monkeypatch, tmp_path)
    capsys.readouterr()
    setup, damaged_metrics, damaged_state = trained()
    assert setup.cache.loaded == {}
    warned = [line for line in capsys.readouterr().err.splitlines() if "not loaded" in line]
    assert sorted(warned) == sorted(f"nljax: {tmp_path / f.name}: not loaded (ValueError: its content does not match "
                                    "its digest (truncated or corrupted)); compiling" for f in (truncated, flipped))
    assert_trees_equal(damaged_metrics, metrics)
    assert_trees_equal(damaged_state, state)


def test_a_file_of_another_kind_or_key_is_refused_before_xla_reads_it():
    payload = b"an executable"
    assert executables.decode(executables.encode("k1", payload), "k1") == payload
    for data, why in ((b"\x80\x04 a pickle of something else", "not an nljax executable file"),
                      (executables.encode("k2", payload), "it holds the step keyed k2, not k1")):
        with pytest.raises(ValueError, match=why):
            executables.decode(data, "k1")


def test_without_the_variable_nothing_is_read_or_written(monkeypatch):
    monkeypatch.delenv(executables.ENV, raising=False)
    monkeypatch.setenv(executables.WRITE_ENV, "1")  # alone it asks nothing

    def untouched(*args, **kwargs):
        raise AssertionError("an executable file was looked for, read or written")

    for name in ("key", "load", "write", "serialize"):
        monkeypatch.setattr(executables, name, untouched)
    setup = make(OVERRIDES, intra=2)
    assert setup.cache.executables is None
    train(setup, 1)
    assert setup.cache.loaded == {}


def test_functions_are_compared_by_content_not_by_jaxs_numbering():
    """jax numbers a module's private functions, and shares one between identical call sites, by
    what the process lowered before (jax 0.11.2 defined `_where` twice in a step lowered after a
    loaded one): the same program must be the same key, another program another."""
    def module(calls, defs, target="__cudnn$fmha"):
        body = "\n".join(f"    %{i} = func.call @{c}(%arg0) : (tensor<i32>) -> tensor<i32>" for i, c in enumerate(calls))
        funcs = "".join(f"  func.func private @{name}(%arg0: tensor<i32>) -> tensor<i32> {{\n    {op}\n  }}\n"
                        for name, op in defs)
        return (f"module @m {{\n  sdy.mesh @mesh = <[\"x\"=1]>\n  func.func public @main(%arg0: tensor<i32>) {{\n{body}\n"
                f"    %c = stablehlo.custom_call @{target}(%arg0)\n  }}\n{funcs}}}\n")

    add, neg = "return %arg0 : tensor<i32> // add", "return %arg0 : tensor<i32> // neg"
    one = module(["_where", "_where_1", "_where"], [("_where", add), ("_where_1", neg)])
    renumbered = module(["_where_4", "_where_12", "_where_4"], [("_where_12", neg), ("_where_4", add)])
    duplicated = module(["_where_2", "_where_3", "_where_5"], [("_where_2", add), ("_where_3", neg), ("_where_5", add)])
    canonical = executables.canonical_names
    assert canonical(one) == canonical(renumbered) == canonical(duplicated)
    assert canonical(one) != canonical(module(["_where", "_where_1", "_where_1"], [("_where", add), ("_where_1", neg)]))
    assert canonical(one) != canonical(module(["_where", "_where_1", "_where"], [("_where", add), ("_where_1", add)]))
    assert canonical(one) != canonical(module(["_where", "_where_1", "_where"], [("_where", add), ("_where_1", neg)],
                                              target="__cudnn$fmhaBackward"))
