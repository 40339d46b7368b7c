"""The environment variables `python -m nljax.launch` sets for each process it starts, read back
by nljax/runtime/distributed.py as the fallbacks of the CLI flags (--coordinator, ...). Kept in a
module of their own, free of JAX, so the launcher stays light."""

ENV_COORDINATOR = "NLJAX_COORDINATOR"
ENV_NUM_PROCESSES = "NLJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "NLJAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "NLJAX_LOCAL_DEVICE_IDS"
# the launcher's command up to its `--` (`python -m nljax.launch --nproc 2 --cpu-devices 4`): a
# run's closing resume line goes through it, with as many processes (nljax.run.phases)
ENV_LAUNCHER = "NLJAX_LAUNCHER"
