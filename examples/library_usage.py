"""Using nljax as a library: build a run from a config, step it with the Conductor, and read what
the compiled step communicates.

    python examples/library_usage.py            # 8 emulated CPU devices, mesh 2 x 4
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before anything asks for devices
jax.config.update("jax_platforms", "cpu")

from nljax import config  # noqa: E402
from nljax.comm import account, format_report  # noqa: E402
from nljax.conductor import Conductor  # noqa: E402
from nljax.trainer import Setup, host_sum  # noqa: E402

cfg = config.load("configs/nl_default.yaml", ["mesh.inter=2", "cms.periods=[1,4,16]", "train.seq_len=64",
                                              "model.dim=64"])
setup = Setup.create(cfg)
state, conductor = setup.state, Conductor(cfg.cms.periods)
for _ in range(20):
    pulse = conductor.pulse
    state, metrics = setup.cache.train(pulse.active, state, setup.batch(pulse.step))
    conductor = conductor.advance()
    print(f"step {pulse.step:3d} {pulse.name:<8} loss {host_sum(metrics['loss_sum']) / host_sum(metrics['count']):.3f}")
print(setup.evaluate(state.params))
print(format_report(account(setup.cache, state, setup.batch(0))))
