"""Every shipped nested-learning config trains at its real shapes: its first steps with one row,
its own sequence length and model, give finite losses and skip nothing.

A toy-size test proves the form; this one proves that the configs a user runs do not diverge
(they once gave NaN from step 0 at their real sizes)."""

from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import Setup, train

from nljax import config
from nljax.engine.conductor import pulse

CONFIGS = sorted(str(p) for p in config.PACKAGED.glob("*.yaml"))
# The GPU configs take minutes on the 2-core CI machine: nl_350m (348M parameters, sequence 2048;
# two steps of 4.3 TFLOP) 3.4 minutes and 14 GB, nl_gpu (98M, sequence 1024) 63 s, titans_demo
# (the CPU benchmark's 16M, batch 1 x 512) 26 s (run alone; about twice that beside the suite). They are marked `big`: the suite (`pytest -n auto
# tests`) leaves them out and `.ci/run` runs them after it (`pytest -m big tests`). Unscanned, one float32 step of nl_350m needs 22.8 GB on XLA:CPU, whose
# scheduler keeps every block's activations with or without remat (compiled memory_analysis).
BIG = {"nl_350m.yaml", "nl_gpu.yaml", "titans_demo.yaml"}
# nl_350m ships the forms fastest on a GPU (model.remat=memory, unrolled blocks); unrolled, XLA:CPU
# needs 22.8 GB already with block remat (above), more than the 24 GiB CI machine can spare beside
# the suite, and model.remat=memory keeps more; here it runs block remat and scanned layers: the same
# step at the same shapes (remat and the layer scan change how a step is computed, not what:
# tests/test_nl_model.py), as float32 stands in for its bf16. The shipped forms are traced at the real
# shapes below, without compiling.
CPU_FORMS = {"nl_350m.yaml": ["model.remat=block", "model.nl_lm.scan_layers=true"]}
NL_CONFIGS = [pytest.param(p, marks=[pytest.mark.big] if Path(p).name in BIG else [])
              for p in CONFIGS if config.load(p).model.name == "nl_lm"]


def test_every_nl_config_is_covered():
    names = {Path(p.values[0]).name for p in NL_CONFIGS}
    assert {"nl_default.yaml", "nl_gpu.yaml", "nl_350m.yaml", "titans_demo.yaml"} <= names


@pytest.mark.parametrize("path", NL_CONFIGS, ids=lambda p: Path(p).stem)
def test_first_steps_at_real_shapes(path):
    # Shapes as shipped, in float32: bf16 matmuls are emulated (slow) on CPUs, and bf16 is
    # checked against float32 in tests/test_precision.py.
    cfg = config.load(path, ["train.batch_size=1", "mesh.inter=1", "mesh.intra=1", "eval.every=0",
                             "model.dtype=float32", *CPU_FORMS.get(Path(path).name, [])])
    setup = Setup.create(cfg, devices=jax.devices()[:1])
    every_level = pulse(0, cfg.cms.periods).active  # one step variant, compiled once: every level trains
    metrics = []
    losses, state = train(setup, 2, active=every_level, metrics=metrics)  # step 1 reads the memory step 0 wrote
    for s, (loss, m) in enumerate(zip(losses, metrics, strict=True)):
        assert np.isfinite(loss) and loss < 8.0, (s, loss)  # 8 nats: far above a uniform byte model
        assert not bool(m["skipped"].addressable_data(0)), f"step {s} skipped, grad norm {m['grad_norm']}"
    for leaf in jax.tree.leaves(state.memory):
        assert bool(np.isfinite(np.asarray(leaf)).all())



@pytest.mark.parametrize("name", sorted(CPU_FORMS))
def test_the_shipped_forms_trace_at_real_shapes_with_the_same_levels(name):
    """What the real-shape check above swaps out, checked without compiling: the config as shipped
    (e.g. nl_350m's model.remat=memory and unrolled blocks) traces a gradient at its real shapes
    (one row, its sequence length), and its parameters fall into the CMS levels in the same
    numbers as the forms the check runs (the layer scan stacks them per unit; the count must not
    move)."""
    import jax.numpy as jnp

    from nljax.models import build
    from nljax.parallel import levels

    def shaped(overrides):
        cfg = config.load(str(config.PACKAGED / name), ["train.batch_size=1", *overrides])
        model = build(cfg)
        params = jax.eval_shape(model.init, jax.random.key(0))
        n = len(cfg.cms.periods)
        return cfg, model, params, levels.level_sizes(params, levels.assign(params, model.level_of, n), n)

    cfg, model, params, shipped = shaped([])
    assert shipped == shaped(CPU_FORMS[name])[3]
    memory = jax.eval_shape(lambda: model.init_memory(1))
    batch = {"tokens": jax.ShapeDtypeStruct((1, cfg.train.seq_len + 1), jnp.int32),
             "reset": jax.ShapeDtypeStruct((1,), jnp.bool_)}
    grads = jax.eval_shape(lambda p, m, b: jax.grad(lambda p: model.apply(p, m, b)[0])(p), params, memory, batch)
    assert jax.tree.map(lambda g: g.shape, grads) == jax.tree.map(lambda p: p.shape, params)

# The DiT configs train on 32x32x3 arrays the user brings (images.source=file): here random ones of
# that shape (`nljax.bench.synthetic_images`), which is all a step's shapes depend on. `big`:
# DiT-B/2 and DiT-B/4 take ~20 s each on the CI machine, DiT-XL/2 (675M parameters) 2 minutes and
# 20.4 GB resident with the config's AdamW, so it runs with SGD here (67 s, 9.6 GB), its model at
# its real shapes, to keep a margin on the 24 GB machine.
DIT_CONFIGS = [pytest.param(p, marks=[pytest.mark.big])
               for p in CONFIGS if config.load(p).model.name == "dit" and config.load(p).images.source == "file"]


def test_every_dit_config_is_covered():
    assert {"meanflow_dit_b.yaml", "meanflow_dit_b4.yaml", "meanflow_dit_xl.yaml"} <= {
        Path(p.values[0]).name for p in DIT_CONFIGS}


@pytest.mark.parametrize("path", DIT_CONFIGS, ids=lambda p: Path(p).stem)
def test_dit_first_steps_at_real_shapes(path, tmp_path):
    from nljax.bench import synthetic_images

    sgd = ["optim.name=sgd"] if Path(path).stem == "meanflow_dit_xl" else []
    cfg = config.load(path, ["train.batch_size=1", "mesh.inter=1", "mesh.intra=1", "eval.every=0",
                             "model.dtype=float32", f"run.dir={tmp_path}", *sgd])
    setup = Setup.create(synthetic_images(cfg, "32x32x3", str(tmp_path)), devices=jax.devices()[:1])
    losses, state = train(setup, 2)
    assert np.isfinite(losses).all()
    assert all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(state.params))
