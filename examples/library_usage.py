"""Using nljax as a library: build a run from a config, step it with the Conductor, and read what
the compiled step communicates. Runs from any directory (the config is a packaged one, by name).

    python examples/library_usage.py            # 8 emulated CPU devices, mesh 2 x 4

(To use a model once it is trained, see examples/python_api.py: `nljax.load`.)
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before anything asks for devices
jax.config.update("jax_platforms", "cpu")

import numpy as np  # noqa: E402

from nljax import config  # noqa: E402
from nljax.engine.conductor import Conductor  # noqa: E402
from nljax.measure.comm import comm_per_step, format_report  # noqa: E402
from nljax.run.core import Run  # noqa: E402

cfg = config.load("nl_default", ["mesh.inter=2", "cms.periods=[1,4,16]", "train.seq_len=64", "model.dim=64"])
run = Run.create(cfg)
state, conductor = run.init_state(), Conductor(cfg.cms.periods)
for _ in range(20):
    pulse = conductor.pulse
    state, metrics, _ = run.cache.train(pulse.active, state, run.batch(pulse.step))
    conductor = conductor.advance()
    # the step's loss leaves as per-device sums and token counts: the mean is their ratio
    loss = float(np.sum(np.asarray(metrics["loss_sum"])) / np.sum(np.asarray(metrics["count"])))
    print(f"step {pulse.step:3d} {pulse.name:<8} loss {loss:.3f}")
print(run.evaluate(run.model_params(state)))  # the parameters, or their moving average (optim.ema_decay)
print(format_report(comm_per_step(run.cache, state, run.batch(0))))
