import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/synthetic.py
if os.environ.get("SPECULANT_TEST_DEVICE", "cpu") == "cpu":  # Triton kernels on CPU tensors: its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from speculant import models  # noqa: E402

TARGET, DRAFT, SMALL = models.DEFAULT_TARGET, models.DEFAULT_DRAFT, "smollm2-135m-instruct"
SHIPPED_DRAFT = models.REGISTRY[DRAFT].derived_from or DRAFT  # the file the default draft is made from


def as_from_a_terminal():
    """preexec_fn for a CLI child that a test signals: Ctrl-C reaches a command started from a terminal, but a CI
    job run in the background of a shell has SIGINT ignored and a child inherits that (rightly: `nohup cmd &`
    must not die of it), so the child gets the default back."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _backend(name, **kw):
    path = models.cached_path(name)
    if not path.exists():
        pytest.skip(f"{name} not pulled (run `make models`)")
    from speculant.backends.llamacpp import LlamaCppBackend

    return LlamaCppBackend(path, **kw)


@pytest.fixture(scope="session")
def qwen_target():
    b = _backend(TARGET, n_ctx=2048)
    yield b
    b.close()


@pytest.fixture(scope="session")
def qwen_draft():
    b = _backend(DRAFT, n_ctx=2048, repack=True)
    yield b
    b.close()


@pytest.fixture(scope="session")
def qwen_draft_shipped():
    b = _backend(SHIPPED_DRAFT, n_ctx=2048, repack=True)
    yield b
    b.close()


@pytest.fixture(scope="session")
def small_target():
    b = _backend(SMALL, n_ctx=2048)
    yield b
    b.close()


@pytest.fixture(scope="session")
def small_draft_same_numerics():
    """SmolLM2 again, loaded exactly like the target (no repack): its logits equal the target's."""
    b = _backend(SMALL, n_ctx=2048)
    yield b
    b.close()


@pytest.fixture()
def small_disk(tmp_path):
    """A real 40 MiB filesystem (tmpfs): disk-full paths without filling the machine's disk. Needs root."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mount)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def rerun_on_haswell(test_file: str, selector: str, n_passed: int) -> None:
    """Run the tests of `test_file` that `selector` (-k) picks in a subprocess on the AVX2 (haswell) variant, as an
    AVX2-only machine runs them (SPECULANT_CPU_VARIANT loads one variant); skip where that says nothing new."""
    import subprocess

    from speculant import native
    from speculant.backends import llamacpp  # noqa: F401  (loads the backends)

    info = native.build_info()
    if info is None or "haswell" not in info["variants"].split(","):
        pytest.skip("no haswell variant in this llama.cpp build")
    if not {"avx2", "fma", "f16c"} <= native.cpu_flags():
        pytest.skip("this CPU has no AVX2")
    if native.loaded_variant() == "haswell":
        pytest.skip("the haswell variant is this machine's own: the tests ran on it already")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", selector],
                          env={**os.environ, "SPECULANT_CPU_VARIANT": "haswell"}, capture_output=True, text=True,
                          timeout=900, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0 and f"{n_passed} passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def write_imatrix(path, entries: dict, *, legacy: bool = False, ncall: int = 10):
    """An importance matrix file as llama-imatrix writes it, for entries {tensor name: mean squared activations
    per input column}: GGUF (NAME.in_sum2 sums over `ncall` tokens, NAME.counts) or the older .dat."""
    import numpy as np

    if legacy:  # n_entries; per entry: name length, name, ncall, nval, values; then chunk count, dataset name
        parts = [np.int32(len(entries)).tobytes()]
        for name, values in entries.items():
            raw = name.encode()
            parts += [np.int32(len(raw)).tobytes(), raw, np.int32(ncall).tobytes(), np.int32(values.size).tobytes(),
                      (values * ncall).astype(np.float32).tobytes()]
        parts += [np.int32(ncall).tobytes(), np.int32(4).tobytes(), b"test"]
        path.write_bytes(b"".join(parts))
        return
    from gguf import GGUFWriter

    w = GGUFWriter(path, arch="imatrix")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["test"])
    w.add_uint32("imatrix.chunk_count", ncall)
    w.add_uint32("imatrix.chunk_size", 1)
    for name, values in entries.items():
        w.add_tensor(f"{name}.in_sum2", (values * ncall).astype(np.float32).reshape(1, -1))
        w.add_tensor(f"{name}.counts", np.array([[ncall]], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def small_imatrix_entries(seed=0):
    """Made-up mean squared activations for every matrix of SmolLM2 (the quantizer only weighs columns by them)."""
    import numpy as np
    from gguf import GGUFReader

    rng = np.random.default_rng(seed)
    return {t.name: rng.uniform(0.1, 2.0, int(t.shape[0])).astype(np.float32)
            for t in GGUFReader(models.cached_path(SMALL), "r").tensors
            if t.name.startswith("blk.") and len(t.shape) >= 2}


# Left to `make test-all` (pytest -m slow); `make test`, the CI, must end within its limit on the slowest machines
# we get. Each repeats a path the suite checks elsewhere with a smaller model or another setting, or runs a
# whole benchmark. Node id prefix -> where the path stays checked.
SLOW = {
    "tests/test_batching.py::test_slots_in_merged_passes_get_the_bits_they_get_alone[qwen2.5-coder-1.5b-instruct]":
        "the same merged-pass bits with SmolLM2",
    "tests/test_bench.py::test_end_to_end_bench_with_torch_methods_and_memory":
        "test_end_to_end_tiny_bench_writes_every_file; the torch methods in test_torch_backend",
    "tests/test_bench.py::test_costs_table_on_a_small_model": "the pass timing it runs: test_costprofile",
    "tests/test_cli.py::test_draft_with_another_vocabulary_drafts_through_text": "test_crossvocab (real pair too)",
    "tests/test_constraint.py::test_sampled_sequences_under_a_constraint_follow_the_target[T0.8-topk3]": "[T1]",
    "tests/test_constraint.py::test_sampled_sequences_under_a_constraint_follow_the_target[T1.2-topp]": "[T1]",
    "tests/test_constraint.py::test_sampled_sequences_with_drawn_rows_follow_the_target[T1.2-topp]": "[T1]",
    "tests/test_constraint.py::test_sampled_sequences_under_a_triggered_grammar_follow_the_target[T0.8-topk3]":
        "[T1]",
    "tests/test_llamacpp.py::test_every_pass_size_up_to_the_invariant_limit_is_bit_identical_smollm2":
        "test_pass_sizes_are_bit_identical_smollm2 (sizes 1..17 and the tiles' edges)",
    **{f"tests/test_llamacpp.py::test_pass_sizes_are_bit_identical_other_weight_types[{case}]":
       "test_native checks the type's kernel against ggml's; end to end: Q8_0, Q4_0 repacked"
       for case in ("Q5_0-True", "Q5_1-True", "Q4_0-False", "IQ4_NL-False", "IQ2_XXS-True", "IQ1_M-True",
                    "IQ4_NL-True", "IQ3_S-True")},
    **{f"tests/test_engine_synthetic.py::test_sampled_sequences_follow_the_target[{case}]":
       "[T1] and [T0.7-topk4]; top-p through the engine: test_lookup_policy [T0.7-topp]; the transforms against "
       "the reference: test_verify" for case in ("T1.3-topp0.8", "T0.9-minp")},
    **{f"tests/test_llamacpp.py::test_pass_sizes_are_bit_identical_mixture_of_experts[{case}]":
       "the expert path repacked (Q4_0, Q4_K_M) and plain (Q4_0)" for case in ("Q8_0-True", "Q4_K_M-False")},
    "tests/test_plan.py::test_repacked_q2_K_weights_match_llama_cpp":
        "test_repacked_weights_match_llama_cpp (the shipped files; a requantized 1.5B target: ~60 s)",
    "tests/test_llamacpp.py::test_pass_sizes_are_bit_identical_low_bit_k_quants[":
        "test_native checks the Q2_K, Q3_K and Q5_K kernels against ggml's (a requantized 1.5B target: 85-110 s)",
    "tests/test_llamacpp.py::test_a_warm_prefill_gives_the_bits_of_a_cold_one[512-token-prefill]":
        "[invariant-prefill], our default; this is a stock build's chunking",
    **{f"tests/test_plan.py::test_plan_within_10_percent_of_measured_peak_rss[{case}]":
       "[2048-600-4]: a prompt, a KV cache and four request slots against a measured peak"
       for case in ("1024-None-1", "4096-600-1")},
    "tests/test_quantize.py::test_a_target_verified_one_token_at_a_time_is_named_when_speculating":
        "test_native's unbatched-weights tests (the count, and the warning's text)",
    "tests/test_quantize.py::test_requantized_model_loads_generates_and_is_registered[Q8_0]": "[Q4_0]",
    "tests/test_quantize.py::test_pull_makes_a_derived_draft_once_with_its_recorded_sha256[qwen2.5-coder-0.5b-instruct-q4_0]":
        "[...-q4_0-out-q4_0], the default draft",
    "tests/test_llamacpp.py::test_pass_sizes_are_bit_identical_qwen_draft":
        "its Q5_0 and Q8_0 rows: test_pass_sizes_are_bit_identical_other_weight_types[Q8_0-True], test_native",
    **{f"tests/test_llamacpp.py::test_greedy_identity_qwen_pair[{case}]": "[code] and [translation]"
       for case in ("math", "story")},
    "tests/test_vocabcut.py::test_qwen_pair_greedy_identity_with_a_cut_draft":
        "test_cut_draft_greedy_identity_and_proposals_stay_in_the_cut, test_cut_gguf_gives_the_same_logits_for_kept_ids",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.nodeid.startswith(prefix) for prefix in SLOW):
            item.add_marker(pytest.mark.slow)
