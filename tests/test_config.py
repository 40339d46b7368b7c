import pytest
import yaml

from nljax import config
from nljax.config import ConfigError


def test_defaults_and_overrides():
    cfg = config.load(None, ["train.steps=7", "cms.periods=[1,3,5]", "optim.lr=1", "sync.reduce=flat"])
    assert cfg.train.steps == 7
    assert cfg.cms.periods == (1, 3, 5)
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.sync.reduce == "flat"
    assert config.load().cms.periods == (1, 8, 64, 512)
    # a section given whole updates the keys it names, like a file's section: the others stay as set
    # before it (it replaced the section: cms.frozen_grads went back to its default, on a resume the
    # saved config's keys too)
    cfg = config.load(None, ["cms.frozen_grads=skip", "cms={periods: [1, 8]}"])
    assert (cfg.cms.periods, cfg.cms.frozen_grads) == ((1, 8), "skip")


def test_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  steps: 3\ncms:\n  periods: [2, 4]\n")
    cfg = config.load(str(p), ["train.steps=5"])
    assert cfg.train.steps == 5 and cfg.cms.periods == (2, 4)
    # a wrong key or value in the file names the file (an override's does not)
    p.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=rf"^config file {p}: unknown config key 'train.stepz' \(did you mean"):
        config.load(str(p))
    p.write_text("train:\n  steps: many\n")
    with pytest.raises(ConfigError, match=rf"^config file {p}: config key 'train.steps' must be int"):
        config.load(str(p), ["train.steps=4"])
    assert config.load(None, ["run.dir=[x"]).run.dir == "[x"  # a string setting takes a bracket as written


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stepz=3", "unknown config key 'train.stepz' (did you mean 'train.steps'?)"),
        # a key of another section: named, where the list of train's keys would not show it
        ("train.lr=1e-3", "unknown config key 'train.lr' (did you mean 'optim.lr'?)"),
        ("lr=1e-3", "unknown config key 'lr' (did you mean 'optim.lr'?)"),
        ("trian.steps=3", "unknown config key 'trian' (did you mean 'train'?)"),
        ("train.steps=abc", "config key 'train.steps' must be int, got str 'abc'"),
        ("train.steps=1.5", "config key 'train.steps' must be int"),
        ("sync.reduce=ring", "config key 'sync.reduce' must be one of ['flat', 'hierarchical']"),
        ("cms.periods=[1,0]", "cms.periods must be a non-empty list of positive integers"),
        # a bracket missing: the list is named broken (it read as a string: "'cms.periods[0]' must be int")
        ("cms.periods=[1,4", "override cms.periods=[1,4: not a valid list or mapping (did not find expected ',' or ']')"),
        # a list in another syntax: the line named its first item, cms.periods[0], as a string
        ("cms.periods=(1,4)", "config key 'cms.periods' must be a list, written [a, b, ...]: got '(1,4)'"),
        ("cms.periods=1,4", "config key 'cms.periods' must be a list, written [a, b, ...]: got '1,4'"),
        ("run.trackers=tensorboard,wandb", "config key 'run.trackers' must be a list, written [a, b, ...]: got "
                                           "'tensorboard,wandb'"),
        ("cms.frozen_grads=drop", "config key 'cms.frozen_grads' must be one of"),
        ("sync.mean=3", "config key 'sync.mean' must be bool"),
        ("model.nl_lm.memory_chunk=0", "model.nl_lm.memory_chunk must be >= 1, got 0"),
        ("eval.batches=-1", "eval.batches must be >= 0, got -1"),  # was one line for three keys, no value
        ("distributed.check_every=-1", "distributed.check_every must be >= 0, got -1"),  # likewise, two keys
        ("data.eval_fraction=0", "data.eval_fraction must be in [1e-9, 0.5] (every round(1/x)-th document is held "
                                 "out), got 0.0"),
        ("data.eval_fraction=1e-320", "data.eval_fraction must be in [1e-9, 0.5]"),  # 1/x: inf, was a traceback
        ("data.eval_fraction=0.99", "data.eval_fraction must be in [1e-9, 0.5]"),  # held out every 2nd, without a word
        ("model.name=dit cms.periods=[1] images.eval_fraction=1e-320", "images.eval_fraction must be in [1e-9, 0.5]"),
        # each named alone, with its value: one line for both left the user to guess which
        ("model.name=dit cms.periods=[1] images.eval_fraction=0.9", "images.eval_fraction must be in [1e-9, 0.5], got 0.9"),
        ("model.name=dit cms.periods=[1] images.source=moons images.toy_points=0", "images.toy_points must be >= 2, got 0"),
        ("optim.lr=nan", "config key 'optim.lr' must be a finite number, got nan"),
        ("optim.lr=.inf", "config key 'optim.lr' must be a finite number, got inf"),
        ("optim.lr=-1", "config key 'optim.lr' must be in (0, inf), got -1.0"),
        ("optim.b2=5", "config key 'optim.b2' must be in [0, 1), got 5.0"),
        ("optim.eps=0", "config key 'optim.eps' must be in (0, inf), got 0.0"),  # 0 / 0 at a zero gradient
        ("model.nl_lm.memory_lr_max=nan", "config key 'model.nl_lm.memory_lr_max' must be a finite number"),
        ("model.nl_lm.memory_lr_max=2", "config key 'model.nl_lm.memory_lr_max' must be in (0, 1], got 2.0"),
        ("optim.level_lr_scale=[1,nan,1,1]", "config key 'optim.level_lr_scale[1]' must be a finite number"),
        ("meanflow.time_mu=-.inf", "config key 'meanflow.time_mu' must be a finite number"),
        ("model.vocab_size=10", "model.vocab_size=10 is smaller than the 256 byte values"),
        ("seed=18446744073709551616", "seed must be in [0, 2^32)"),
        ("seed=4294967296", "seed must be in [0, 2^32), got 4294967296"),  # would be seed 0's key
        ("seed=-1", "seed must be in [0, 2^32)"),
        ("optim.warmup_steps=-1", "optim.warmup_steps must be >= 0, got -1"),
        ("train.steps=2147483648", "train.steps must be < 2^31, got 2147483648"),
        ("train.max_skipped=-1", "train.max_skipped must be >= 0"),
        ("train.target_eval_loss=-1", "config key 'train.target_eval_loss' must be in [0, inf), got -1.0"),
        # never met: no evaluation during training, or no eval_loss at all
        ("train.target_eval_loss=2 eval.every=0", "eval.every=0 evaluates only at the end; set eval.every"),
        ("train.target_eval_loss=2 eval.every=10 train.steps=10", "eval.every=10 evaluates only at the end of "
                                                                 "train.steps=10; set eval.every lower"),
        ("model.name=dit cms.periods=[1] train.target_eval_loss=2", "model.name=dit makes images, whose evaluation "
                                                                    "has no eval_loss"),
        # a key left without a value: "must be int, got NoneType None"
        ("train.steps=null", "config key 'train.steps' has no value (null): give one, or leave the key out for its default"),
        # a group of keys checked together named them all, not the one given nor its value
        ("train.batch_size=0", "train.batch_size must be >= 1, got 0"),
        ("train.seq_len=-8", "train.seq_len must be >= 1, got -8"),
        ("train.steps=-1", "train.steps must be >= 0, got -1"),
        ("train.log_every=0", "train.log_every must be >= 1, got 0"),
        ("model.dim=-16", "model.dim must be >= 1, got -16"),
        ("throughput.reps=-1", "throughput.reps must be >= 0, got -1"),
        ("checkpoint.keep=0", "checkpoint.keep must be >= 1, got 0"),
        ("checkpoint.keep_every=-1", "checkpoint.keep_every must be >= 0, got -1"),
        # kept for good only at multiples of both: fewer than asked, without a word
        ("checkpoint.keep_every=250", "checkpoint.keep_every=250 is not a multiple of checkpoint.every=100: only a "
                                      "checkpoint every 500 steps would be kept for good; give a multiple of "
                                      "checkpoint.every"),
        ("run.dir=", "run.dir must not be empty"),
        ("meanflow.eval_samples=1", "meanflow.eval_samples must be 0 (all) or >= 2, got 1"),
        # a DiT's two rules, each its own line: the combined one blamed model.dim for a patch size of 0
        ("model.name=dit cms.periods=[1] model.dim=64 model.heads=5",
         "model.dim=64 must split into model.heads=5 heads of equal width"),
        ("model.name=dit cms.periods=[1] model.dit.patch_size=0", "model.dit.patch_size must be >= 1, got 0"),
        ("data.train=a.txt", "data.train is read only with data.source=files (data.source=stdlib)"),
        ("data.source=files", "data.source=files needs data.train (paths or globs of .txt, .jsonl, .txt.gz, "
                              ".jsonl.gz, .parquet, .arrow or .feather files, or folders datasets' save_to_disk wrote) or "
                              "data.prepared"),
        # an int32 on the devices: an OverflowError traceback from the first jitted step
        ("model.nl_lm.window=10000000000000", "model.nl_lm.window must be < 2^31, got 10,000,000,000,000"),
        ("optim.warmup_steps=2147483647", "optim.warmup_steps must be < 2^31 - 1, got 2,147,483,647"),
        # one traced term per tap: the step never finished building; a tap past the window reads padding
        ("train.seq_len=32 model.nl_lm.memory_conv=33", "model.nl_lm.memory_conv=33 is longer than train.seq_len=32"),
        # cms_mlp takes no dtype: trained in float32 without a word
        ("model.name=cms_mlp model.dtype=bfloat16", "model.dtype=bfloat16 is nl_lm's and dit's compute dtype; "
                                                    "cms_mlp computes in float32"),
        # generated one by one at start-up: never finished
        ("data.source=recall train.seq_len=256 data.recall_docs=10000000000000",
         "data.recall_docs must be <= 1,000,000, got 10,000,000,000,000"),
        # an images model reads images.*: data.train trained on images.source without a word
        ("model.name=dit cms.periods=[1] data.source=files data.train=a.txt",
         "data.source=files reads text, and model.name=dit makes images: its images are images.*"),
        ("model.name=dit cms.periods=[1] data.source=recall train.seq_len=256",
         "data.source=recall reads text, and model.name=dit makes images"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        config.load(None, override.split())  # several overrides: space-separated
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        config.load(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError) as e:  # the first line of PyYAML's message named no problem, no line
        config.load(str(bad))
    line = str(e.value)  # the problem's wording is the YAML parser's own (C or Python): its place is ours
    assert line.startswith(f"config file {bad} is not valid YAML: line 2, column 1: ") and "\n" not in line
    assert line.endswith("']' (while parsing a flow sequence at line 1, column 8)"), line
    # a directory or a device is not "not found"; bytes that are not UTF-8 are one line too
    with pytest.raises(ConfigError, match="is not a regular file"):
        config.load(str(tmp_path))
    with pytest.raises(ConfigError, match="is not a regular file"):
        config.load("/dev/null")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"run:\n  dir: caf\xe9\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        config.load(str(latin))


def test_a_string_setting_given_digits_is_that_text():
    """YAML reads run.dir=007 as the number 7: a string setting takes the text as written (a
    checkpoint step directory, checkpoint.resume=4; nljax.generate's checkpoint=4 goes this way)."""
    cfg = config.load(None, ["run.dir=007", "checkpoint.resume=4", "train.sample_prompt=true", "train.steps=5"])
    assert (cfg.run.dir, cfg.checkpoint.resume, cfg.train.sample_prompt, cfg.train.steps) == ("007", "4", "true", 5)
    cfg = config.load(None, ["run.dir=2024-01-01", "run.wandb_name=2024-06-30"])  # YAML would make dates
    assert (cfg.run.dir, cfg.run.wandb_name) == ("2024-01-01", "2024-06-30")
    # a file of a list setting; text after " #" (YAML: a comment, dropped); quoted: YAML's reading
    cfg = config.load(None, ["data.source=files", "data.train=2024", "run.dir=a #b", "train.sample_prompt=x = 1  # one", "run.wandb_name='q'"])
    assert (cfg.data.train, cfg.run.dir, cfg.train.sample_prompt, cfg.run.wandb_name) == (("2024",), "a #b", "x = 1  # one", "q")
    assert config.load(None, ["data.source=files", "data.train=[a.txt, b.txt]"]).data.train == ("a.txt", "b.txt")
    # a string setting's [..] is text (a BERT tokenizer's end token: "must be str, got list ['SEP']" before)
    assert [config.parse_override(o) for o in ("data.doc_end_token=[SEP]", "train.sample_prompt=[1, 2]",
                                                "run.dir={a: b}", "data.train=[a]")] == [
        ("data.doc_end_token", "[SEP]"), ("train.sample_prompt", "[1, 2]"), ("run.dir", "{a: b}"), ("data.train", ["a"])]
    with pytest.raises(config.ConfigError, match="config key 'train.steps' must be int, got str 'abc'"):
        config.load(None, ["train.steps=abc"])


def test_exponent_without_dot_is_a_float():
    # YAML 1.1 reads "1e-9" as a string; a float field takes it as the number it means
    assert config.load(None, ["sync.max_grad_norm=1e-9"]).sync.max_grad_norm == 1e-9
    with pytest.raises(ConfigError, match="optim.lr"):
        config.load(None, ["optim.lr=fast"])


@pytest.mark.parametrize("old, new", [("model.window", "model.nl_lm.window"),
                                      ("model.memory_chunk", "model.nl_lm.memory_chunk"),
                                      ("model.patch_size", "model.dit.patch_size")])
def test_a_moved_key_names_its_new_place(tmp_path, old, new):
    with pytest.raises(ConfigError) as e:
        config.load(None, [f"{old}=8"])
    assert str(e.value) == f"{old} moved to {new}"
    p = tmp_path / "old.yaml"
    p.write_text(f"model:\n  name: nl_lm\n  {old.split('.')[1]}: 8\n")
    with pytest.raises(ConfigError) as e:
        config.load(str(p))
    assert str(e.value) == f"config file {p}: {old} moved to {new}"


def test_data_corpus_moved_to_data_source():
    """`data.source` names the data (stdlib | recall | files); the key it replaced is refused with
    its new place, and a checkpoint's saved config that has it is read with it moved."""
    with pytest.raises(ConfigError) as e:
        config.load(None, ["data.corpus=recall"])
    assert str(e.value) == "data.corpus moved to data.source"
    saved = config.to_dict(config.load(None, ["data.source=recall", "train.seq_len=256"]))
    saved["data"]["corpus"] = saved["data"].pop("source")
    assert config.from_dict(saved).data.source == "recall"


def test_one_path_is_a_list_of_one():
    cfg = config.load(None, ["data.source=files", "data.train=corpus/*.txt", "data.eval=[a.jsonl, b.txt.gz]"])
    assert cfg.data.train == ("corpus/*.txt",) and cfg.data.eval == ("a.jsonl", "b.txt.gz")


def test_model_sections_load_from_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  dim: 32\n  nl_lm:\n    window: 8\n    memory_chunk: 8\n  dit:\n    patch_size: 4\n")
    cfg = config.load(str(p), ["model.nl_lm.memory_layers=[0]"])
    assert (cfg.model.dim, cfg.model.nl_lm.window, cfg.model.nl_lm.memory_chunk) == (32, 8, 8)
    assert cfg.model.nl_lm.memory_layers == (0,) and cfg.model.dit.patch_size == 4
    with pytest.raises(ConfigError, match="unknown config key 'model.nl_lm.windw' \\(did you mean 'model.nl_lm.window'"):
        config.load(None, ["model.nl_lm.windw=8"])


def test_a_saved_config_with_the_old_model_keys_is_read():
    """A checkpoint written before the model section was split saved flat model keys: `from_dict`
    (which reads a checkpoint's config) moves them to their new place."""
    new = config.to_dict(config.load(None, ["model.nl_lm.window=32", "model.nl_lm.memory_kind=mlp",
                                            "model.dit.patch_size=4", "model.dtype=bfloat16",
                                            "model.nl_lm.memory_embed=false",
                                            "model.nl_lm.memory_impl=scan", "model.nl_lm.attention=blocked",
                                            "model.nl_lm.embed_grad=scatter"]))  # as the code then did
    old = {**new, "model": {k: v for k, v in new["model"].items() if k not in ("nl_lm", "dit")}}
    # the model.nl_lm keys that were flat then (those added since are absent, read as defaults)
    old["model"].update({k: v for k, v in new["model"]["nl_lm"].items() if f"model.{k}" in config.MOVED}, patch_size=4)
    assert "window" in old["model"] and "nl_lm" not in old["model"]
    assert config.migrate(old) == new
    assert config.from_dict(old) == config.from_dict(new)
    assert config.from_dict(old).model.nl_lm.window == 32
    # model.dit is not this nl_lm run's section: moved, then left out (`config.own_model`)
    assert "dit" not in config.migrate(old)["model"] and config.from_dict(old).model.dit == config.Config().model.dit
    assert "window" in old["model"]  # migrate copies: the saved tree is left as it was


def test_a_saved_config_without_a_key_added_since_reads_it_as_it_was():
    """A key of `config.ADDED` reads as the value that does what the code did before it existed;
    any other absent key stays absent (a resume warns about it)."""
    new = config.to_dict(config.load(None, ["model.nl_lm.window=32", "model.nl_lm.memory_embed=false"]))
    old = config.to_dict(config.load(None, ["model.nl_lm.window=32"]))
    del old["model"]["nl_lm"]["scan_layers"], old["model"]["nl_lm"]["memory_embed"]
    assert config.migrate(old) == new
    assert "scan_layers" not in old["model"]["nl_lm"]  # a copy
    del old["data"]["reset_prob"]  # added at 0, now 0.25 by default: not filled in
    assert "reset_prob" not in config.migrate(old)["data"]


def test_a_run_saved_before_the_weight_decay_mask_resumes_decaying_every_parameter():
    """optim.decay_params came with a default ('weights') that is not what the code did before
    (every parameter decayed): a config saved without it reads as 'all', and the schedule keys
    added with it as the values that reproduce the old cosine, so a resume neither changes what
    decays nor warns about keys that change nothing."""
    old = config.to_dict(config.load(None, ["optim.weight_decay=0.1"]))
    for key in ("decay_params", "min_lr_ratio", "decay_fraction", "eps"):
        del old["optim"][key]
    migrated = config.migrate(old)["optim"]
    assert (migrated["decay_params"], migrated["min_lr_ratio"], migrated["decay_fraction"]) == ("all", 0.1, 0.2)
    assert migrated["eps"] == 1e-8  # optax's default, which Adam always had
    assert config.load(None).optim.decay_params == "weights"  # a new run's default is unchanged


def test_a_runs_config_yaml_names_itself_in_its_errors(tmp_path):
    """A run's config.yaml (read by generate, export, nljax.load and --resume, `saved` or `base`)
    with a key or value nljax does not take is one line naming the file, as a --config file is: the
    line named only the key, which the command line did not hold. An emptied one is not told to
    leave --config out (generate has no --config)."""
    p = tmp_path / "config.yaml"
    tree = config.to_dict(config.load(None))
    tree["train"]["stepz"] = tree["train"].pop("steps")
    p.write_text(yaml.safe_dump(tree))
    line = f"config file {p}: unknown config key 'train.stepz' (did you mean 'train.steps'?)"
    for read in (lambda: config.load(str(p), [f"run.dir={tmp_path}"], saved=True),
                 lambda: config.load(None, ["train.steps=3"], base=str(p))):
        with pytest.raises(ConfigError) as e:
            read()
        assert str(e.value) == line
    p.write_text("")
    with pytest.raises(ConfigError) as e:
        config.load(str(p), saved=True)
    assert str(e.value) == (f"config file {p} holds no settings: a run's config.yaml holds every setting, this is not "
                            "the one nljax.train wrote")


@pytest.mark.parametrize("on, trackers", [(True, ("tensorboard",)), (False, ())])
def test_a_saved_config_with_run_tensorboard_is_read_as_run_trackers(tmp_path, on, trackers):
    """`run.tensorboard` (a bool) became `run.trackers` (a list): a checkpoint's config and a run's
    config.yaml written before are read with the list it meant; a user's file is refused."""
    old = config.to_dict(config.load(None))
    del old["run"]["trackers"]
    old["run"]["tensorboard"] = on
    assert config.from_dict(old).run.trackers == trackers
    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump(old))
    assert config.load(str(p), ["train.steps=3"], saved=True).run.trackers == trackers
    with pytest.raises(ConfigError, match=f"^config file {p}: run.tensorboard moved to run.trackers"):
        config.load(str(p))


def test_compile_cache_setting(tmp_path, monkeypatch):
    from nljax.runtime import compile_cache

    assert config.load(None, ["run.compile_cache=none"]).run.compile_cache == "none"
    assert compile_cache.directory("none") is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.directory("auto") == tmp_path / "nljax" / "jax"
    assert compile_cache.directory(str(tmp_path / "c")) == tmp_path / "c"
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="run.compile_cache: .* cannot be created"):
        compile_cache.enable(str(tmp_path / "file" / "c"))


def test_a_second_compile_cache_in_one_process_is_the_one_written(tmp_path):
    """Two runs in one process (the Python API) with two run.compile_cache directories: the
    second run's executables go to its own directory (JAX opens its cache once, at the first
    directory it compiles with). In a fresh process: the suite's own cache is on in this one."""
    import subprocess
    import sys

    from helpers import subprocess_env

    code = ("import sys, jax, jax.numpy as jnp\n"
            "from nljax.runtime import compile_cache\n"
            "compile_cache.enable(sys.argv[1]); jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)).block_until_ready()\n"
            "compile_cache.enable(sys.argv[2]); jax.jit(lambda x: x * 3 - 1)(jnp.ones(5)).block_until_ready()\n")
    first, second = tmp_path / "first", tmp_path / "second"
    p = subprocess.run([sys.executable, "-c", code, str(first), str(second)], capture_output=True, text=True,
                       timeout=120, env=subprocess_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"))
    assert p.returncode == 0, p.stderr
    assert any(second.iterdir()), (sorted(first.iterdir()), sorted(second.iterdir()))


def test_a_home_relative_path_setting_is_expanded(tmp_path, monkeypatch):
    """`run.dir=~/runs/x` reaches nljax unexpanded (the shell expands `~` in an assignment, not in
    an argument): a run wrote into a folder named '~' in the current directory, and generate,
    export and --resume looked for the run there, while nljax.load and the data paths expanded it."""
    from nljax.run import trained

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    cfg = config.load(None, ["run.dir=~/runs/x", "checkpoint.dir=~/ck", "run.compile_cache=~/cache",
                             "checkpoint.resume=~/ck/4"])
    assert (cfg.run.dir, cfg.checkpoint.dir, cfg.run.compile_cache, cfg.checkpoint.resume) == (
        f"{tmp_path}/runs/x", f"{tmp_path}/ck", f"{tmp_path}/cache", f"{tmp_path}/ck/4")
    assert config.load(None, ["run.compile_cache=auto", "checkpoint.resume=latest"]).run.compile_cache == "auto"
    assert config.load(None, ["images.path=~/digits.npz"]).images.path == f"{tmp_path}/digits.npz"
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config.to_dict(config.load(None, [f"run.dir={run}"]))))
    assert trained.trained_config("~/runs/x").run.dir == str(run)  # the run's config.yaml, found
    assert trained.split_args(["run.dir=~/runs/x"], {})[2] == str(run)  # export's default out= lies under it


def test_a_key_left_without_a_value_in_a_file_is_named(tmp_path):
    """`steps:` with nothing after it: the file was refused as holding no settings at all (the
    key alone), or a NoneType was named (beside another key)."""
    p = tmp_path / "c.yaml"
    for text in ("train:\n  steps:\n", "train:\n  steps:\n  batch_size: 4\n", "run:\n  dir: null\n"):
        p.write_text(text)
        key = "run.dir" if "dir" in text else "train.steps"
        with pytest.raises(ConfigError) as e:
            config.load(str(p))
        assert str(e.value) == (f"config file {p}: config key '{key}' has no value (null): give one, or leave the "
                                "key out for its default")
    for text in ("train:\n", "model:\n", "model: null\n"):  # a section alone: named, as beside others
        p.write_text(text)
        with pytest.raises(ConfigError) as e:
            config.load(str(p))
        name = text.partition(":")[0]
        assert str(e.value) == f"config file {p}: section '{name}' is empty (nothing indented under '{name}:')"
    p.write_text("train: {}\n")  # nothing in it, written as such: as before
    with pytest.raises(ConfigError, match="holds no settings"):
        config.load(str(p))


def test_a_saved_images_path_of_another_source_is_read_as_unset(tmp_path):
    """images.path beside images.source=digits was ignored (the run trained on digits); it is
    refused in a user's config since, but a run saved before still resumes, evaluates and loads:
    its config.yaml and its checkpoints' configs read the key as unset."""
    with pytest.raises(ConfigError, match=r"^images.path is read only with images.source=file"):
        config.load("meanflow_digits", ["images.path=cifar.npz"])
    tree = config.to_dict(config.load("meanflow_digits"))
    tree["images"]["path"] = "cifar.npz"
    assert config.from_dict(tree).images.path == "" and tree["images"]["path"] == "cifar.npz"  # a copy
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(tree))
    assert config.load(str(saved), saved=True) == config.load("meanflow_digits")
    tree["images"]["source"] = "file"  # read by the run: kept
    assert config.migrate(tree)["images"]["path"] == "cifar.npz"


@pytest.mark.parametrize("overrides, message", [
    (["model.dim=12", "model.heads=4"], "model.dim=12 must split into model.heads=4 heads of even width"),
    (["model.dim=12", "model.heads=5"], "model.dim=12 must split into model.heads=5 heads of even width"),
    (["model.depth=2", "model.nl_lm.memory_layers=[2]"], r"model.nl_lm.memory_layers \[2\] out of range for model.depth=2"),
    (["model.depth=2", "model.nl_lm.memory_layers=[-1]"], r"model.nl_lm.memory_layers \[-1\] out of range"),
])
def test_nl_lm_shapes_that_do_not_split_are_refused(overrides, message):
    """Heads of odd width (rotary positions turn pairs of features) and memory layers past the
    last block are refused when the config loads; the widths and blocks at the edges are taken."""
    with pytest.raises(ConfigError, match=message):
        config.load(None, ["model.name=nl_lm", *overrides])
    config.load(None, ["model.name=nl_lm", "model.dim=16", "model.heads=4", "model.depth=2",
                       "model.nl_lm.memory_layers=[0,1]"])


def test_a_value_of_another_type_is_not_taken_for_the_settings():
    """A bool is no int nor float (YAML's true for train.steps is not 1), nor a list of one (run.trackers=true);
    a list in another syntax is refused as such even without a comma (cms.periods=(8)); a dotted
    key in a file whose first part is no section is an unknown key, not told to nest."""
    for override, message in (("train.steps=true", "config key 'train.steps' must be int, got bool True"),
                              ("optim.lr=true", "config key 'optim.lr' must be float, got bool True"),
                              ("run.trackers=true", "config key 'run.trackers' must be a list, got True"),
                              ("cms.periods=(8)", "config key 'cms.periods' must be a list, written [a, b, ...]: "
                                                  "got '(8)'")):
        with pytest.raises(ConfigError) as e:
            config.load(None, [override])
        assert str(e.value) == message


def test_a_dotted_key_of_no_section_in_a_file_is_unknown(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("trian.steps: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'trian\.steps' \(valid: seed, run, train, ") as e:
        config.load(str(path))
    assert "nests its keys" not in str(e.value)


def test_a_path_setting_of_another_users_home_is_expanded():
    """`~user/...` is expanded as the shell would (as `~/...` is): a folder named '~root' in the
    current directory was not meant."""
    import os

    cfg = config.load(None, ["run.dir=~root/runs/x"])
    assert cfg.run.dir == os.path.expanduser("~root/runs/x") and not cfg.run.dir.startswith("~")


def test_a_saved_key_in_both_places_and_momentum_beside_lion():
    """A saved config holding a moved key in its old place and its new one keeps the new one's
    value; optim.momentum and optim.nesterov beside any optimizer but sgd (never read) are left out,
    beside sgd kept."""
    moved = config.migrate({"model": {"memory_dim": 8, "nl_lm": {"memory_dim": 16}}})
    assert moved["model"]["nl_lm"]["memory_dim"] == 16 and "memory_dim" not in {
        k for k, v in moved["model"].items() if not isinstance(v, dict)}
    for name in ("adamw", "lion"):
        optim = config.migrate({"optim": {"name": name, "momentum": 0.9, "nesterov": True}})["optim"]
        assert (optim["momentum"], optim["nesterov"]) == (0.0, False)
    optim = config.migrate({"optim": {"name": "sgd", "momentum": 0.9, "nesterov": True}})["optim"]
    assert (optim["momentum"], optim["nesterov"]) == (0.9, True)
    # model.dtype beside cms_mlp (never read: it computes in float32) likewise; beside nl_lm kept
    assert config.migrate({"model": {"name": "cms_mlp", "dtype": "bfloat16"}})["model"]["dtype"] == "float32"
    assert config.from_dict({"model": {"name": "cms_mlp", "dtype": "bfloat16"}}).model.dtype == "float32"
    assert config.migrate({"model": {"name": "nl_lm", "dtype": "bfloat16"}})["model"]["dtype"] == "bfloat16"
    # adamw's b1, b2 and eps beside a rule that reads them not likewise (lion keeps its b1, b2)
    sgd = config.migrate({"optim": {"name": "sgd", "b1": 0.5, "b2": 0.5, "eps": 0.1}})["optim"]
    assert (sgd["b1"], sgd["b2"], sgd["eps"]) == (0.9, 0.99, 1e-8)
    lion = config.migrate({"optim": {"name": "lion", "b1": 0.5, "b2": 0.5, "eps": 0.1}})["optim"]
    assert (lion["b1"], lion["b2"], lion["eps"]) == (0.5, 0.5, 1e-8)


def test_a_saved_text_data_source_beside_an_images_model_is_read_as_unset(tmp_path):
    """data.source=files (or recall) beside model.name=dit was never read (the run trained on
    images.*); refused in a user's config since, a run saved before still resumes, evaluates and
    loads: its saved data section reads as the defaults. Beside a text model it is kept."""
    tree = config.to_dict(config.load("meanflow_digits"))
    tree["data"].update(source="files", train=["a.txt"])
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(tree))
    assert config.load(str(saved), saved=True) == config.load("meanflow_digits")
    assert config.from_dict(tree).data.source == "stdlib" and tree["data"]["source"] == "files"  # a copy
    text = {"model": {"name": "nl_lm"}, "data": {"source": "files", "train": ["a.txt"]}}
    assert config.migrate(text)["data"] == text["data"]


def test_a_negative_float_past_float32_is_refused():
    """A setting that takes negative numbers is bounded by float32's range below too: -1e39 is
    -inf on the device."""
    with pytest.raises(ConfigError, match=r"'meanflow.time_mu' must be a finite number within float32's range"):
        config.load(None, ["meanflow.time_mu=-1e39"])


def test_a_packaged_config_is_found_by_either_yaml_suffix():
    name = config.packaged_configs()[0]
    for given in (name, f"{name}.yaml", f"{name}.yml", f"configs/{name}.yaml"):
        assert config.config_path(given) == config.PACKAGED / f"{name}.yaml"
