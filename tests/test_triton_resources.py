"""benchmarks/triton_resources.py's capture: the Triton modules XLA would compile on a GPU, with
the warps and stages each pallas_call asks for, found on this CPU-only machine. (Compiling them
needs the `triton` package, not a test dependency: the figures are in
docs/benchmarks/2026-11-28-memory-kernel-compile-and-shared-memory.md.)"""

import json
import re
import sys
import types

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import triton_resources as resources
finally:
    sys.path.pop(0)


def test_a_configs_kernels_are_captured_with_their_own_settings(tmp_path):
    found = resources.kernels("nl_350m")
    names = [re.match(r"module @(\S+)", text).group(1) for text, _, _ in found.values()]
    assert names == ["memory_forward_kernel", "memory_backward_kernel", "memory_end_forward_kernel",
                     "memory_end_backward_kernel", "attention_forward", "attention_dkv", "attention_dq"]
    assert [(w, s) for _, w, s in found.values()] == [(8, 1)] * 4 + [(4, 2)] * 3
    assert "(mlp, chunk 64, dim 64, hidden 128)" in list(found)[0] and "tt.func public" in found[list(found)[0]][0]
    assert resources.main(["--config", "nl_350m", "--capture-only", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"nl_350m_{i}.ttir" for i in range(7)]


def test_a_head_width_triton_cannot_take_has_no_pallas_attention(capsys):
    found = resources.kernels("titans_demo")  # head width 48
    assert len(found) == 4 and "no Pallas attention" in capsys.readouterr().out


def test_the_memory_kernels_fence_every_store_of_the_state():
    """The memory kernels keep the state (and its cotangent) in global memory, which the threads of
    a program read and write in different layouts: each store of it sits between two barriers
    (and one after the initial copy). Interpret mode runs a program sequentially and cannot miss
    a barrier; the lowered module can. The MLP memory's state is stored a hidden tile at a time,
    inside the tile loops (written once each): the forward stores W1', S1', W2', S2'; the
    backward their cotangents in `_tile_step`'s pull-back, then adds W1's and W2's in
    `_tile_sums`'. The loop kernel's forward stores the same four (its copies of the chunk-start
    state go to outputs no thread reads); its backward the four cotangents, k's and the errors'
    cotangent sums (zeroed, added per tile in both loops, stored with the keys' Gram matrix's as
    the chunk's gradients: 2 + 2 + 1 + 3) and W1's and W2's additions."""
    texts = [text for name, (text, _, _) in resources.kernels("nl_350m").items() if name.startswith("memory")]
    for text, stores in zip(texts, (4, 4 + 2, 4, 4 + 2 + 8), strict=True):
        assert_fenced(text, stores)


def test_the_linear_loop_kernel_fences_every_store_of_the_state():
    """The default job's linear memory: the loop kernel's forward stores W' and S'; its backward
    their cotangents and the chunk's gradients of k, v and the keys' Gram matrix."""
    found = resources.kernels(None)  # the default config: linear memory, chunk 16, dim 32
    texts = [text for name, (text, _, _) in found.items() if name.startswith("memory loop")]
    for text, stores in zip(texts, (2, 2 + 3), strict=True):
        assert_fenced(text, stores)


def assert_fenced(text: str, stores: int) -> None:
    """`stores` stores of a lowered kernel each between two barriers, and no other barrier than
    one after the copies of the initial state."""
    lines = [line.split()[0] if "gpu.barrier" in line else "store" for line in text.splitlines()
             if "gpu.barrier" in line or "tt.store" in line]
    rest = lines[lines.index("gpu.barrier") + 1:]  # after the copies of the initial state
    fence = ["gpu.barrier", "store", "gpu.barrier"]
    fenced = sum(rest[i:i + 3] == fence for i in range(len(rest)))
    assert fenced == stores and text.count("gpu.barrier") == 1 + 2 * stores, (fenced, stores)


def test_under_full_float32_the_memory_kernels_take_tf32x3_products_not_ieee_ones():
    """Triton lowers an exact float32 product (inputPrecision = ieee, what
    jax.default_matmul_precision("highest") asks for) without tensor cores, unrolled per element:
    the backward kernel took minutes to compile. The memory kernels take three TF32 products
    instead; at the default precision, one."""
    for precision, want in ((None, "tf32"), ("highest", "tf32x3")):
        texts = [text for name, (text, _, _) in resources.kernels("titans_demo", precision).items()
                 if name.startswith("memory")]
        assert len(texts) == 4, precision  # both kernels' forward and backward: none would pass unchecked
        for text in texts:
            dots = text.count("tt.dot ")
            assert dots > 0 and len(re.findall(rf"tt\.dot [^\n]*inputPrecision = {want} ", text)) == dots


def test_each_compile_phase_is_timed_and_the_triton_ir_passes_run():
    """compiled()'s hook on triton's stages: a module given as Triton IR skips the Triton-IR
    passes (XLA runs them), so the hook runs them before ttgir, and times every phase."""
    ran, seconds = [], {}
    stages = {p: (lambda src, md, p=p: ran.append(p) or f"{src}>{p}") for p in resources.PHASES}
    hook = resources._timed_stages(seconds)
    assert hook() == ("timed", "timed")
    hook(None, stages, None, None, None)
    src = "ir"
    for p in resources.PHASES[1:]:  # what triton.compile runs for a .ttir source
        src = stages[p](src, {})
    assert ran == list(resources.PHASES) and src == "ir>" + ">".join(resources.PHASES)
    assert sorted(seconds) == sorted(resources.PHASES) and all(t >= 0 for t in seconds.values())


def test_a_kernel_over_the_hopper_shared_memory_fails_the_check_and_is_named(monkeypatch, capsys, tmp_path):
    """triton_resources exits 1 and names each kernel (config, forward or backward) whose shared
    memory is over the 232,448 bytes an H100/H200 block may have (what XLA refused on an H200 for
    nl_350m's backward under "highest"), 0 when all fit: checked on a fake resource table, since
    compiling needs the `triton` package and a minute per kernel."""
    table = {"memory forward (fake)": 232448, "memory backward (fake)": 348160}  # shared bytes per kernel
    monkeypatch.setattr(resources, "kernels", lambda config, precision: {n: ("module", 8, 1) for n in table})
    monkeypatch.setattr(resources, "compiled", lambda text, warps, stages, work, names=iter(table): {
        "warps": warps, "stages": stages, "shared_bytes": table[next(names)], "registers": 255,
        "spill_store_bytes": 0, "compile_s": {}, "compile_total_s": 0.0, "fits": None})
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="fake"))
    out = tmp_path / "r.json"
    assert resources.main(["--config", "nl_350m", "--precision", "highest", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["triton_resources: nl_350m: memory backward (fake) at 8 warps asks for 348160 bytes of shared "
                   "memory, over the 232448 an H100/H200 block has"]
    assert [r["shared_bytes"] for r in json.loads(out.read_text())["rows"]] == [232448, 348160]  # written first
    table["memory backward (fake)"] = 232448
    monkeypatch.setattr(resources, "compiled", lambda text, warps, stages, work: {
        "warps": warps, "stages": stages, "shared_bytes": 232448, "registers": 255, "spill_store_bytes": 0,
        "compile_s": {}, "compile_total_s": 0.0, "fits": True})
    assert resources.main(["--config", "nl_350m"]) == 0 and capsys.readouterr().err == ""
    assert resources.over_limit([{"config": "c", "kernel": "k", "warps": 4, "shared_bytes": 232449}]) != []
