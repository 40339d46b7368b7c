"""Checkpoints: save, validate and restore a run's state with Orbax.

A checkpoint is one Orbax step directory `<checkpoint.dir>/<step>` (step = optimizer steps done)
holding two items:

- `state`: every array of the TrainState as a nested dict keyed by its path (`params/...`,
  `opt_state/<level>/...`, `err_buf/<level>`, `memory/...`, `step`), each a global jax.Array
  saved with the sharding it trained with. Orbax writes each shard once (replica 0 of it), so a
  replicated parameter is written once, not once per device or process, and each row's memory
  is written by the device that holds the row. Plain Orbax reads it back
  (`CheckpointManager(dir).restore(step)`).
- `nljax`: JSON metadata. The Conductor, the ContextStream and the PRNG keys are pure functions
  of (seed, step[, row or device]), so the step and the seed are their whole state; with them:
  the resolved config, the nljax version, mesh, strategy and device count, and the shape, dtype
  and checksum of every array. Nothing is pickled, on save or on restore.

Orbax writes a step into a temporary directory and renames it once every item is complete, so a
process killed at any moment, during a save too, leaves the earlier checkpoints intact, and a
resume only ever sees complete ones. A resume reads before anything is written: a bad checkpoint
stops the run with one line and leaves every file as it was, except that `latest` skips damaged
checkpoints for the newest intact one (with a warning). Checkpoints later than the one resumed
are moved to `<checkpoint.dir>/set_aside/` before the run saves, never deleted. A save that fails
(e.g. the disk is full) stops the run with one line; the earlier checkpoints stay intact.

A resume may use another mesh or device count: arrays are read with the new mesh's shardings,
each row's memory moves with its row, and per-device error buffers are redistributed so that the
next reduction is unchanged (`redistribute_err_buf`). A different global batch gives every row a
new stream, so every row's memory restarts (with a warning). A different optimizer-state layout
goes through one hook (`convert_layout`). A tool that uses the model (`nljax.load`, generate,
export, lm_eval) and `checkpoint.init_params` read the parameters alone (`restore_params`): the
optimizer state, error buffers and memory stay on disk.

The package, by job: `contents` (named arrays, checksums, metadata and its checks), `storage`
(Orbax I/O, finding, pruning and setting aside step directories), `quiet` (Orbax's own reports
of errors nljax reports in one line, hidden around nljax's Orbax calls), `elastic` (another mesh,
device count, global batch or strategy), `restore` (read, check, convert), `initparams` (a new
run from a checkpoint's parameters only, `checkpoint.init_params`) and `lifecycle`
(`Checkpoints`, what the trainer uses).
"""
