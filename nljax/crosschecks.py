"""The config rules that tie two sections together, all in one place.

Each section checks its own fields (its `check()`, beside the code that owns it); what relates
one section to another, or applies only when `model.name` selects a model or task, is here.
`nljax.config.validate` calls `check_across_sections` last, after every section's own rules.
"""

from __future__ import annotations

from nljax.data.recall import pair_len
from nljax.errors import ConfigError


def check_across_sections(cfg) -> None:
    """Rules between sections of `cfg`, an `nljax.config.Config` (not imported: it imports this)."""
    from nljax.models import registry  # the registered model's own rules and its task

    m, d, periods = cfg.model, cfg.data, cfg.cms.periods
    spec = registry.spec(m.name)  # an unknown model.name: one line with the nearest registered one
    if cfg.optim.level_lr_scale and len(cfg.optim.level_lr_scale) != len(periods):
        raise ConfigError(f"optim.level_lr_scale has {len(cfg.optim.level_lr_scale)} entries but cms.periods has "
                          f"{len(periods)} levels")
    if spec.check is not None:
        with registry.plugin_code(spec.name, "its check(cfg)"):  # a plugin's AttributeError or assert: one line
            spec.check(cfg)
    if spec.task == "text" and d.source != "files" and m.vocab_size < 256:
        # these corpora are bytes: token ids 0..255 index the embedding (files: checked against
        # their own vocabulary when they are read: nljax.run.tasks.resolve)
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the 256 byte values of the text data")
    if cfg.train.sample_every and not cfg.train.sample_prompt and d.source == "files" and d.tokenizer \
            and not d.doc_end_token:
        raise ConfigError("train.sample_every with an empty train.sample_prompt starts at a document start, "
                          "which a tokenizer has only with data.doc_end_token: set one of them")
    # eval.every >= train.steps: no evaluation during training either (none after the last step:
    # the final one is the run's end), so the target could never stop the run
    if cfg.train.target_eval_loss and (spec.task != "text" or not 0 < cfg.eval.every < cfg.train.steps):
        why = (f"model.name={m.name} makes images, whose evaluation has no eval_loss" if spec.task != "text"
               else "eval.every=0 evaluates only at the end; set eval.every" if not cfg.eval.every
               else f"eval.every={cfg.eval.every} evaluates only at the end of train.steps={cfg.train.steps}; set "
               "eval.every lower")
        raise ConfigError(f"train.target_eval_loss stops at an evaluation during training whose eval_loss is at or "
                          f"below it: {why}")
    if spec.task == "images" and d.source != "stdlib":
        # the images task reads images.*, never the data section: data.source=files with data.train
        # trained on images.source without a word (and recall was refused by its text rules)
        raise ConfigError(f"data.source={d.source} reads text, and model.name={m.name} makes images: its images are "
                          "images.* (images.source, images.path)")
    if d.source == "recall":
        reach = spec.reach(cfg) if spec.reach is not None else 0  # how far back attention alone sees
        if d.recall_gap < reach:
            raise ConfigError(f"data.recall_gap={d.recall_gap} must be >= the attention's reach model.depth * "
                              f"(model.nl_lm.window - 1) = {reach}, or attention alone could answer the queries")
        need = 2 * d.recall_pairs * pair_len(d.recall_key_len, d.recall_value_len) + d.recall_gap + 1
        if need > cfg.train.seq_len:
            raise ConfigError(f"a recall document of data.recall_pairs={d.recall_pairs} pairs and data.recall_gap="
                              f"{d.recall_gap} needs up to {need} bytes, more than train.seq_len={cfg.train.seq_len}")
        if cfg.eval.stream_steps < 1:
            raise ConfigError("data.source=recall is evaluated by the streaming evaluation: eval.stream_steps must be >= 1")
    if spec.task == "images":  # the images task: its sections apply, and every parameter is at level 0
        if cfg.train.sample_every:
            raise ConfigError(f"train.sample_every samples text, and model.name={m.name} makes images: its samples "
                              "are the samples_<step>.png each evaluation writes (eval.every)")
        if len(periods) != 1:
            raise ConfigError(f"model.name={m.name} keeps every parameter at level 0: set cms.periods to one period "
                              f"(e.g. [1]), got {list(periods)}")
        if d.eval_sets:  # read by the text task alone: ignored here without a word
            raise ConfigError(f"data.eval_sets holds held-out text, and model.name={m.name} makes images: its held-out "
                              "images are images.* (images.eval_fraction, images.path)")
        cfg.meanflow.check_used()
        cfg.images.check_used()
