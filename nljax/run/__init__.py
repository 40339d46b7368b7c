"""A training run: what is built from a config (model, engine, task), the training loop and its
hooks, trackers, throughput, and a trained run loaded back for sampling."""
