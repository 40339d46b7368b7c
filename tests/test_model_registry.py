"""The model registry: registration and its refusals (each one line, non-zero exit), discovery
of a model from an entry point of a package the test writes (no network: a dist-info folder
with entry_points.txt on the path), the built-in models through the same door, and no
`model.name == ...` branch in nljax outside the registry."""

from __future__ import annotations

import ast
import dataclasses
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from helpers import QUICK, ROOT, SMALL, TINY, TINY_NL, make, run_python, saved_run, train

import nljax
from nljax import config
from nljax.errors import ConfigError
from nljax.models import registry, specs
from nljax.models.cms_mlp import CMSMLP

TOY = '''
{TOP}
import dataclasses
import nljax
from nljax.models.cms_mlp import CMSMLP


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    width: int = 2  # hidden width multiplier of the toy's MLPs
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class Toy(CMSMLP):
    def level_of(self, path):
        return {LEVEL}

    def init_memory(self, rows):
        import jax.numpy as jnp
        return {MEMORY}


def build(cfg):
    m = cfg.model
    return Toy(m.vocab_size, m.dim, m.dim * cfg.model.{NAME}.width, m.depth, len(cfg.cms.periods))


def register():
    {BODY}
'''


def plugin(root: Path, name: str, level: str = "super().level_of(path)", memory: str = "{}",
           body: str | None = None, target: str = "register", top: str = "") -> Path:
    """A package `<name>_pkg` with an `nljax.models` entry point `name`, installed into `root`
    as pip would (its module and a dist-info with entry_points.txt); returns `root`."""
    root.mkdir(parents=True, exist_ok=True)
    body = body or f"nljax.register_model({name!r}, build, settings=ToyConfig)"
    source = TOY.replace("{LEVEL}", level).replace("{MEMORY}", memory).replace("{NAME}", name).replace("{BODY}", body)
    source = source.replace("{TOP}", top)
    (root / f"{name}_pkg.py").write_text(textwrap.dedent(source))
    info = root / f"{name}_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[nljax.models]\n{name} = {name}_pkg:{target}\n")
    return root


@pytest.fixture
def on_path(monkeypatch):
    """Put a plugin folder on sys.path and read the entry points again; the models it registered
    leave the registry afterwards."""
    # the registry read first: a test that read it first itself took nljax's own models out on
    # leaving, and every later test of the process failed ("unknown config key 'model.nl_lm'")
    before = set(registry.names())

    def add(root: Path) -> None:
        monkeypatch.syspath_prepend(str(root))
        registry.rediscover()

    yield add
    for name in set(specs._SPECS) - before:
        specs.unregister(name)
    registry._DONE.discard("plugins")


def cli_train(root: Path, *args: str):
    """`python -m nljax.train` with the plugin folder `root` on the path, one device."""
    return run_python("-m", "nljax.train", "--cpu-devices", "1", *QUICK, *SMALL, "train.steps=2", *args,
                      check=False, env={"PYTHONPATH": f"{ROOT}:{root}"}, timeout=300)


def one_line_error(p, *parts: str) -> None:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    for part in parts:
        assert part in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------
# The public names and the built-in models


def test_public_names_are_lazy_and_the_builtin_models_register_like_plugins():
    p = run_python("-c", "import sys, nljax; assert 'jax' not in sys.modules and 'flax' not in sys.modules; "
                         "print(nljax.register_model.__module__, nljax.Model.__module__)")
    assert p.stdout.split() == ["nljax.models.specs", "nljax.models.base"]
    assert nljax.register_model is specs.register_model
    assert {"nl_lm", "cms_mlp", "dit"} <= set(registry.names())
    assert registry.spec("nl_lm").origin == registry.spec("dit").origin == "nljax.models.builtin"
    assert registry.spec("dit").task == "images" and registry.spec("nl_lm").task == "text"
    # the model section's subsections are the registered models' settings
    fields = {f.name: f.type for f in dataclasses.fields(type(config.load(None, []).model))}
    assert fields["nl_lm"] is registry.spec("nl_lm").settings and fields["dit"] is registry.spec("dit").settings


def test_no_model_name_branch_outside_the_registry():
    """No `<...>.model.name == "x"` (or !=, in) anywhere in nljax/: what differs between models is
    declared by the model (its ModelSpec), not tested by name."""
    found = []
    for path in sorted((ROOT / "nljax").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(_is_model_name(x) for x in [node.left, *node.comparators]) \
                    and any(isinstance(x, ast.Constant) and isinstance(x.value, str) for x in [node.left, *node.comparators]):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def _is_model_name(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "name" and isinstance(node.value, ast.Attribute) \
        and node.value.attr == "model"


def test_an_unknown_model_name_is_one_line_with_the_nearest():
    with pytest.raises(ConfigError, match=r"^unknown model.name 'nl_ln' \(did you mean 'nl_lm'\?\)"):
        config.load(None, ["model.name=nl_ln"])


# ---------------------------------------------------------------------------------------------
# Registration in-process: refusals


@dataclasses.dataclass
class Mutable:
    width: int = 2


@dataclasses.dataclass(frozen=True)
class NoDefault:
    width: int


def test_refusals_of_register_model(on_path):
    build = lambda cfg: None  # noqa: E731
    with pytest.raises(ConfigError, match=r"^model 'nl_lm' is registered twice: by nljax.models.builtin and by "):
        nljax.register_model("nl_lm", build)
    with pytest.raises(ConfigError, match="must be a frozen dataclass"):
        nljax.register_model("mutable", build, settings=Mutable)
    with pytest.raises(ConfigError, match="needs a default for every field"):
        nljax.register_model("nodefault", build, settings=NoDefault)
    with pytest.raises(ConfigError, match="task must be one of text, images"):
        nljax.register_model("sound", build, task="audio")
    with pytest.raises(ConfigError, match="must be an identifier"):
        nljax.register_model("my-model", build)
    # a key of the model section: every config load after it was refused, whatever model it named
    for key in ("name", "dim"):
        with pytest.raises(ConfigError, match=rf"^model '{key}' \(.*\): its name is a key of the model section "
                                              rf"\(model.{key}\): register it under another$"):
            nljax.register_model(key, build)
    # not a function: a TypeError at the first build
    with pytest.raises(ConfigError, match=r"^model 'nobuild': build must be a function of the config that returns "
                                          r"the model, got None$"):
        nljax.register_model("nobuild", None)
    assert not {"mutable", "nodefault", "sound", "name", "dim", "nobuild"} & set(registry.names())
    config.load(None, [])  # the registry as it was


def test_shared_names_only_shared_keys_of_model(on_path):
    build = lambda cfg: None  # noqa: E731
    with pytest.raises(ConfigError, match=r"^model 'typo' \(.*\): shared names 'hedas', not a shared key of model "
                                          r"\(did you mean 'heads'\?\); they are: vocab_size, dim, hidden_mult, depth, heads, "
                                          r"dtype, remat$"):
        nljax.register_model("typo", build, shared=("dim", "hedas"))
    with pytest.raises(ConfigError, match="shared must be a list of key names, got the string 'dim'"):
        nljax.register_model("letters", build, shared="dim")
    assert not {"typo", "letters"} & set(registry.names())


def test_the_shared_keys_are_the_model_sections_own():
    """specs.SHARED_KEYS is written out (nljax.models.settings reads the registry): it must list
    ModelConfig's fields but `name`, no more and no fewer."""
    import dataclasses

    from nljax.models.settings import ModelConfig
    from nljax.models.specs import SHARED_KEYS

    assert SHARED_KEYS == tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "name")


def test_shared_keys_a_model_does_not_read_are_warned_of_once(on_path, capfd):
    """A model registered with the shared keys it reads: a run that sets another (model.heads=8 for
    a model without attention) gets one warning line naming it, once however often the model is
    built; nothing is said of keys left at their defaults, nor for a model that declared nothing
    (it may read any), nor for nl_lm (it reads them all). They were accepted in silence."""
    def build(cfg):
        return CMSMLP(cfg.model.vocab_size, cfg.model.dim, cfg.model.dim * cfg.model.hidden_mult, cfg.model.depth,
                      len(cfg.cms.periods))

    nljax.register_model("reads_four", build, shared=("vocab_size", "dim", "hidden_mult", "depth"))
    nljax.register_model("says_nothing", build)
    load = lambda *over: config.load(None, [*TINY, "cms.periods=[1,2]", *over])  # noqa: E731
    capfd.readouterr()
    for _ in range(2):  # a run builds its model more than once (Run.local, a tool's load)
        registry.build(load("model.name=reads_four", "model.heads=8", "model.dtype=bfloat16", "model.dim=32"))
    assert capfd.readouterr().err.splitlines() == [
        "nljax: warning: model.heads=8, model.dtype=bfloat16 are set, and model 'reads_four' does not read them: they "
        "change nothing (the shared keys it reads: vocab_size, dim, hidden_mult, depth)"]
    registry.build(load("model.name=reads_four", "model.dim=32"))  # at the defaults: nothing to say
    registry.build(load("model.name=says_nothing", "model.heads=8"))
    assert capfd.readouterr().err == ""
    assert registry.unread_shared(load("model.name=cms_mlp", "model.remat=none")) == ["remat"]  # nljax's own say too
    assert registry.unread_shared(load("model.name=dit", "cms.periods=[1]", "model.vocab_size=512")) == ["vocab_size"]
    assert registry.unread_shared(load("model.name=nl_lm", "train.seq_len=16", "model.heads=2", "model.remat=none",
                                       "model.dtype=bfloat16")) == []


def _bad_model(level_of=None, memory=None):
    @dataclasses.dataclass(frozen=True)
    class Bad(CMSMLP):
        def level_of(self, path):
            return level_of(path) if level_of else super().level_of(path)

        def init_memory(self, rows):
            return memory(rows) if memory else {}

    return lambda cfg: Bad(cfg.model.vocab_size, cfg.model.dim, cfg.model.dim, 1, len(cfg.cms.periods))


def test_a_level_outside_the_periods_and_a_memory_without_rows_are_refused_before_allocation(on_path):
    import jax.numpy as jnp

    nljax.register_model("bad_level", _bad_model(level_of=lambda p: 2 if "cms1" in p else 0))
    nljax.register_model("bad_memory", _bad_model(memory=lambda rows: {"S": jnp.zeros((4, rows))}))
    cfg = config.load(None, [*TINY, "model.name=bad_level", "cms.periods=[1,2]"])
    with pytest.raises(ConfigError, match=r"^model 'bad_level' \((tests\.)?test_model_registry\): level_of\('block0/cms1/"
                                          r"down/bias'\) = 2, outside cms.periods \(2 levels: 0..1\)$"):
        registry.build(cfg)
    cfg = config.load(None, [*TINY, "model.name=bad_memory"])
    with pytest.raises(ConfigError, match=r"init_memory\(2\) leaf 'S' has shape \(4, 2\): the inner-loop state "
                                          r"needs the rows axis first"):
        registry.build(cfg)


def test_a_level_is_any_integer_and_only_an_integer(on_path):
    import numpy as np

    # a rule computed with numpy gives np.int64: its level 0 was refused as "outside cms.periods"
    nljax.register_model("np_level", _bad_model(level_of=lambda p: np.int64(1 if "cms1" in p else 0)))
    setup = make(["model.name=np_level", "cms.periods=[1,2]"], 1, 1)
    assert sorted(set(jax_leaves(setup.engine.level_tree))) == [0, 1]
    losses, _ = train(setup, 2)
    assert np.all(np.isfinite(losses))
    nljax.register_model("float_level", _bad_model(level_of=lambda p: 1.0 if "cms1" in p else 0))
    cfg = config.load(None, [*TINY, "model.name=float_level", "cms.periods=[1,2]"])
    with pytest.raises(ConfigError, match=r"level_of\('block0/cms1/down/bias'\) = 1.0, a float: a level is an int in "
                                          r"0..1$"):
        registry.build(cfg)


def test_a_parameter_that_is_not_a_float_is_refused_before_allocation(on_path):
    """An integer parameter (a counter in `init`'s tree) failed in jax.grad at the first step, a
    traceback from inside the engine."""
    import jax.numpy as jnp

    @dataclasses.dataclass(frozen=True)
    class Counting(CMSMLP):
        def init(self, key):
            return {**super().init(key), "seen": jnp.zeros((), jnp.int32)}

    nljax.register_model("counting", lambda cfg: Counting(cfg.model.vocab_size, cfg.model.dim, cfg.model.dim, 1,
                                                          len(cfg.cms.periods)))
    cfg = config.load(None, [*TINY, "model.name=counting"])
    with pytest.raises(ConfigError, match=r"^model 'counting' \(.*\): init's parameter 'seen' is int32: every "
                                          r"parameter is trained, and gradients need floats"):
        registry.build(cfg)


def test_an_init_that_is_not_a_function_of_its_key_is_refused_before_allocation(on_path):
    """Parameters drawn at trace time (numpy's global generator: init code ported from numpy or
    PyTorch) trained without a word: each process of a multi-process run held replicas of its
    own, and a seed did not repeat a run. A generator seeded inside init is a function of nothing
    but the code: it passes."""
    import jax.numpy as jnp

    def drawing(rng):
        @dataclasses.dataclass(frozen=True)
        class Drawing(CMSMLP):
            def init(self, key):
                params = super().init(key)
                return {**params, "gain": jnp.asarray(rng().normal(size=(4,)), jnp.float32)}

        return lambda cfg: Drawing(cfg.model.vocab_size, cfg.model.dim, cfg.model.dim, 1, len(cfg.cms.periods))

    nljax.register_model("drawing", drawing(lambda: np.random))
    with pytest.raises(ConfigError, match=r"^model 'drawing' \(.*\): init\(key\) gave two different parameter trees "
                                          r"for the same key: it must draw them from the key alone"):
        registry.build(config.load(None, [*TINY, "model.name=drawing"]))
    nljax.register_model("seeded", drawing(lambda: np.random.default_rng(0)))
    registry.build(config.load(None, [*TINY, "model.name=seeded"]))


def test_a_python_number_for_count_is_a_scalar(on_path):
    """`count = rows * seq_len`, a Python int, is a scalar as the contract asks: it trains (a
    TypeError in the step's metrics before)."""
    nljax.register_model("counted", _changing_apply(lambda s, c, m: (s, 64, m)))
    losses, _ = train(make(["model.name=counted"], 1, 1), 2)
    assert np.all(np.isfinite(losses))


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def _changing_apply(change):
    """A cms_mlp with a memory {"S": [rows, 3]} whose apply passes its outputs through `change`."""
    import jax.numpy as jnp

    @dataclasses.dataclass(frozen=True)
    class Changing(CMSMLP):
        def init_memory(self, rows):
            return {"S": jnp.zeros((rows, 3), jnp.float32)}

        def apply(self, params, memory, batch, key=None):
            return change(*super().apply(params, memory, batch, key))

    return lambda cfg: Changing(cfg.model.vocab_size, cfg.model.dim, cfg.model.dim, 1, len(cfg.cms.periods))


APPLY_MISTAKES = [
    # (apply's outputs changed so, the error line's end): a step carried such a memory into the
    # next compiled variant, where it failed inside the model (a flax parameter-shape error), or
    # failed in jax.grad: tracebacks
    (lambda s, c, m: (s, c, {"S": m["S"][:, :2]}), r"apply returned new_memory leaf 'S' of \[8, 2\] float32 "
                                                  r"where the memory it was given has \[8, 3\] float32: new_memory"),
    (lambda s, c, m: (s, c, {"S": m["S"].astype("bfloat16")}), r"apply returned new_memory leaf 'S' of "
                                                              r"\[8, 3\] bfloat16 where the memory it was given has"),
    (lambda s, c, m: (s, c, {"state": m["S"]}), r"apply returned new_memory with leaves \['state'\] where the memory "
                                               r"it was given has \['S'\]: new_memory must keep memory's structure"),
    (lambda s, c, m: (s + 0 * m["S"][:, 0], c, m), r"apply returned loss_sum of shape \(8,\): it must be a scalar"),
    (lambda s, c, m: (s, c), r"apply must return \(loss_sum, count, new_memory\), got tuple"),
]


@pytest.mark.parametrize("change, line", APPLY_MISTAKES, ids=["shape", "dtype", "structure", "loss", "pair"])
def test_what_apply_returns_is_checked_when_the_step_is_traced(on_path, change, line):
    nljax.register_model("changing", _changing_apply(change))
    setup = make(["model.name=changing"], 1, 1)
    with pytest.raises(ConfigError, match=r"^model 'changing': " + line):
        train(setup, 1)


def test_an_exception_in_a_plugins_apply_is_one_line_naming_its_line(on_path):
    """A plugin's apply raising while the step is traced (here: reading batch["mask"], which only
    an evaluation batch holds) was a traceback through the engine's and JAX's frames."""
    @dataclasses.dataclass(frozen=True)
    class Masked(CMSMLP):
        def apply(self, params, memory, batch, key=None):
            logits, memory = self.logits(params, memory, batch, key)
            return (*token_loss(logits, batch["tokens"][:, 1:], batch["mask"]), memory)

    from nljax.models.blocks import token_loss

    nljax.register_model("masked", lambda cfg: Masked(cfg.model.vocab_size, cfg.model.dim, cfg.model.dim, 1,
                                                      len(cfg.cms.periods)))
    with pytest.raises(ConfigError, match=r"^model 'masked': apply raised KeyError: 'mask' \(at .*test_model_registry"
                                          r"\.py:\d+\) \(NLJAX_TRACEBACK=1 shows the traceback\)") as e:
        train(make(["model.name=masked"], 1, 1), 1)
    assert isinstance(e.value.__cause__, KeyError)


def test_a_plugins_tensor_parallel_shard_raising_is_one_line_at_the_plugins_line(on_path):
    """The shard `tensor_parallel` gives is the model's own code, run when the engine is built: an
    exception there was a traceback. The line points at the model's own line, not at the frame
    inside JAX where the error surfaced (a shard of zero heads: JAX's initializer divides by 0)."""
    import jax.numpy as jnp

    @dataclasses.dataclass(frozen=True)
    class Sharded(CMSMLP):
        def tensor_parallel(self, m, axis):
            return dataclasses.replace(self, dim=0)

        def init(self, key):
            return {"w": jax.nn.initializers.lecun_normal()(key, (self.dim, 4), jnp.float32)}

        def level_of(self, path):
            return 0

    nljax.register_model("sharded", lambda cfg: Sharded(cfg.model.vocab_size, cfg.model.dim, cfg.model.dim, 1,
                                                        len(cfg.cms.periods)))
    with pytest.raises(ConfigError, match=r"^model 'sharded' \(.*\): its tensor_parallel\(2, ...\) shard raised "
                                          r"ZeroDivisionError: .* \(at .*test_model_registry\.py:\d+\) \(NLJAX_TRACEBACK"):
        make(["model.name=sharded", "cms.periods=[1]"], 1, 1, 2)


def test_a_plugins_checks_raising_are_one_line(on_path):
    """The rules a plugin registers raising something else than a ConfigError (a typo's
    AttributeError in check(cfg), an `assert` in its settings' check()) were tracebacks from
    inside the config's validation, on every load."""
    def check(cfg):
        return cfg.model.dimm  # a typo

    nljax.register_model("checking", _bad_model(), check=check)
    with pytest.raises(ConfigError, match=r"^model 'checking' \(.*\): its check\(cfg\) raised AttributeError: "
                                          r"'ModelConfig' object has no attribute 'dimm' \(at .*test_model_registry"):
        config.load(None, [*TINY, "model.name=checking"])

    @dataclasses.dataclass(frozen=True)
    class Asserting:
        width: int = 2  # a width

        def check(self):
            assert self.width < 2, "width must be below 2"

    nljax.register_model("asserting", _bad_model(), settings=Asserting)
    with pytest.raises(ConfigError, match=r"^model 'asserting' \(.*\): model.asserting's check\(\) raised "
                                          r"AssertionError: width must be below 2 \(at .*test_model_registry"):
        config.load(None, [*TINY, "model.name=asserting"])


def test_token_loss_of_logits_of_another_shape_is_one_line(on_path):
    """A model's apply giving `token_loss` logits without the vocabulary axis ([B, T]: an argmax,
    a slice too many) or one position too many failed in take_along_axis, a traceback from the
    step's trace."""
    import jax.numpy as jnp

    from nljax.models.blocks import token_loss

    @dataclasses.dataclass(frozen=True)
    class Flat(CMSMLP):
        def apply(self, params, memory, batch, key=None):
            logits, memory = self.logits(params, memory, batch, key)
            return (*token_loss(logits[..., 0], batch["tokens"][:, 1:]), memory)

    nljax.register_model("flat", lambda cfg: Flat(cfg.model.vocab_size, cfg.model.dim, cfg.model.dim, 1,
                                                  len(cfg.cms.periods)))
    with pytest.raises(ConfigError, match=r"^token_loss: logits of shape \(8, \d+\) for targets of shape \(8, \d+\): "
                                          r"the logits must be \[B, T, V\], one row of V"):
        train(make(["model.name=flat"], 1, 1), 1)
    with pytest.raises(ConfigError, match=r"logits of shape \(2, 5, 7\) for targets of shape \(2, 4\)"):
        token_loss(jnp.zeros((2, 5, 7)), jnp.zeros((2, 4), jnp.int32))


@dataclasses.dataclass(frozen=True)
class NoLogits:
    """A text model without the optional `logits`: it trains and exports, but cannot generate."""

    inner: CMSMLP

    def init(self, key):
        return self.inner.init(key)

    def level_of(self, path):
        return self.inner.level_of(path)

    def init_memory(self, rows):
        return self.inner.init_memory(rows)

    def apply(self, params, memory, batch, key=None):
        return self.inner.apply(params, memory, batch, key)


def test_a_text_model_without_logits_is_refused_as_one_not_as_an_image_model(tmp_path, on_path, capsys):
    import jax

    from nljax import export, generate
    from nljax.run import trained

    build = lambda cfg: NoLogits(CMSMLP(cfg.model.vocab_size, cfg.model.dim, cfg.model.dim, 1, len(cfg.cms.periods)))
    nljax.register_model("no_logits", build)
    run_dir = tmp_path / "run"
    saved_run(run_dir, ["model.name=no_logits"], 1, 1, steps=1)
    export.export(trained.load(run_dir, devices=jax.devices()[:1]), run_dir / "export")
    for path in (run_dir, run_dir / "export"):
        lm = nljax.load(path)
        # were: "encode is for language models; model.name=no_logits makes images", and "... neither
        # makes text nor has generate()"
        for what, call in (("encode", lambda: lm.encode("a")), ("generate", lambda: lm.generate("a"))):
            with pytest.raises(ConfigError, match=rf"^{what} needs the model's logits\(\); model.name=no_logits has "
                                                  r"none \(nljax.Model: logits"):
                call()
    capsys.readouterr()
    # was: "... is the export of an image model"
    assert generate.main([f"run.dir={run_dir / 'export'}", "max_new_tokens=2"]) == 2
    err = capsys.readouterr().err
    assert "model.name=no_logits has none" in err and "image" not in err, err


def _changing_logits(change):
    """A cms_mlp whose `logits` passes its outputs through `change` (its `apply`, cms_mlp's
    own, trains as usual)."""

    @dataclasses.dataclass(frozen=True)
    class Mislabelled(CMSMLP):
        def logits(self, params, memory, batch, key=None):
            return change(*CMSMLP.logits(self, params, memory, batch, key))

        def apply(self, params, memory, batch, key=None):
            plain = CMSMLP(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
            return plain.apply(params, memory, batch, key)

    return lambda cfg: Mislabelled(cfg.model.vocab_size, cfg.model.dim, cfg.model.dim, 1, len(cfg.cms.periods))


def test_what_logits_returns_is_checked_where_it_is_read(tmp_path, on_path):
    """`logits` (read by evaluation, generation and the harness, never in training) returning the
    logits alone or [B, T] failed deep inside (an unpacking ValueError, numpy's `len()` of a
    float in the sampler), and fewer logits a token than the vocabulary scored NaN for the
    tokens past its end and never generated them: one line naming the model's class. A memory
    of none may come back as {} or None alike."""
    nljax.register_model("mislabelled", _changing_logits(lambda logits, memory: (logits, memory)))
    saved_run(tmp_path / "run", ["model.name=mislabelled"], 1, 1)
    for change, line in ((lambda l, m: l, r"must return \(logits \[B, T, V\], new_memory\), got an array of shape "
                                          r"\(1, 8, 256\)"),
                         (lambda l, m: (l[..., 0], m), r"returned logits of shape \(1, 8\) for tokens \[1, 9\]: it "
                                                       r"must be \[1, 8, V\], one row of V \(the vocabulary\) per "
                                                       r"input token"),
                         (lambda l, m: (l[..., :100], m), r"returned 100 logits a token, fewer than "
                                                          r"model.vocab_size=256 \(the token ids of the run's data\)")):
        specs.unregister("mislabelled")
        nljax.register_model("mislabelled", _changing_logits(change))
        lm = nljax.load(tmp_path / "run")
        for read in (lambda: lm.logits([[1, 2, 3]]), lambda: lm.generate("ab", max_new_tokens=2)):
            with pytest.raises(ConfigError, match=r"^model Mislabelled: logits " + line):
                read()
    # its `logits` raising: one line naming the model and the plugin's line, as its `apply` raising
    specs.unregister("mislabelled")
    nljax.register_model("mislabelled", _changing_logits(lambda logits, memory: {}["mask"]))
    lm = nljax.load(tmp_path / "run")
    for read in (lambda: lm.logits([[1, 2, 3]]), lambda: lm.generate("ab", max_new_tokens=2)):
        with pytest.raises(ConfigError, match=r"^model 'mislabelled': logits raised KeyError: 'mask' \(at "
                                              r".*test_model_registry"):
            read()
    specs.unregister("mislabelled")
    nljax.register_model("mislabelled", _changing_logits(lambda logits, memory: (logits, None)))
    assert len(nljax.load(tmp_path / "run").generate("ab", max_new_tokens=2, temperature=0)) > 0


def test_a_model_need_not_be_hashable(on_path):
    """The guide said a model is hashed as a static argument of the compiled step: the steps close
    over it instead, so a mutable dataclass (its __hash__ is None) trains as the frozen one."""

    @dataclasses.dataclass
    class Mutable:
        inner: CMSMLP
        init, level_of, init_memory, apply = NoLogits.init, NoLogits.level_of, NoLogits.init_memory, NoLogits.apply

    assert Mutable.__hash__ is None
    build = lambda cfg: CMSMLP(cfg.model.vocab_size, cfg.model.dim, cfg.model.dim, 1, len(cfg.cms.periods))
    nljax.register_model("mutable", lambda cfg: Mutable(build(cfg)))
    nljax.register_model("frozen", build)
    losses = [train(make([f"model.name={name}", "cms.periods=[1,2]"], 1, 1), 2)[0] for name in ("mutable", "frozen")]
    assert np.array_equal(*losses) and np.all(np.isfinite(losses[0]))


# ---------------------------------------------------------------------------------------------
# Discovery from an entry point


def test_a_model_from_an_installed_package_is_found_configured_and_trained(tmp_path, on_path):
    on_path(plugin(tmp_path / "site", "toy"))
    assert registry.spec("toy").origin.startswith("plugin 'toy = toy_pkg:register' of toy-pkg 0.1")
    cfg = config.load(None, [*TINY, "model.name=toy", "model.toy.width=3"])
    assert cfg.model.toy.width == 3 and config.to_dict(cfg)["model"]["toy"] == {"width": 3, "scale": 1.0}
    with pytest.raises(ConfigError, match=r"^unknown config key 'model.toy.widht' \(did you mean 'model.toy.width'\?\)$"):
        config.load(None, ["model.name=toy", "model.toy.widht=3"])
    with pytest.raises(ConfigError, match=r"^config key 'model.toy.width' must be int, got str 'wide'$"):
        config.load(None, ["model.name=toy", "model.toy.width=wide"])
    # a saved config with the plugin's section reads back
    assert config.from_dict(config.to_dict(cfg)) == cfg
    setup = make(["model.name=toy", "model.toy.width=3"], 1, 2)
    losses, _ = train(setup, 2)
    assert setup.engine.model.hidden == 3 * 16 and losses.shape == (2,) and all(losses > 0)


def test_the_command_line_trains_a_plugins_model(tmp_path):
    root = plugin(tmp_path / "site", "toy")
    p = cli_train(root, "model.name=toy", "model.toy.width=3", f"run.dir={tmp_path / 'run'}")
    assert p.returncode == 0, p.stderr
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]
    assert saved["name"] == "toy" and saved["toy"] == {"width": 3, "scale": 1.0}
    assert (tmp_path / "run" / "summary.json").is_file()


BAD_PLUGINS = [
    # (plugin(...) keywords, the error line's parts)
    # where the plugin's own code raised, at the end of the line (not importlib's or nljax's frames)
    (dict(top="import no_such_module_xyz"), ["plugin 'toy = toy_pkg:register' of toy-pkg 0.1",
                                            "failed to import: ModuleNotFoundError: No module named 'no_such_module_xyz' "
                                            "(at ", "toy_pkg.py:2)"]),
    (dict(body="1 / 0"), ["plugin 'toy = toy_pkg:register'", "failed to register: ZeroDivisionError: division by zero "
                          "(at ", "toy_pkg.py:"]),
    (dict(target="no_such_name"), ["plugin 'toy = toy_pkg:no_such_name'", "failed to import: AttributeError",
                                   "has no attribute 'no_such_name'"]),
    (dict(body="pass"), ["plugin 'toy = toy_pkg:register'", "did not register a model named 'toy'"]),
    (dict(body="nljax.register_model('nl_lm', build)"), ["model 'nl_lm' is registered twice: by nljax.models.builtin "
                                                         "and by plugin 'toy = toy_pkg:register'"]),
    (dict(level="7"), ["model 'toy' (plugin 'toy = toy_pkg:register'", "level_of('block0/cms0/down/bias') = 7, "
                                                                        "outside cms.periods (3 levels: 0..2)"]),
    (dict(memory="{'S': jnp.zeros((5,))}"), ["model 'toy' (plugin", "init_memory(2) leaf 'S' has shape (5,)",
                                             "needs the rows axis first"]),
    # the model's own code raising while it is built or checked: a traceback through nljax's frames
    (dict(body="nljax.register_model('toy', lambda cfg: 1 / 0)"),
     ["model 'toy' (plugin 'toy = toy_pkg:register'", "building it raised ZeroDivisionError: division by zero (at ",
      "toy_pkg.py:", "(NLJAX_TRACEBACK=1 shows the traceback)"]),
    (dict(level="path.no_such_method()"), ["model 'toy' (plugin", "building it raised AttributeError: 'str' object has "
                                           "no attribute 'no_such_method' (at ", "toy_pkg.py:"]),
]


@pytest.mark.parametrize("kw, parts", BAD_PLUGINS, ids=["import", "raises", "object", "silent", "twice", "level", "rows",
                                                        "build", "level_of"])
def test_a_bad_plugin_is_one_line_and_exit_2(tmp_path, kw, parts):
    p = cli_train(plugin(tmp_path / "site", "toy", **kw), "model.name=toy", f"run.dir={tmp_path / 'run'}")
    one_line_error(p, *parts)
    assert not (tmp_path / "run" / "checkpoints").exists()
    if "target" in kw:  # raised in importlib.metadata: no line of the plugin's to point at
        assert "(at " not in p.stderr, p.stderr


def test_nljax_traceback_prints_the_traceback_of_a_plugins_exception(tmp_path):
    """The one line replaces a traceback a plugin's author debugging a build may need: with
    NLJAX_TRACEBACK=1 it comes before the line, the plugin's own frame in it."""
    root = plugin(tmp_path / "site", "toy", body="nljax.register_model('toy', lambda cfg: 1 / 0)")
    p = run_python("-m", "nljax.train", "--cpu-devices", "1", *QUICK, *SMALL, "model.name=toy",
                   f"run.dir={tmp_path / 'run'}", check=False, timeout=300,
                   env={"PYTHONPATH": f"{ROOT}:{root}", "NLJAX_TRACEBACK": "1"})
    assert p.returncode == 2, p.stderr
    assert "Traceback (most recent call last)" in p.stderr and "toy_pkg.py" in p.stderr, p.stderr
    assert "The above exception was the direct cause" in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("nljax.train: error: model 'toy'"), p.stderr


def test_an_exception_in_a_models_build_is_a_config_error_caused_by_it(on_path):
    """In Python the line's ConfigError keeps the model's exception as its cause (the traceback
    shows both); nljax's own models are not wrapped: an exception there is nljax's bug."""
    nljax.register_model("raising", lambda cfg: {}["no_such_key"])
    with pytest.raises(ConfigError, match=r"^model 'raising' \(.*\): building it raised KeyError: 'no_such_key' "
                                          r"\(at .*test_model_registry.py:\d+\) \(NLJAX_TRACEBACK=1") as e:
        registry.build(config.load(None, [*TINY, "model.name=raising"]))
    assert isinstance(e.value.__cause__, KeyError)
    assert registry.spec("cms_mlp").origin.startswith("nljax.")
    with pytest.raises(KeyError), registry.plugin_code("cms_mlp"):  # nljax's own: raised as it is
        {}["no_such_key"]


def test_a_bad_plugin_is_not_blamed_on_the_config_file(tmp_path):
    # the registry is read while the file's keys are built: the line began "config file job.yaml:"
    (tmp_path / "job.yaml").write_text("model:\n  name: cms_mlp\n")
    p = cli_train(plugin(tmp_path / "site", "toy", body="1 / 0"), "--config", str(tmp_path / "job.yaml"),
                  f"run.dir={tmp_path / 'run'}")
    one_line_error(p, "nljax.train: error: plugin 'toy = toy_pkg:register'", "failed to register: ZeroDivisionError")


def test_a_plugin_named_like_a_builtin_is_refused(tmp_path):
    p = cli_train(plugin(tmp_path / "site", "cms_mlp"), f"run.dir={tmp_path / 'run'}")
    one_line_error(p, "model 'cms_mlp' is registered twice: by nljax.models.builtin and by plugin 'cms_mlp = "
                      "cms_mlp_pkg:register'")


def test_the_registered_task_decides_without_a_task_attribute(on_path):
    """An image model registered with task="images" and no `task` attribute of its own (optional
    in nljax.Model) is given the images task (it was given the text task: a traceback)."""
    from nljax.models.builtin import dit
    from nljax.run.core import Run
    from nljax.run.tasks import ImageTask

    class NoTask:  # dit's model, its `task` attribute hidden
        def __init__(self, m):
            self._m = m

        def __getattr__(self, k):
            if k == "task":
                raise AttributeError(k)
            return getattr(self._m, k)

    as_dit = lambda cfg: dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name="dit"))
    nljax.register_model("dit_notask", lambda cfg: NoTask(dit(as_dit(cfg))), task="images")
    cfg = config.load("meanflow_toy", ["model.name=dit_notask", "train.batch_size=8", "mesh.inter=1", "mesh.intra=1"])
    run = Run.create(cfg, devices=jax.devices()[:1])
    assert isinstance(run.task, ImageTask) and not hasattr(run.engine.model, "task")
    state, _, _ = run.cache.train((0,), run.init_state(), run.batch(0))
    assert np.isfinite(float(jax.device_get(state.step)))


def test_a_describe_record_is_read_as_json_and_checked_when_the_model_is_built(tmp_path):
    """`describe`'s record goes into every checkpoint and is compared with the run's at a load: a
    tuple it gives is the list a checkpoint reads back ((16, 2) != [16, 2] refused every load of
    the model's checkpoints), and what JSON cannot hold (a numpy integer) is one line when the
    model is built, not a traceback at the first checkpoint's save."""
    from nljax.checkpoint import contents

    try:
        nljax.register_model("described", lambda cfg: CMSMLP(256, 8, 8, 1, 1),
                             describe=lambda m: {"data": {"shape": (16, 2), "classes": 3}})
        cfg = config.load(None, ["model.name=described", "cms.periods=[1]"])
        here = registry.record(registry.build(cfg), "described")
        assert here == {"data": {"shape": [16, 2], "classes": 3}}
        contents.check_built(tmp_path, {"built": here}, here)  # as a checkpoint saved it: the same
        with pytest.raises(ConfigError, match=r"data.shape=\[16, 2\], this run's data give data.shape=\[8, 2\]$"):
            contents.check_built(tmp_path, {"built": here}, {"data": {"shape": [8, 2], "classes": 3}})
        specs.unregister("described")
        nljax.register_model("described", lambda cfg: CMSMLP(256, 8, 8, 1, 1),
                             describe=lambda m: {"classes": np.int64(3)})
        with pytest.raises(ConfigError, match=r"^model 'described' \(.*\): describe\(\) must give a dict of JSON "
                                              r"values .*: Object of type int64 is not JSON serializable$"):
            registry.build(cfg)
    finally:
        specs.unregister("described")


def test_the_forms_a_checkpoint_records_come_only_from_a_forms_method_giving_json():
    """`registry.forms_of` (saved with every checkpoint): nl_lm's `forms()` as it resolved here;
    a model of one's own with something else named `forms` (an attribute, a method giving what
    JSON cannot hold) records none rather than failing the first save."""

    class Attribute:
        forms = 3

    class Unwritable:
        def forms(self):
            return {"x": object()}

    assert registry.forms_of(Attribute()) is None and registry.forms_of(Unwritable()) is None
    assert registry.forms_of(object()) is None and registry.forms_of(registry.build(config.load(None, TINY))) is None
    model = registry.build(config.load(None, TINY_NL))
    assert registry.forms_of(model) == model.forms() and registry.forms_of(model)["memory_impl"] == "scan"


def test_plugins_found_in_turn_are_each_loaded_once_and_an_object_not_callable_is_named(tmp_path, on_path):
    """The entry points read again (a second package put on the path) keep the plugins loaded
    before, not taken for a second registration of their names; an entry point naming something
    that is not a function is said so, not called."""
    on_path(plugin(tmp_path / "a", "toy_a"))
    on_path(plugin(tmp_path / "b", "toy_b"))
    assert {"toy_a", "toy_b"} <= set(registry.names())
    assert registry.spec("toy_a").origin.startswith("plugin 'toy_a = toy_a_pkg:register'")
    with pytest.raises(ConfigError, match=r"plugin 'toy_c = toy_c_pkg:NOT_A_FUNCTION'.* names 3, not a function"):
        on_path(plugin(tmp_path / "c", "toy_c", target="NOT_A_FUNCTION", top="NOT_A_FUNCTION = 3"))


def test_a_notebook_cell_run_again_registers_its_model_again(on_path):
    """A notebook's cell that registers its model, run again after an edit (or a module reloaded
    and its registration called again): the new registration replaces the old, from the same
    registrant. It was "model 'cell' is registered twice: by __main__ and by __main__", which only
    a new process (a kernel restarted) got past. Another registrant's is still refused."""
    cell = {"__name__": "__main__", "nljax": nljax}  # a notebook's globals
    exec("nljax.register_model('cell', lambda cfg: 'first')", cell)
    exec("nljax.register_model('cell', lambda cfg: 'edited')", cell)
    assert registry.spec("cell").build(None) == "edited" and registry.spec("cell").origin == "__main__"
    with pytest.raises(ConfigError, match=r"^model 'cell' is registered twice: by __main__ and by test_model_registry"):
        nljax.register_model("cell", lambda cfg: "another")
    assert registry.spec("cell").build(None) == "edited"


def test_a_plugin_that_registers_as_it_is_imported_is_not_registered_again(tmp_path, on_path):
    """A module that registers its model at import (its entry point's function too): the
    function is not called a second time ("registered twice")."""
    root = plugin(tmp_path / "d", "toy_d")
    with open(root / "toy_d_pkg.py", "a") as f:
        f.write("\nregister()\n")
    on_path(root)
    assert "toy_d" in registry.names()


def test_the_line_named_is_the_innermost_of_the_models_own_code(on_path):
    """The model's build calling a helper of its own that raises: the line named is the helper's
    raise, where the error is, not the build's call of it."""
    def helper(cfg):
        raise ValueError("no such width")

    nljax.register_model("raising_deep", lambda cfg: helper(cfg))
    with pytest.raises(ConfigError) as e:
        registry.build(config.load(None, [*TINY, "model.name=raising_deep"]))
    assert f"(at {__file__}:{helper.__code__.co_firstlineno + 1})" in str(e.value), str(e.value)


def test_only_nljaxs_own_package_is_nljaxs_own():
    """A package whose name merely starts with nljax (nljax_extras) is a plugin: its errors are
    one line, not nljax's traceback."""
    s = registry.spec("cms_mlp")
    assert registry.nljax_own(s) and registry.nljax_own(dataclasses.replace(s, origin="nljax"))
    for origin in ("nljax_extras.models", "nljaxtools", "plugin 'x = nljax_extras:register'"):
        assert not registry.nljax_own(dataclasses.replace(s, origin=origin))


def test_a_describe_record_that_is_no_mapping_is_one_line(on_path):
    """`describe` giving JSON that is not a dict (a list) is refused when the model is built: a
    checkpoint's record is a dict of entries."""
    nljax.register_model("described_list", lambda cfg: CMSMLP(256, 8, 8, 1, 1), describe=lambda m: [16, 2])
    with pytest.raises(ConfigError, match=r"^model 'described_list' \(.*\): describe\(\) must give a dict, got list$"):
        registry.build(config.load(None, ["model.name=described_list", "cms.periods=[1]"]))


def test_a_forms_record_that_is_no_mapping_is_none_and_a_task_not_registered_is_refused(on_path):
    """`forms()` giving JSON that is not a dict (a list) records nothing; a model whose `task`
    is not the one it was registered with is refused when it is built."""
    class Listed(CMSMLP):
        def forms(self):
            return ["scan"]

    class Images(CMSMLP):
        task = "images"

    assert registry.forms_of(Listed(256, 8, 8, 1, 1)) is None
    nljax.register_model("said_images", lambda cfg: Images(256, 8, 8, 1, 1))
    with pytest.raises(ConfigError, match=r"the model's task is 'images' but it was registered with task='text'"):
        registry.build(config.load(None, ["model.name=said_images", "cms.periods=[1]"]))


def test_a_bool_level_and_a_memory_of_two_rows_always_are_refused(on_path):
    """True is no level (an int to Python, a mistake here); a memory whose first axis is 2
    whatever the rows asked is no rows axis (seen at 3 rows)."""
    import jax.numpy as jnp

    nljax.register_model("bool_level", _bad_model(level_of=lambda p: "cms1" in p))
    nljax.register_model("two_rows", _bad_model(memory=lambda rows: {"S": jnp.zeros((2, 4))}))
    with pytest.raises(ConfigError, match=r"level_of\('block0/cms0/down/bias'\) = False, a bool: a level is an int"):
        registry.build(config.load(None, [*TINY, "model.name=bool_level", "cms.periods=[1,2]"]))
    with pytest.raises(ConfigError, match=r"init_memory\(3\) leaf 'S' has shape \(2, 4\)"):
        registry.build(config.load(None, [*TINY, "model.name=two_rows"]))
