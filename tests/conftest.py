"""Eight emulated CPU devices, configured before JAX creates its backends."""

import importlib.metadata
import os
import shutil
import tempfile

# The LLVM flags halve XLA:CPU compile time, which dominates this suite; they change code
# generation effort, not the arithmetic, and the single-device references use them too.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
).strip()
# jaxlib 0.10's XLA:CPU compiles elementwise fusions faster with its older emitters: measured
# 2026-11-30 on the 2-core machine, the suite's CPU time 40m19 -> 26m39. They fuse some programs
# otherwise, so two programs that agree to the bit under the default emitters may differ in the
# last bits under these: the tests that claim bit-equality across programs compile with
# helpers.EXACT (the default emitters back). jaxlib 0.11 has no such flag (XLA refuses an unknown
# one), hence the version test. Not a user-facing setting: nljax itself never sets it.
if tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11) \
        and "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# run.compile_cache=auto writes under $XDG_CACHE_HOME: a directory of this pytest run's own, so the
# suite never reads or fills the user's cache (subprocesses inherit it). The xdist controller
# makes it before it starts the workers, which inherit it: one per run, empty at its start.
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="nljax_test_cache_")

import jax  # noqa: E402
import pytest  # noqa: E402

# Every program the tests compile in-process goes to that run's JAX compile cache (the one
# run.compile_cache=auto uses), however fast it compiled, so the same program traced again by
# another test or worker is loaded, not compiled. Measured 2026-11-30 on test_engine +
# test_strategies + test_nl_model, -n 2, on a 2-core machine under another job's varying load,
# baseline -> this: 90-96 of ~445 compilations load; CPU time 202->167, 211->164, 220->183,
# 194->175, 195->167 s; wall 134->132, 193->90, 218->161, 100->93, 100->89 s (140->123: CPU not taken).
# JAX's default 1 s floor loaded 19-26: wall 186->127, 179->169 s. The whole suite with it: 1,094
# tests in 12:42 on the quiet 2-core machine (2026-11-30), where 1,079 had taken 13:29 without it.
# Subprocesses keep JAX's defaults; tests of run.compile_cache give their runs a cache of their own.
jax.config.update("jax_compilation_cache_dir", os.path.join(os.environ["XDG_CACHE_HOME"], "nljax", "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_configure(config):
    assert jax.device_count() == 8, f"tests need 8 emulated CPU devices, got {jax.device_count()}"


def pytest_unconfigure(config):
    """The run's cache goes with the run (the controller's, after every worker has finished)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        shutil.rmtree(os.environ["XDG_CACHE_HOME"], ignore_errors=True)


# Tests that take over a minute on the 2-core CI machine. pytest-xdist hands tests to workers
# in collection order, so these go first: started last, one of them would leave a worker running
# alone at the end (longest first keeps the workers' finishing times close).
LONGEST_FIRST = ("test_configs.py::test_first_steps_at_real_shapes",)


# Cases moved to the `slow` tier (.ci/run runs it after the suite) so that the suite fits 15
# minutes on the 2-core CI machine: each is a variant whose check the suite makes on another mesh,
# memory kind or strategy (measured: each 35-60 s there).
SLOW_CASES = (
    "test_nl_model.py::test_matches_single_device_including_memory[1-2-mlp]",
    "test_nl_model.py::test_matches_single_device_including_memory[2-4-mlp]",
    "test_nl_model.py::test_logits_are_causal[mlp]",
    "test_precision.py::test_bf16_matches_single_device[1-2]",
    "test_meanflow.py::test_meanflow_fsdp_matches_replicated[fsdp]",
    "test_export.py::test_export_load_gives_the_training_states_logits[fsdp]",
    "test_tp.py::test_tensor_parallel_matches_one_device[shape0-fsdp-flat-skip-more0]",
    "test_gated_delta.py::test_matches_single_device_under_every_strategy[2-4-hierarchical-replicated]",
    # 2026-11-28: the suite ran 20+ minutes there. Measured by `--durations=0` (under load), the
    # mesh-shape x mode matrices keep one case per shape and per mode in the suite, the rest here;
    # and long end-to-end runs whose behaviour a shorter test of the suite also checks. (2026-11-29:
    # test_engine's `skip` and `updates` cases are all in the slow tier, marked there; the suite
    # checks both modes in test_strategies.)
    *(f"test_engine.py::test_matches_single_device[{case}]" for case in (
        "1-2-flat-accumulate", "1-2-hierarchical-accumulate", "2-2-flat-accumulate",
        "2-4-flat-accumulate", "2-4-hierarchical-accumulate", "4-2-hierarchical-accumulate")),
    *(f"test_strategies.py::test_matches_replicated[{case}]" for case in (
        "zero1-2-4-hierarchical-accumulate", "zero1-2-4-hierarchical-skip", "zero1-1-8-flat-accumulate",
        "fsdp-2-4-hierarchical-accumulate", "fsdp-4-2-hierarchical-accumulate", "zero1-2-2-hierarchical-accumulate")),
    "test_engine.py::test_params_bitwise_identical_but_buffers_rank_local[flat]",
    "test_eval.py::test_stream_eval_independent_of_mesh[2-4]",
    "test_nl_model.py::test_blocked_local_attention_equals_the_full_masked_form[100-16]",
    "test_memory.py::test_gradients_match_sequential[mlp-scan]",  # (its id before memory_impl=parallel: [mlp])
    "test_nl_model.py::test_accumulation_equals_one_step_on_the_whole_batch[1-2-2]",  # test_loop's accum cases
    "test_nl_model.py::test_every_block_starts_as_the_identity",
    "test_precision.py::test_bf16_tracks_float32",  # as test_bf16_matches_single_device: bf16 is checked in this tier
    "test_precision.py::test_remat_saves_memory",  # test_remat_gradients_are_bitwise_equal stays
    "test_checkpoint.py::test_elastic_resume_8_4_2_devices",  # test_text_files' elastic resume stays
    "test_checkpoint_cli.py::test_ctrl_c_saves_the_step_and_a_second_one_stops_at_once",
    "test_checkpoint_cli.py::test_failed_write_during_a_save_is_one_line_and_keeps_the_earlier_checkpoints[async]",
    "test_checkpoint_cli.py::test_resume_falls_back_past_damaged_checkpoints_and_sets_later_ones_aside",
    "test_meanflow.py::test_meanflow_under_tensor_parallelism_matches[shape0-fsdp]",
    "test_meanflow.py::test_bf16_dit_tracks_float32",
    "test_meanflow.py::test_dit_remat_is_exact_and_keeps_less",
    "test_meanflow.py::test_gathered_energy_distance_equals_single_device",
    "test_generate.py::test_meanflow_run_writes_a_sample_grid",
    # 2026-11-29: the MeanFlow side of nljax.evaluate (test_evaluate's text cases stay): ~30 s
    "test_evaluate.py::test_an_image_model_reports_its_tasks_evaluation",
    "test_generate.py::test_a_damaged_newest_checkpoint_is_named_and_text_runs_refuse_out",
    "test_export.py::test_the_export_holds_the_runs_config_and_a_dit_loads_without_its_images",
    "test_python_api.py::test_an_image_model_generates_images",
    "test_bench.py::test_bench_json_fields_are_sane",
    # 2026-11-29: the new run from a checkpoint's parameters: its fsdp + sgd case stays
    "test_init_params.py::test_another_mesh_strategy_optimizer_and_periods[zero1 tensor-parallel]",
    # 2026-11-29 (session 36): the suite took 15:04 here with today's tests; each of these is checked
    # in the suite by another test, named after it
    "test_restore_params.py::test_a_load_reads_and_holds_the_parameters_alone[replicated 8]",  # fsdp x TP stays
    "test_init_params.py::test_through_the_command_line_and_a_resume_of_such_a_run",  # in-process run stays
    "test_resume_mesh.py::test_resume_on_one_device_continues_with_a_note",  # the note's own test stays
    "test_tp.py::test_hlo_of_a_level0_step[2]",  # [1] stays; test_loop's accumulation cases stay
    "test_meanflow.py::test_meanflow_accumulation_matches",  # text accumulation (test_loop) stays
    "test_loop.py::test_reps_zero_skips_the_timing",  # a 20 s run for one switch: the slow tier alone checks it
    "test_loop.py::test_a_run_of_no_steps_times_nothing",  # likewise, the same switch's other arm (7 s)
    # 2026-11-30 (session 41): the suite took 13:30 here; each of these is checked in the suite by
    # the test or case named after it
    "test_engine.py::test_frozen_modes_differ",  # guards the `skip`/`updates` cases above, all in this tier
    "test_cms_semantics.py::test_skip_is_per_level[nan-extra0-zero1-2-4]",  # [nan-...-replicated-2-4]: NaN
    "test_cms_semantics.py::test_skip_is_per_level[1000000.0-extra1-replicated-2-4]",  # [1e6-...-zero1-2-4]
    "test_eval.py::test_eval_loss_independent_of_device_count[1-2]",  # [2-4] stays
    "test_eval_sets.py::test_a_set_of_the_held_out_files_scores_as_the_main_evaluation[2-4-bytes]",  # [1-1-bytes], [2-4-bpe]
    "test_strategies.py::test_matches_replicated[fsdp-1-2-flat-accumulate]",  # fsdp-1-8-flat, fsdp-2-2 (shards of 4)
    "test_configs.py::test_first_steps_at_real_shapes[nl_recall]",  # [nl_default]; recall at toy size: test_recall
    # 2026-12-01 (session 51): the suite took 16:09 alone here (1,340 tests); the longest end-to-end
    # cases whose behaviour a shorter test of the suite checks (named after each), and refusals and
    # compatibility cases that need a whole run or checkpoint of their own (each 8-22 s here)
    "test_cli.py::test_a_run_that_reaches_its_target_eval_loss_stops_saved_and_its_resume_says_so",  # test_ema's
    "test_trackers.py::test_a_resume_that_meets_its_target_at_once_logs_that_evaluation_once",  # and the target's
    "test_resume_config.py::test_a_resume_pointed_at_another_runs_checkpoints_is_refused",
    # the tools' checkpoint=STEP stay
    "test_resume_config.py::test_a_resume_from_a_step_number_reads_that_checkpoint_of_the_run",
    "test_reliability.py::test_a_failing_evaluation_keeps_the_steps_since_the_last_checkpoint",
    "test_reliability.py::test_the_same_data_spelled_otherwise_or_from_another_directory_resumes_exactly",
    "test_cli.py::test_python_m_nljax_lists_the_commands_and_runs_one",  # test_reference: the same list
    "test_multihost.py::test_save_failing_on_one_process_stops_every_process_with_its_cause[process1-async]",  # [process0-sync]
    "test_meanflow_data.py::test_a_checkpoint_used_on_other_images_is_refused",
    "test_loop.py::test_a_preempted_run_saves_before_it_ends_its_profile",  # the preemption tests without a profile stay
    "test_checkpoint.py::test_a_checkpoint_with_flat_qkv_kernels_restores",
    "test_generate.py::test_a_recall_run_generates_and_exports",
)


@pytest.hookimpl(tryfirst=True)  # before the `-m` selection reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("/")[-1] in SLOW_CASES:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: not any(name in item.nodeid for name in LONGEST_FIRST))  # stable
