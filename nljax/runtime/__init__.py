"""The process around a run: multi-host start-up and lockstep checks, the run directory and its
lock, the records a run writes, preemption notices and the compile cache."""
