"""The memory check: oversized runs are refused before anything is allocated, with one line."""

import jax
import pytest
from helpers import TINY

from nljax import cli, config
from nljax.config import ConfigError
from nljax.measure import budget


def test_config_floor_catches_absurd_sizes_without_building():
    cfg = config.load(None, ["model.dim=1000000000"])
    terms = budget.config_floor(cfg, 1)
    assert terms["parameters"] > 10**18  # Python ints: no overflow
    with pytest.raises(ConfigError, match=r"needs at least .* per device, more than the 16.0 GiB available "
                                          r"\(biggest: optimizer state"):
        budget.check(terms, 16 * 2**30)
    long = budget.config_floor(config.load(None, ["train.seq_len=1048576"]), 1)
    assert max(long, key=long.get) == "activations (floor)"


def test_the_activation_floor_counts_one_chunk_of_logits_under_the_chunked_loss():
    """A large vocabulary's logits are the floor's biggest term, unless the chunked loss holds one
    chunk of them at a time: a run that fits only with it is not refused (as nl_350m with a
    50k-token vocabulary at 32 x 2048 tokens, about 26 GiB of logits otherwise)."""
    base = ["model.vocab_size=50304", "train.batch_size=32", "train.seq_len=2048"]
    full = budget.config_floor(config.load(None, base), 1)["activations (floor)"]
    chunked = budget.config_floor(config.load(None, [*base, "model.nl_lm.loss_chunk=512"]), 1)["activations (floor)"]
    stream = 32 * 2048 * 2 * config.load(None, base).model.depth * config.load(None, base).model.dim * 4
    assert full == stream + 32 * 2048 * 2 * 50304 * 4 and chunked == stream + 512 * 2 * 50304 * 4


def test_engine_terms_follow_the_strategy_and_name_the_biggest():
    from helpers import make

    setup = make(TINY, 2, 4)  # 8 devices
    terms = budget.engine_terms(setup.cfg, setup.engine)
    assert terms["optimizer state"] == 2 * terms["parameters"]  # adamw, replicated
    zero1 = budget.engine_terms(config.load(None, [*TINY, "sync.strategy=zero1"]), setup.engine)
    assert zero1["optimizer state"] == terms["optimizer state"] // 8
    opt_bytes = lambda *o: budget.engine_terms(config.load(None, [*TINY, *o]), setup.engine)["optimizer state"]
    assert opt_bytes("optim.name=lion") == opt_bytes("optim.name=sgd", "optim.momentum=0.9") == terms["parameters"]
    assert opt_bytes("optim.name=sgd") == 0  # plain SGD keeps none
    budget.check(terms, budget.available_bytes())  # a tiny run fits
    with pytest.raises(ConfigError, match="biggest: "):
        budget.check(terms, 1000)


def test_available_bytes_is_known_on_cpu():
    assert 0 < budget.available_bytes() < 2**50


def test_out_of_memory_is_one_line():
    e = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 53687091200 bytes.\nBufferAssignment...")
    line = cli.out_of_memory(e)
    assert line.startswith("out of memory (RESOURCE_EXHAUSTED: Out of memory") and "\n" not in line
    assert cli.out_of_memory(ValueError("shapes")) is None


@pytest.mark.parametrize("mode", ["gradients", "updates"])
def test_error_buffers_are_counted_as_allocated(mode):
    """`updates` keeps C_l - 1 gradients per frozen level: the estimate counted one (nl_350m with
    it on 8 devices: 6.1 GiB estimated, 84.5 GiB of error buffers allocated)."""
    import jax
    from helpers import make

    setup = make([*TINY, "cms.periods=[1,4,8]", f"cms.accumulate={mode}"], 2, 4)
    terms = budget.engine_terms(setup.cfg, setup.engine)
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(setup.init_state().err_buf))
    assert terms["error buffers"] == held > 0
    floor = budget.config_floor(setup.cfg, 8)["error buffers"]
    assert 0 < floor <= held  # the config-only floor counts the CMS MLPs' share, never more
    assert budget.config_floor(config.load(None, [*TINY, "cms.frozen_grads=skip"]), 8)["error buffers"] == 0


def test_small_amounts_are_named_in_mib():
    with pytest.raises(ConfigError, match=r"needs at least 150 MiB per device, more than the 60 MiB available"):
        budget.check({"parameters": 150 * 2**20}, 60 * 2**20)


def test_a_device_whose_memory_cannot_be_read_gives_no_budget():
    """A compile-only device (benchmarks/gpu_compile.py: a GPU this process compiles for but holds
    no arrays on) says nothing of its memory: no budget, not the host's."""
    class CompileOnly:
        platform, process_index = "gpu", 0

        def memory_stats(self):
            raise jax.errors.JaxRuntimeError("INVALID_ARGUMENT: MemoryStats is only supported for addressable devices")

    class Gpu(CompileOnly):
        def memory_stats(self):
            return {"bytes_limit": 80 * 2**30}

    assert budget.available_bytes(1, CompileOnly()) is None
    assert budget.available_bytes(1, Gpu()) == 80 * 2**30
    assert 0 < budget.available_bytes(1, jax.devices()[0]) < 2**50  # a CPU: the host's memory
