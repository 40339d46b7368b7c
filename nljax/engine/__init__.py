"""The SPMD engine: the Conductor and its Pulse, per-level gradient sync (flat or hierarchical),
the optimizer and its strategies (replicated, ZeRO-1, FSDP), the train state and the compiled step."""
