"""MeanFlow: the jvp target, the time convention of the samplers, and training on any mesh."""

import atexit
import dataclasses
import functools
import shutil
import tempfile

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EXACT, assert_trees_close, assert_trees_equal, make, train
from jax.sharding import PartitionSpec as P

from nljax.config import ConfigError, MeanFlowConfig, load
from nljax.config import to_dict as config_dict
from nljax.measure.energy import energy_distance
from nljax.models import meanflow
from nljax.models.dit import DiTNet
from nljax.parallel.mesh import MODEL

# ---------------------------------------------------------------------------------------------
# the jvp target


def tiny_params(net):
    """`net`'s parameters, perturbed (the zero-initialized adaLN and output layers would make u
    and du/dt vanish)."""

    @jax.jit  # one compile instead of hundreds of eager ops
    def init():
        z, t = jnp.zeros((1, *net.image)), jnp.zeros((1,))
        params = net.init(jax.random.key(0), z, t, t, jnp.zeros((1,), jnp.int32))["params"]
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(1), len(leaves))
        return jax.tree.unflatten(treedef, [p + 0.05 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])

    return init()


SMALL_DIT = ((8, 8, 3), 2, 32, 2, 4, 64, 3)  # 8x8x3 images, patch 2, dim 32, depth 2, 4 heads, hidden 64, 3 classes


def tiny_net():
    """A 4x4x1-image DiT with perturbed weights: u(z, t, r, y)."""
    net = DiTNet((4, 4, 1), 2, 16, 1, 2, 32, 3)
    params = tiny_params(net)
    return lambda z, t, r, y: net.apply({"params": params}, z, t, t - r, y)


def test_bf16_dit_tracks_float32():
    """`model.dtype=bfloat16` for the DiT: bf16 matmuls, float32 residual stream, norms, softmax
    and output. u, MeanFlow's du/dt (the jvp) and the loss's parameter gradient stay within a
    few bf16 roundings of float32's (8-bit mantissa: ~0.4% each)."""
    nets = {dt: DiTNet(*SMALL_DIT, dtype=dt) for dt in (jnp.float32, jnp.bfloat16)}
    params = tiny_params(nets[jnp.float32])
    k = jax.random.split(jax.random.key(2), 3)
    x, y = jax.random.normal(k[0], (16, 8, 8, 3)), jnp.arange(16) % 3
    keys = meanflow.example_keys(0, meanflow.TRAIN_STREAM, jnp.arange(16))
    cfg = MeanFlowConfig(r_fraction=0.5)

    def run(net):
        u_fn = lambda z, t, r, yy: net.apply({"params": params}, z, t, t - r, yy)
        z, v, t = jax.random.normal(k[1], x.shape), jax.random.normal(k[2], x.shape), jnp.linspace(0.1, 0.9, 16)
        u, _, dudt = meanflow.meanflow_target(u_fn, z, t, 0.5 * t, v, y)

        def loss(p):
            f = lambda z, t, r, yy: net.apply({"params": p}, z, t, t - r, yy)
            return jnp.sum(meanflow.meanflow_loss(f, x, y, keys, cfg, 3))

        return u, dudt, jax.grad(loss)(params)

    (u32, d32, g32), (u16, d16, g16) = (jax.jit(lambda n=n: run(n))() for n in nets.values())
    assert u16.dtype == d16.dtype == jnp.float32  # the output is float32 whatever the compute dtype
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a))
    assert 0 < rel(u32, u16) < 1e-2 and 0 < rel(d32, d16) < 1e-2  # measured: 0.4% each
    flat32, flat16 = (jnp.concatenate([g.ravel() for g in jax.tree.leaves(g)]) for g in (g32, g16))
    # measured: 0.45% (jaxlib 0.10.2), 1.30% (0.11.2, whose XLA:CPU sums bf16 products' gradients
    # in bf16 longer: test_precision's dense_dot case): both far from a dtype error's
    assert 0 < rel(flat32, flat16) < 2e-2


def test_jvp_du_dt_matches_finite_differences():
    u_fn = tiny_net()
    k = jax.random.split(jax.random.key(2), 2)
    z, v = jax.random.normal(k[0], (4, 4, 4, 1)), jax.random.normal(k[1], (4, 4, 4, 1))
    t = jnp.array([0.9, 0.6, 0.5, 0.3])
    r = jnp.array([0.1, 0.6, 0.2, 0.0])
    y = jnp.array([0, 1, 2, 3])  # 3 is the null label
    d = 3e-4

    @jax.jit
    def run():
        u, target, dudt = meanflow.meanflow_target(u_fn, z, t, r, v, y)
        # d/dt along the trajectory: z moves with v, t with 1, r stays. Central differences at
        # d and d/2, Richardson-extrapolated (float32).
        at = lambda s, dr=0.0: u_fn(z + s * v, t + s, r + dr * s, y)
        central = lambda h, dr=0.0: (at(h, dr) - at(-h, dr)) / (2 * h)
        fd = (4 * central(d / 2) - central(d)) / 3
        moving_r = (4 * central(d / 2, 1.0) - central(d, 1.0)) / 3
        return u, target, dudt, fd, moving_r, at(0.0)

    u, target, dudt, fd, moving_r, u0 = run()
    scale = float(jnp.max(jnp.abs(dudt)))
    assert scale > 1.0, "the check needs a non-trivial du/dt"
    tol = 2e-3 * scale
    np.testing.assert_allclose(np.asarray(dudt), np.asarray(fd), atol=tol, rtol=0)
    np.testing.assert_allclose(np.asarray(u), np.asarray(u0), atol=1e-6)
    want = v - (t - r)[:, None, None, None] * dudt
    np.testing.assert_allclose(np.asarray(target), np.asarray(want), atol=1e-5)
    # the tangent of r is 0: moving r along with t (h fixed) is a derivative the check tells apart
    assert float(jnp.max(jnp.abs(moving_r - dudt))) > 5 * tol


def test_point_mass_exact_average_velocity_has_zero_loss():
    """Data = one point c: z_t = (1 - t) c + t eps, the exact average velocity is u = (z - c) / t for
    every r, and the MeanFlow target v - (t - r) du/dt must equal it (so the loss is 0)."""
    c = jnp.array([[[0.5, -1.0]]])  # [1, 1, 2]
    u_star = lambda z, t, r, y: (z - c) / t[:, None, None, None]
    cfg = MeanFlowConfig(r_fraction=1.0)
    x = jnp.broadcast_to(c, (64, 1, 1, 2))
    keys = meanflow.example_keys(0, meanflow.TRAIN_STREAM, jnp.arange(64))
    cfg = dataclasses.replace(cfg, adaptive_p=0.0)
    # a field with the wrong time convention (noise at t = 0) is not a fixed point of the target
    u_flipped = lambda z, t, r, y: (z - c) / (1 - t[:, None, None, None])
    loss, bad = jax.jit(lambda: [meanflow.meanflow_loss(u, x, None, keys, cfg) for u in (u_star, u_flipped)])()
    assert float(jnp.max(loss)) < 1e-9
    assert float(jnp.mean(bad)) > 1e-2


# Gaussian data N(mu, sigma^2): the marginal path z_t = (1-t) x + t eps is Gaussian with mean
# m_t = (1-t) mu and std s_t = sqrt((1-t)^2 sigma^2 + t^2); its flow map is affine.
MU, SIGMA = 2.0, 0.5
m_ = lambda t: (1 - t) * MU
s_ = lambda t: jnp.sqrt((1 - t) ** 2 * SIGMA**2 + t**2)


def gaussian_average_velocity(z, t, r, y):
    t, r = t[:, None], r[:, None]
    z_r = m_(r) + s_(r) / s_(t) * (z - m_(t))
    return (z - z_r) / (t - r)


def gaussian_velocity(z, t, r, y):  # instantaneous (r ignored): dm/dt + (ds/dt / s) (z - m)
    t = t[:, None]
    ds = (-(1 - t) * SIGMA**2 + t) / s_(t)
    return -MU + ds / s_(t) * (z - m_(t))


@pytest.mark.parametrize("steps", [1, 3])
def test_sampling_time_convention(steps):
    """One step z_0 = z_1 - u(z_1, t=1, r=0) maps noise exactly onto the data distribution:
    z_1 ~ N(0, 1) -> mu + sigma z_1."""
    z1 = jax.random.normal(jax.random.key(0), (256, 1))
    out = jax.jit(lambda z: meanflow.sample(gaussian_average_velocity, z, None, steps))(z1)
    np.testing.assert_allclose(np.asarray(out), np.asarray(MU + SIGMA * z1), rtol=1e-5, atol=1e-5)


def test_flow_matching_euler_sampler_follows_the_same_convention():
    z1 = jax.random.normal(jax.random.key(0), (256, 1))
    out = jax.jit(lambda z: meanflow.sample(gaussian_velocity, z, None, 200, mean_flow=False))(z1)
    np.testing.assert_allclose(np.asarray(out), np.asarray(MU + SIGMA * z1), atol=2e-2)


def test_logit_normal_times_and_r_fraction():
    cfg = MeanFlowConfig(r_fraction=0.25, label_dropout=0.1)
    draws = jax.jit(lambda i: jax.vmap(lambda k: meanflow.draw(k, (1,), cfg))(meanflow.example_keys(0, 0, i)))
    _, t, r, drop = draws(jnp.arange(8192))
    t, r, drop = map(np.asarray, (t, r, drop))
    assert (r <= t).all() and (t > 0).all() and (t < 1).all()
    assert abs((r < t).mean() - 0.25) < 0.02 and abs(drop.mean() - 0.1) < 0.02
    # median of the logit-normal t = max of two draws: above sigmoid(mu)
    assert np.median(t) > 1 / (1 + np.exp(0.4))


# ---------------------------------------------------------------------------------------------
# training on any mesh: per-example draws keyed by the global row make N devices equal 1

LR = 0.5
RUN_DIR = tempfile.mkdtemp(prefix="nljax_meanflow_")  # evaluate() writes sample PNGs here
atexit.register(shutil.rmtree, RUN_DIR, ignore_errors=True)  # made at collection: each process's own
DIT = [
    "model.name=dit", "model.dim=16", "model.depth=1", "model.heads=4", "model.hidden_mult=2", "model.dit.patch_size=1",
    "images.source=moons", "images.toy_points=80", "cms.periods=[1]", "train.batch_size=16",
    # the guided target (classifier-free guidance) and label dropout are part of what is checked
    "meanflow.cfg_omega=1.5", "meanflow.cfg_kappa=0.2", "meanflow.label_dropout=0.2", "meanflow.r_fraction=0.5",
    "optim.name=sgd", f"optim.lr={LR}", "meanflow.eval_samples=13",
]
STEPS = 5  # 64 training points / 16 rows: crosses an epoch boundary at step 4

# fsdp is the case PyTorch's MeanFlow code had to forbid (forward-mode AD through sharded
# parameters); zero1 keeps parameters replicated and is covered by tests/test_strategies.py.
STRATEGIES = ["replicated", "fsdp"]


def strategy_override(strategy):
    return [f"sync.strategy={strategy}"]


@functools.lru_cache(maxsize=None)
def trained(inter, intra, extra=(), model=1):
    """(setup, losses, the last step's gradient, final params) of STEPS SGD steps."""
    setup = make([*DIT, f"run.dir={RUN_DIR}", *extra], inter, intra, model)
    # the model's tree under any strategy
    full = lambda st: jax.device_get(setup.engine.strategy.gather_params(st.params))
    head, _ = train(setup, STEPS - 1)
    before = full(setup.state)
    # SGD: the synchronized gradient of the last step is (p_before - p_after) / lr. Not step 0's:
    # the zero-initialized adaLN and output layers give every block a zero gradient there.
    last, state = train(setup, range(STEPS - 1, STEPS))
    grads = jax.tree.map(lambda a, b: (a - b) / LR, before, full(state))
    return setup, np.concatenate([head, last]), grads, full(state)


@pytest.mark.parametrize("strategy", [pytest.param("replicated", marks=pytest.mark.slow), "fsdp"])
def test_meanflow_fsdp_matches_replicated(strategy):
    """MeanFlow loss and parameters of 8-device training under `strategy` equal 1-device replicated
    training on the same global batches (every strategy that exists; fsdp once merged). Gradients are those of
    the last step, read off the SGD update."""
    ref, ref_losses, ref_grads, ref_params = trained(1, 1)
    setup, losses, grads, params = trained(2, 4, tuple(strategy_override(strategy)))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert_trees_close(grads, ref_grads, rtol=1e-4, atol=1e-5)
    assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-5)
    # evaluation samples from the stored layout (gathered under fsdp) and scores the same
    got, want = setup.evaluate(setup.state.params, 0), ref.evaluate(ref.state.params, 0)
    assert got["eval_energy_1step"] == pytest.approx(want["eval_energy_1step"], rel=1e-4)


@pytest.mark.parametrize("shape,strategy", [((1, 2, 2), "fsdp"), pytest.param((2, 1, 4), "replicated", marks=pytest.mark.slow)])
def test_meanflow_under_tensor_parallelism_matches(shape, strategy):
    """The DiT split over `model` (heads, MLP width, adaLN outputs; nljax/parallel/tp.py) trains like one
    device with MeanFlow's loss: forward-mode jvp through the split blocks, then the gradient of
    that, under fsdp (parameters sharded over data and model) and replicated; the evaluation's
    samples come from the split model too."""
    ref, ref_losses, ref_grads, ref_params = trained(1, 1)
    setup, losses, grads, params = trained(*shape[:2], (f"sync.strategy={strategy}",), shape[2])
    assert setup.engine.tp == shape[2]
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert_trees_close(grads, ref_grads, rtol=1e-4, atol=1e-5)
    assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-5)
    specs = jax.tree_util.tree_leaves_with_path(setup.engine.split.params, is_leaf=lambda x: isinstance(x, P))
    split = {"/".join(k.key for k in path): tuple(s) for path, s in specs if tuple(s)}
    assert split == {"block0/adaln/kernel": (None, MODEL), "block0/adaln/bias": (MODEL,),
                     "block0/attn/qkv/kernel": (None, None, MODEL), "block0/attn/qkv/bias": (None, MODEL),
                     "block0/attn/out/kernel": (MODEL,),
                     "block0/mlp_up/kernel": (None, MODEL), "block0/mlp_up/bias": (MODEL,),
                     "block0/mlp_down/kernel": (MODEL,)}
    got, want = setup.evaluate(setup.state.params, 0), ref.evaluate(ref.state.params, 0)
    assert got["eval_energy_1step"] == pytest.approx(want["eval_energy_1step"], rel=1e-4)


def test_meanflow_accumulation_matches():
    """Micro-batches of the same rows give the same draws (keys follow the global row)."""
    _, ref_losses, _, ref_params = trained(1, 1)
    _, losses, _, params = trained(1, 2, ("train.accum_steps=2",))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-5)


def test_training_moves_and_losses_are_finite():
    # guards the comparisons above: the runs are not trivially equal
    _, losses, g, _ = trained(1, 1)
    assert np.isfinite(losses).all() and len(set(losses.tolist())) == STEPS
    # every parameter of the block moves: the gradient comparisons see the split layers
    assert min(float(np.max(np.abs(x))) for x in jax.tree.leaves(g["block0"])) > 1e-4


def test_gathered_energy_distance_equals_single_device():
    """13 samples over 8 devices (2, 2, 2, 2, 2, 2, 1, 0 real rows each): the gathered samples and
    their energy distance equal the 1-device figures."""
    one, _, _, params = trained(1, 1)
    many, _, _, _ = trained(2, 4, tuple(strategy_override(STRATEGIES[0])))
    a1, am = one.task.generate(one.engine, params, 13)
    b1, bm = many.task.generate(many.engine, params, 13)
    assert a1.shape == b1.shape == (13, 1, 1, 2)
    np.testing.assert_allclose(b1, a1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bm, am, rtol=1e-5, atol=1e-6)
    ref = one.task.data.eval_x[:13]
    assert energy_distance(b1, ref) == pytest.approx(energy_distance(a1, ref), rel=1e-5)
    # evaluate() returns both figures, and a second evaluation compiles nothing (the sampler is reused)
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _s, **_k: compiled.append(event) if event.endswith("backend_compile_duration") else None)
    e1 = one.evaluate(params, 0)
    few, _ = one.task.generate(one.engine, params, 5)  # another sample count is compiled: the listener sees it
    # 5 samples are drawn for 5 held-out images spread over the 16 (not the first 5: a folder's
    # first held-out images are its first class's), each sample keyed by its image's position
    every, _ = one.task.generate(one.engine, params, 16)
    np.testing.assert_allclose(few, every[[0, 3, 6, 9, 12]], rtol=1e-6, atol=1e-6)
    first = len(compiled)
    e2 = one.evaluate(params, 0)
    assert first > 0 and len(compiled) == first, compiled
    assert e1 == e2 and set(e1) >= {"eval_energy_1step", "eval_energy_multistep"} and e1["eval_samples"] == 13


def test_dit_needs_one_level():
    with pytest.raises(ConfigError, match=r"model.name=dit keeps every parameter at level 0"):
        load(None, ["model.name=dit", "cms.periods=[1,4]"])


def test_guidance_needs_labels():
    """The guided target mixes conditional and unconditional velocities: without labels it would
    be silently the plain target."""
    from nljax.models import build

    assert build(load(None, DIT)).conditional  # moons has labels
    with pytest.raises(ConfigError, match="cfg_omega=1.5, cfg_kappa=0.2 guide by labels, and meanflow.class_cond=false"):
        build(load(None, [*DIT, "meanflow.class_cond=false"]))
    # nor without dropped labels: the unconditional field is the null label's, never trained then
    with pytest.raises(ConfigError, match="meanflow.label_dropout=0 never trains: set it > 0"):
        load(None, [*DIT, "meanflow.label_dropout=0"])


@pytest.mark.parametrize("setting,line", [
    ("meanflow.cfg_omega=0", "config key 'meanflow.cfg_omega' must be in (0, inf), got 0.0"),
    ("meanflow.cfg_omega=-2", "config key 'meanflow.cfg_omega' must be in (0, inf), got -2.0"),
    ("meanflow.cfg_kappa=1", "config key 'meanflow.cfg_kappa' must be in [0, 1), got 1.0"),
    ("meanflow.cfg_kappa=-0.5", "config key 'meanflow.cfg_kappa' must be in [0, 1), got -0.5"),
    # each with its key and value (one line named three keys and their rules, no value)
    ("meanflow.time_sigma=0", "config key 'meanflow.time_sigma' must be in (0, inf), got 0.0"),
    ("meanflow.r_fraction=1.5", "config key 'meanflow.r_fraction' must be in [0, 1], got 1.5"),
    ("meanflow.label_dropout=1", "config key 'meanflow.label_dropout' must be in [0, 1), got 1.0"),
    ("meanflow.adaptive_p=-1", "config key 'meanflow.adaptive_p' must be in [0, inf), got -1.0"),
    ("meanflow.adaptive_c=0", "config key 'meanflow.adaptive_c' must be in (0, inf), got 0.0"),
    # at mu = -1e6 every draw of t and r was 0 (float32 sigmoid): accepted, trained on the data alone
    ("meanflow.time_mu=6", "config key 'meanflow.time_mu' must be in [-5, 5], got 6.0"),
    ("meanflow.time_mu=-1e6", "config key 'meanflow.time_mu' must be in [-5, 5], got -1000000.0"),
])
def test_meanflow_settings_out_of_range_are_refused(setting, line):
    """The effective guidance scale is omega / (1 - kappa): kappa >= 1 or omega <= 0 trained a
    meaningless target, exit 0. Each setting is named with its value."""
    with pytest.raises(ConfigError) as e:
        load(None, [*DIT, setting])
    assert str(e.value) == line
    load(None, [*DIT, "meanflow.cfg_omega=0.5", "meanflow.cfg_kappa=0.9"])  # weaker guidance, any kappa < 1
    load(None, [*DIT, "meanflow.time_mu=-5"])  # the bounds themselves are sane draws
    load(None, [*DIT, "meanflow.time_mu=5"])


def test_eval_samples_above_the_held_out_images_are_said_once():
    """meanflow.eval_samples=500 with 16 held-out images drew 16 at every evaluation in silence:
    the task's notes say so, which the trainer and nljax.evaluate print once (as they print
    eval.stream_steps' cap)."""
    from nljax.parallel.mesh import make_mesh
    from nljax.run.tasks import ImageTask

    mesh = make_mesh(1, 1, jax.devices()[:1])
    task = ImageTask(load(None, [*DIT, "meanflow.eval_samples=500"]), mesh)
    assert len(task.data.eval_x) == 16 and task.notes == [
        "note: meanflow.eval_samples=500 is more than the 16 held-out images: each evaluation draws 16 (hold out "
        "more, images.eval_fraction, for more)"]
    assert ImageTask(load(None, [*DIT, "meanflow.eval_samples=16"]), mesh).notes == []
    assert ImageTask(load(None, [*DIT, "meanflow.eval_samples=0"]), mesh).notes == []  # 0: all of them


def test_a_checkpoint_of_other_classes_or_channels_says_so():
    """Evaluating, sampling or resuming on images of other classes or channels than the
    checkpoint's named only a parameter and two shapes (label_embed/embedding (4, 16) there, (6, 16)
    here): the line now says what they mean."""
    from types import SimpleNamespace

    from nljax.checkpoint import contents
    from nljax.models.builtin import dit

    cfg = load(None, [*DIT, "meanflow.cfg_omega=1", "meanflow.cfg_kappa=0"])  # guidance: labels needed
    trained = dit(cfg, (4, 4, 3), 3)
    meta = {"config": config_dict(cfg), "model": contents.fingerprint(trained)}
    for shape, classes, why in [
        ((4, 4, 3), 5, "the checkpoint's model trained on 3 classes, these images have 5 classes"),
        ((4, 4, 3), 0, "the checkpoint's model trained on 3 classes, these images have no labels"),
        ((4, 4, 1), 3, "the checkpoint's model trained on 3-channel images, these are 1-channel"),
    ]:
        with pytest.raises(ConfigError) as e:
            contents.check_fits("ck", meta, SimpleNamespace(cfg=cfg, model=dit(cfg, shape, classes)))
        assert str(e.value).startswith("checkpoint ck is from another model: parameter ") and why in str(e.value)
    contents.check_fits("ck", meta, SimpleNamespace(cfg=cfg, model=dit(cfg, (4, 4, 3), 3)))  # the same: fits


def test_the_record_names_the_classes_and_a_use_on_others_names_the_first_that_differs():
    """A folder's class names (label k: its k-th subfolder, sorted) are recorded with the model
    (every checkpoint's `built`, an export's config.json): data whose label k is another class,
    with as many classes, were used without a word. The line names the first label that differs;
    another class count or image shape is named before the names it changes, and another channel
    count as the images', not as the output layer's shape (`check_built` runs before `check_fits`).
    Names one side lacks (an .npz's labels, a checkpoint saved before) are not compared."""
    from nljax.checkpoint import contents
    from nljax.models import registry
    from nljax.models.builtin import dit, dit_rebuild

    cfg = load(None, [*DIT, "meanflow.cfg_omega=1", "meanflow.cfg_kappa=0"])
    record = lambda *a: registry.record(dit(cfg, *a), "dit")  # noqa: E731
    meta = {"built": record((4, 4, 3), 3, ("ant", "cat", "dog"))}
    assert meta["built"] == {"images": {"shape": [4, 4, 3], "num_classes": 3, "classes": ["ant", "cat", "dog"]}}
    assert dit_rebuild(cfg, meta["built"]).classes == ("ant", "cat", "dog")  # an export's model keeps them
    assert registry.rebuild(cfg, meta["built"]).classes == ("ant", "cat", "dog")  # as the registry rebuilds it
    unconditional = load(None, [*DIT, "meanflow.cfg_omega=1", "meanflow.cfg_kappa=0", "meanflow.class_cond=false"])
    assert registry.record(dit(unconditional, (4, 4, 3), 3, ("ant", "cat", "dog")), "dit") == {
        "images": {"shape": [4, 4, 3], "num_classes": 0}}  # its labels are not read: nothing to name
    for here, line in [
        (record((4, 4, 3), 3, ("ant", "bee", "dog")),
         "images.classes[1]='cat', this run's data give images.classes[1]='bee': label 1 would stand for another "
         "class (a folder's labels are its class subfolders in sorted order, or in images.classes' order)"),
        (record((4, 4, 3), 3, ("bee", "cat", "dog")),
         "images.classes[0]='ant', this run's data give images.classes[0]='bee'"),
        (record((4, 4, 3), 2, ("ant", "dog")), "images.num_classes=3, this run's data give images.num_classes=2 "
         "(classes there, not here: 'cat')"),  # which subfolder went: the user's terms
        (record((4, 4, 3), 4, ("ant", "cat", "dog", "eel")), "images.num_classes=3, this run's data give "
         "images.num_classes=4 (classes here, not there: 'eel')"),
        # meanflow.class_cond=false on a class-conditional checkpoint: not the data's doing
        (registry.record(dit(unconditional, (4, 4, 3), 3, ("ant", "cat", "dog")), "dit"),
         "images.num_classes=3, this run's data give images.num_classes=0 (0 here: a model that reads no labels, "
         "by meanflow.class_cond=false or from images without labels)"),
        (record((4, 4, 1), 3, ("bee", "cat", "eel")),
         "images.shape=[4, 4, 3], this run's data give images.shape=[4, 4, 1] (3-channel images there, "
         "1-channel here)"),
    ]:
        with pytest.raises(ConfigError) as e:
            contents.check_built("ck", meta, here, "; then")
        assert str(e.value).startswith(f"checkpoint ck was trained on data with {line}"), e.value
        assert str(e.value).endswith("; then") and "\n" not in str(e.value)
    for same in (record((4, 4, 3), 3, ("ant", "cat", "dog")), record((4, 4, 3), 3, None)):  # None: an .npz's labels
        contents.check_built("ck", meta, same)
    contents.check_built("ck", {"built": record((4, 4, 3), 3, None)}, meta["built"])  # saved before names were kept


def test_dit_remat_is_exact_and_keeps_less():
    """`model.remat=block` on the DiT: each block recomputed from its input in the backward pass
    of MeanFlow's loss (a jvp inside): the same gradients to the bit, and the forward pass keeps a
    fraction of the activations (the residuals of jax.vjp)."""
    nets = {r: DiTNet(*SMALL_DIT, remat=r) for r in ("none", "block")}
    params = tiny_params(nets["none"])
    x, y = jax.random.normal(jax.random.key(2), (16, 8, 8, 3)), jnp.arange(16) % 3
    keys = meanflow.example_keys(0, meanflow.TRAIN_STREAM, jnp.arange(16))

    def loss(net, p):
        f = lambda z, t, r, yy: net.apply({"params": p}, z, t, t - r, yy)
        return jnp.sum(meanflow.meanflow_loss(f, x, y, keys, MeanFlowConfig(r_fraction=0.5), 3))

    g = {r: jax.jit(jax.grad(functools.partial(loss, n)), compiler_options=EXACT)(params) for r, n in nets.items()}
    assert_trees_equal(g["none"], g["block"])
    kept = {r: sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(
        jax.eval_shape(lambda p, n=n: jax.vjp(functools.partial(loss, n), p)[1], params))) for r, n in nets.items()}
    assert kept["block"] < 0.5 * kept["none"], kept


def test_bf16_dit_modulates_in_float32():
    """In bf16 the adaLN modulations (shift, scale, gate) are float32, as the residual stream
    they act on: only the blocks' big matmuls run in bf16."""
    net = DiTNet(*SMALL_DIT, dtype=jnp.bfloat16)
    params = tiny_params(DiTNet(*SMALL_DIT))
    z, t = jnp.zeros((2, 8, 8, 3)), jnp.full((2,), 0.5)
    # dtypes only: traced, not run (eager, the forward took seconds of per-op compiles)
    _, inter = jax.eval_shape(lambda p: net.apply({"params": p}, z, t, t, jnp.zeros((2,), jnp.int32),
                                                  capture_intermediates=True), params)
    outs = {"/".join(k): v for k, v in flax.traverse_util.flatten_dict(inter["intermediates"]).items()}
    mods = {k: v[0].dtype for k, v in outs.items() if "adaln" in k}
    assert len(mods) == 3 and set(mods.values()) == {jnp.dtype(jnp.float32)}, mods
    assert outs["block0/attn/qkv/__call__"][0].dtype == jnp.bfloat16


def test_the_euler_sampler_asks_for_the_instantaneous_velocity():
    """mean_flow=False (a flow-matching net, which knows r = t only): every step reads u(z, t, t);
    the MeanFlow sampler reads u(z, t, r) with r the step's end. A field that is t - r reads 0
    in the first and moves each step by (t - r)^2 in the second."""
    seen = []

    def u(z, t, r, y):
        seen.append((np.asarray(t), np.asarray(r)))
        return jnp.broadcast_to((t - r)[:, None], z.shape)

    z1 = jnp.ones((3, 2))
    np.testing.assert_array_equal(meanflow.sample(u, z1, None, 4, mean_flow=False), z1)
    assert all((t == r).all() for t, r in seen)
    np.testing.assert_allclose(meanflow.sample(u, z1, None, 4), z1 - 4 * 0.25**2, rtol=1e-6)


def test_guidance_leaves_dropped_labels_and_times_outside_its_interval_plain():
    """The guided field w v + kappa u(z, t, t | y) + (1 - w - kappa) u(z, t, t | null) replaces v
    only for kept labels and t in [cfg_t_min, cfg_t_max]; a dropped label (the unconditional
    examples) and times outside keep v."""
    cfg = MeanFlowConfig(cfg_omega=1.5, cfg_kappa=0.2, cfg_t_min=0.2, cfg_t_max=0.8)
    null = 9
    u = lambda z, t, r, y: jnp.where((y == null)[:, None], -1.0, 2.0) * jnp.ones_like(z)  # cond 2, uncond -1
    z, v = jnp.zeros((4, 3)), jnp.ones((4, 3))
    t = jnp.array([0.5, 0.5, 0.1, 0.9])
    y, dropped = jnp.array([1, 1, 1, 1]), jnp.array([False, True, False, False])
    out = meanflow.guided_velocity(u, z, t, v, y, dropped, null, cfg)
    guided = 1.5 * 1.0 + 0.2 * 2.0 + (1 - 1.5 - 0.2) * -1.0
    np.testing.assert_allclose(out[:, 0], [guided, 1.0, 1.0, 1.0], rtol=1e-6)
