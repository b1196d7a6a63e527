"""The kernel path (load(kernels="numba"): the large matrices stay as the GGUF holds them, QMatrix views of
its map multiplied by the compiled kernels) against the numpy path (every weight f32: the reference), on
quantized copies of the tiny models (quantized_models.py) and on SmolLM2's Q4_1 file: the same logits
within rounding, and the exactness rules of the numpy path (thread counts, verify passes, drafts, resume).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY
from drafting_helpers import pinned
from quantized_models import quantized_copy
from test_speculative import converse, decoded_one_by_one
from test_threads import assert_same_with_one_and_two_threads, linear_with

from colichat.engine import kernel_path, load, ops
from colichat.engine.ffn import ExpertCache
from colichat.engine.gguf import kernels
from colichat.engine.gguf.qmatrix import QMatrix, stack
from colichat.engine.mapped_experts import MappedExperts
from colichat.engine.ops import SMALL_BATCH, linear
from colichat.engine.threads import Workers

# (model, type): every architecture, each quantized type gguf-py writes, the MoE ones among them
CASES = [("llama", "Q4_1"), ("llama", "Q8_0"), ("ds-v3", "Q8_0"), ("ds-v3", "Q5_0"), ("ds-v2-lite", "Q4_1"),
         ("plm", "F16"), ("minicpm3", "Q5_1"), ("glm-dsa", "Q4_0"), ("ds-dense", "Q8_0")]
BOUND = 1e-4  # |numba - numpy| <= BOUND * max |numpy|: the same values, summed in another order
INT8_BOUND = 0.03  # the same where the kernels round x to 8 bits (kernels.INT8_ACTIVATIONS), as llama.cpp does:
#                    measured 0.011-0.021 on these files (where an MoE routes alike); the greedy token then
#                    agrees at >= 90% of the positions


@pytest.fixture(scope="module")
def qdir(tmp_path_factory):
    return tmp_path_factory.mktemp("quantized")


def both(path: str, n_ctx: int = 256):
    """The model of `path` loaded on the numpy path and on the kernel path."""
    return load(path, n_ctx=n_ctx, kernels="numpy"), load(path, n_ctx=n_ctx, kernels="numba")


@pytest.mark.parametrize("name,qtype", CASES)
def test_both_paths_give_the_same_logits_within_rounding(qdir, name, qtype):
    ref, fast = both(quantized_copy(name, qtype, qdir))
    assert fast.kernels == "numba" and ref.kernels == "numpy"
    # (a type the kernels do not take stays f32 on the kernel path: the numpy path's arrays)
    assert any(isinstance(w, QMatrix) for w in fast.w.values()) == kernels.supported(qtype)
    assert not any(isinstance(w, QMatrix) for w in ref.w.values())
    ids = np.load(TINY / f"{name}.ref.npz")["tokens_0"]
    want, got = ref.prefill(ids), fast.prefill(ids)  # a prefill (T > SMALL_BATCH): dequantized tiles
    want = np.concatenate([want, [ref.decode(int(t)) for t in ids[:5]]])
    got = np.concatenate([got, [fast.decode(int(t)) for t in ids[:5]]])  # decode: the kernels' matvec
    if qtype in kernels.INT8_ACTIVATIONS:
        # an MoE's routing and DSA's top-k keys are choices: at a position where two experts' (or keys')
        # scores differ by less than x's rounding, the paths choose differently and the logits part there
        # (measured: 3 of 45 positions of ds-v2-lite Q4_1, 6 of 45 of glm-dsa Q4_0); dense models: none
        close = np.abs(got - want).max(1) <= INT8_BOUND * np.abs(want).max()  # (positions,)
        assert close.all() if ref.experts is None else close.mean() >= 0.8
        assert np.mean(got.argmax(1) == want.argmax(1)) >= 0.9
    else:
        assert np.abs(got - want).max() <= BOUND * np.abs(want).max()
        assert np.array_equal(got.argmax(1), want.argmax(1))


def test_routed_experts_are_multiplied_in_the_map_on_the_kernel_path(qdir):
    ref, fast = both(quantized_copy("ds-v3", "Q8_0", qdir))
    assert isinstance(ref.experts, ExpertCache) and isinstance(fast.experts, MappedExperts)
    gate_up, down = fast.experts.fetch(1, [3])[0]
    data = fast.tensors.by_name["blk.1.ffn_gate_exps.weight"].data
    assert np.shares_memory(gate_up.parts[0].rows, data)  # a view of the map: nothing read or copied
    assert np.array_equal(gate_up.f32(), np.concatenate([fast.tensors.f32("blk.1.ffn_gate_exps.weight", 3),
                                                         fast.tensors.f32("blk.1.ffn_up_exps.weight", 3)]))
    assert np.array_equal(down.f32(), fast.tensors.f32("blk.1.ffn_down_exps.weight", 3))


def test_f32_files_take_the_same_path_either_way():
    """F32 tensors stay the arrays they are on the kernel path: a tiny F32 model gives the same bits."""
    ref, fast = both(str(TINY / "ds-v3.gguf"))
    assert not any(isinstance(w, QMatrix) for w in fast.w.values())
    ids = np.load(TINY / "ds-v3.ref.npz")["tokens_0"]
    assert np.array_equal(ref.prefill(ids), fast.prefill(ids))


@pytest.mark.parametrize("kernel_path", ["numba", "numpy"])
@pytest.mark.parametrize("case", ["ref", "long.ref"])
def test_tiny_q8_0_matches_llama_cpp_on_both_paths(case, kernel_path):
    """test_engine_mla's tolerances (llama.cpp rounds the activations to Q8_0): argmax at >= 90% of the
    positions, max difference < 0.25 on the 40-token case and at >= 90% of the 320 positions."""
    ref = np.load(TINY / f"ds-v3.q8_0.{case}.npz")
    logits = load(str(TINY / "ds-v3.q8_0.gguf"), n_ctx=512, kernels=kernel_path).prefill(ref["tokens_0"])
    diff = np.abs(logits - ref["logits_0"]).max(axis=1)
    assert np.mean(logits.argmax(1) == ref["logits_0"].argmax(1)) >= 0.9
    assert diff.max() < 0.25 if case == "ref" else np.mean(diff < 0.25) >= 0.9


@pytest.mark.default_model
def test_smollm2_keeps_its_matrices_in_the_map(default_model_path):
    model = load(default_model_path, n_ctx=256, kernels="numba")
    qkv = model.w["blk.0.attn_qkv"]
    if not kernels.supported("Q4_1"):  # (until the kernels take it: f32, as on the numpy path)
        assert isinstance(qkv, np.ndarray)
        return
    assert isinstance(qkv, QMatrix) and qkv.qtypes == ("Q4_1",) * 3
    assert np.shares_memory(qkv.parts[0].rows, model.tensors.by_name["blk.0.attn_q.weight"].data)
    f32 = sum(w.nbytes for w in model.w.values() if isinstance(w, np.ndarray))
    assert f32 < 1 << 20  # norms only: 30 layers x 2 x 576 floats, and the output norm


@pytest.mark.default_model
@pytest.mark.parametrize("kernel_path", ["numba", "numpy"])
def test_smollm2_matches_llama_cpp_on_both_paths(default_model_path, kernel_path):
    """test_engine_llama's tolerances: argmax at >= 90% of positions, the same top 5 at the last."""
    from conftest import SMOLLM2_REF

    ref = np.load(SMOLLM2_REF)
    model = load(default_model_path, n_ctx=2048, kernels=kernel_path)
    agree = total = 0
    for i in range(4):
        model.reset()
        logits = model.prefill(ref[f"tokens_{i}"])
        agree += int(np.sum(logits.argmax(1) == ref[f"topk_ids_{i}"][:, 0]))
        total += len(logits)
        last = ref[f"last_logits_{i}"]
        assert set(np.argsort(-logits[-1])[:5]) == set(np.argsort(-last)[:5]), f"case {i}"
    assert agree / total >= 0.9


@pytest.mark.parametrize("t", [1, 3, SMALL_BATCH, SMALL_BATCH + 1, 70, 300])
def test_a_quantized_product_gives_the_same_bits_with_one_two_and_three_threads(qdir, t, monkeypatch):
    """Over several parts and many blocks: the same bits on any thread count. Where the kernels' products
    take T rows (Q8_0's int8 products: up to 256) row i is the one-row product's; above, a prefill's
    dequantized tiles (of 16 rows here) multiply float32 x."""
    monkeypatch.setattr(ops, "MATVEC_SPLIT", 0)
    monkeypatch.setattr(ops, "TILE_BYTES", 16 * 4 * 64)
    m = load(quantized_copy("llama", "Q8_0", qdir), n_ctx=64)
    w = m.w["blk.0.ffn_gate_up"]  # (2F, D): gate and up
    x = np.random.default_rng(t).standard_normal((t, w.shape[1]), dtype=np.float32)
    token = ops.KERNEL_WORKERS.set(None)
    one = linear_with(None, x, w)
    for n in (2, 3):
        ops.KERNEL_WORKERS.set(Workers(n))
        for _ in range(3):
            assert np.array_equal(linear_with(Workers(n), x, w), one)
    ops.KERNEL_WORKERS.reset(token)
    want = x.astype(np.float64) @ w.f32().T.astype(np.float64)
    assert w.takes(t) == (t <= 256)
    if w.takes(t):  # (the matvec rounds x to 8 bits, Q8_0's blocks)
        assert np.abs(one - want).max() <= INT8_BOUND * np.abs(want).max()
        for i in range(t):
            assert np.array_equal(one[i], linear(x[i : i + 1], w)[0])
    else:
        assert np.allclose(one, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,qtype", [("llama", "Q4_1"), ("ds-v3", "Q8_0")])
def test_quantized_logits_and_cache_are_the_same_with_one_and_two_threads(qdir, name, qtype, monkeypatch):
    assert_same_with_one_and_two_threads(load(quantized_copy(name, qtype, qdir), n_ctx=256), 40, monkeypatch)


@pytest.mark.parametrize("name,qtype", [("llama", "Q4_1"), ("ds-v3", "Q8_0"), ("glm-dsa", "Q4_0")])
def test_a_quantized_verify_pass_writes_the_rows_and_logits_decoding_would(qdir, name, qtype):
    model = load(quantized_copy(name, qtype, qdir), n_ctx=1024)
    model.threads = pinned()
    rng = np.random.default_rng(1)
    prompt, toks, ref, ref_rows = decoded_one_by_one(model, rng, 40)
    got, i = [], 0
    while i < len(toks):
        c = int(rng.integers(2, 10))
        got.append(model.prefill(toks[i : i + c]))
        i += c
    assert np.array_equal(np.concatenate(got), ref)
    assert bytes(model.cache.raw(0, model.cache.length)) == ref_rows


@pytest.mark.parametrize("name,qtype", [("llama", "Q8_0"), ("ds-v3", "Q4_1")])
def test_quantized_greedy_answers_and_resumed_sessions_are_the_same_with_drafts(qdir, name, qtype, tmp_path):
    """converse: four exchanges, a /rewind, a close and a /resume: the answers and the saved cache file
    are the same with drafts as without."""
    model = load(quantized_copy(name, qtype, qdir), n_ctx=1024)
    model.threads = pinned(row_cost=0.1)
    plain, kv_plain, none = converse(model, tmp_path / "plain", draft=0)
    fast, kv_fast, accepted = converse(model, tmp_path / "draft", draft=5)
    assert none == 0 and accepted > 0
    assert fast == plain and kv_fast == kv_plain


def test_stacked_parts_are_views_and_f32_joins_as_f32(qdir):
    m = load(quantized_copy("llama", "Q8_0", qdir), n_ctx=64)
    q, k = m.tensors.qmatrix("blk.0.attn_q.weight"), m.tensors.qmatrix("blk.0.attn_k.weight")
    qk = stack([q, k])
    assert qk.qtypes == ("Q8_0", "Q8_0") and qk.shape == (q.shape[0] + k.shape[0], q.shape[1])
    assert qk.edges() == [0, q.shape[0], qk.shape[0]] and qk.nbytes == q.nbytes + k.nbytes
    assert np.shares_memory(qk.parts[1].rows, m.tensors.by_name["blk.0.attn_k.weight"].data)
    mixed = stack([q, k.f32()])
    assert isinstance(mixed, np.ndarray) and np.array_equal(mixed, np.concatenate([q.f32(), k.f32()]))
    ids = np.array([0, 5, q.shape[0] + 2])
    assert np.array_equal(qk[ids], qk.f32()[ids])  # an embedding lookup's rows


def test_the_numpy_path_is_taken_where_the_kernels_cannot_run(qdir, monkeypatch):
    monkeypatch.setattr(kernels, "problem", lambda: "numba is not installed")
    notes = []
    model = load(quantized_copy("llama", "Q8_0", qdir), n_ctx=64, on_note=notes.append)
    assert model.kernels == "numpy" and not any(isinstance(w, QMatrix) for w in model.w.values())
    assert len(notes) == 1 and "numba is not installed" in notes[0] and "--kernels numpy" in notes[0]


def test_llama_cpp_numerics_take_the_numpy_path(qdir):
    model = load(quantized_copy("llama", "Q8_0", qdir), n_ctx=64, numerics="llama.cpp")
    assert model.kernels == "numpy"


def test_the_weights_cache_keeps_only_the_f32_weights_and_names_the_matrices(qdir, tmp_path):
    """The kernel path's entry holds the f32 leftovers; its QMatrix weights are the GGUF's tensors mapped again
    (the same logits); each path has its own entry, and the old format's entries of the file are removed."""
    import json
    import shutil

    path = tmp_path / "m.gguf"
    shutil.copy(quantized_copy("ds-v3", "Q8_0", qdir), path)
    cache = tmp_path / "weights"
    old = cache / "an-old-entry"  # what an older colichat (format 3) left for the same file
    old.mkdir(parents=True)
    (old / "meta.json").write_text("0\n" + json.dumps({"format": 3, "gguf": str(path.resolve())}))
    first = load(str(path), n_ctx=128, cache_dir=cache)
    second = load(str(path), n_ctx=128, cache_dir=cache)
    assert not old.exists()
    ids = np.load(TINY / "ds-v3.ref.npz")["tokens_0"]
    assert np.array_equal(first.prefill(ids), second.prefill(ids))
    w = second.w["blk.0.attn_in"]
    assert isinstance(w, QMatrix)
    assert np.shares_memory(w.parts[0].rows, second.tensors.by_name["blk.0.attn_q_a.weight"].data)
    assert not second.w["output_norm"].flags.writeable  # mapped from the entry
    (entry,) = list(cache.iterdir())
    f32 = sum(a.nbytes for a in first.w.values() if isinstance(a, np.ndarray))
    assert (entry / "weights.f32").stat().st_size < f32 + 64 * len(first.w)  # the f32 arrays alone
    assert (entry / "weights.f32").stat().st_size < path.stat().st_size // 2
    load(str(path), n_ctx=64, cache_dir=cache, kernels="numpy")  # the numpy path: an entry of its own, beside
    assert len(list(cache.iterdir())) == 2
    second.reset()
    assert np.array_equal(load(str(path), n_ctx=64, cache_dir=cache).prefill(ids), second.prefill(ids))


def test_a_file_larger_than_the_free_memory_runs_from_the_map(qdir, monkeypatch):
    """The kernel path counts the f32 leftovers, the KV cache and the buffers, not the mapped file: it runs
    where the numpy path (all weights as f32) is refused before any work."""
    import colichat.engine as engine
    from colichat.engine.model import working_bytes
    from colichat.errors import ModelError

    path = quantized_copy("ds-v3", "Q8_0", qdir)
    m = load(path, n_ctx=64)
    est = m.memory_estimate()
    assert est.mapped > 0 and est.total == est.held + est.mapped
    assert est.held == m.weight_bytes + m.cache.record_bytes * 64 + working_bytes(m.cfg)
    assert "mapped from the file" in str(est)
    monkeypatch.setattr(engine, "available_memory", lambda: est.held + 1024)  # what it holds: not the whole file
    assert load(path, n_ctx=64).kernels == "numba"
    with pytest.raises(ModelError, match="as f32 but only"):
        load(path, n_ctx=64, kernels="numpy")


@pytest.mark.process
def test_the_first_start_says_it_compiles_the_kernels_and_later_starts_load_them_quietly(tmp_path):
    """In a process (the compiled kernels live in one): the first start of a file the kernels take compiles
    them into the cache directory and says how long it took; the next start loads them and says nothing;
    --kernels numpy answers without them."""
    from cli_helpers import chat

    args = ["--model", TINY / "ds-v3.q8_0.gguf", "--temperature", "0", "--max-tokens", "6", "--no-save", "-p", "hi"]
    own = {"NUMBA_CACHE_DIR": ""}  # (not the tests' shared cache: colichat's own, empty)
    numba = [*args, "--kernels", "numba"]  # (a file this small takes the numpy path by default: the next test)
    first, again = chat(tmp_path, numba, env_extra=own).ok(), chat(tmp_path, numba, env_extra=own).ok()
    assert "kernels: compiled in " in first.err and "(the first start; later starts load them)" in first.err
    assert "kernels" not in again.err and again.out == first.out
    assert list((tmp_path / "cache" / "kernels").rglob("*.nbi"))
    numpy = chat(tmp_path, [*args, "--kernels", "numpy"], env_extra=own).ok()  # (its answer may differ: the
    # kernels round x to 8 bits for Q8_0, as llama.cpp does; test_both_paths_give_the_same_logits_within_rounding)
    assert numpy.out.strip() and "mapped from the file" in first.err and "mapped" not in numpy.err
    assert "kernels" not in numpy.err


def test_auto_takes_the_numpy_path_for_a_small_model_without_int8_products_and_the_kernels_else(qdir, monkeypatch):
    """auto: the kernels for a small file whose matrices all have int8 products (Q8_0 here, SmolLM2's Q4_1 and
    Q8_0) and for any larger file; numpy for a small file of other types (F16 here) or of F32 alone."""
    import colichat.engine as engine

    int8, other = str(TINY / "ds-v3.q8_0.gguf"), quantized_copy("plm", "F16", qdir)
    assert kernel_path("auto", "fast", path=int8) == "numba"
    assert kernel_path("auto", "fast", path=other) == "numpy" and kernel_path("numba", "fast", path=other) == "numba"
    assert kernel_path("auto", "fast", path=str(TINY / "ds-v3.gguf")) == "numpy"  # (F32 alone)
    monkeypatch.setattr(engine, "SMALL_F32", 1)  # every file is larger
    assert kernel_path("auto", "fast", path=other) == "numba"
    assert kernel_path("auto", "llama.cpp", path=int8) == "numpy"  # (llama.cpp numerics: always f32)


@pytest.mark.parametrize("t", [1, 3])
def test_a_small_pass_shares_the_experts_out_whole_with_the_same_bits(qdir, t, monkeypatch):
    """On the kernel path a decode or verify pass's routed experts go to the workers whole (each expert's
    products on one thread): the experts run on more than one thread, and the layer's output has the bits
    of one thread's."""
    import threading

    from colichat.engine import ffn

    m = load(quantized_copy("ds-v3", "Q8_0", qdir), n_ctx=64)
    assert isinstance(m.experts, MappedExperts)
    n_expert, d = m.cfg.n_expert, m.cfg.n_embd
    rng = np.random.default_rng(t)
    x = rng.standard_normal((t, d), dtype=np.float32)
    ids = np.stack([rng.choice(n_expert, 4, replace=False) for _ in range(t)])  # (T, U)
    w = rng.random((t, 4), dtype=np.float32)
    threads, swiglu = set(), ffn.swiglu

    def seen(*args):
        threads.add(threading.get_ident())
        return swiglu(*args)

    monkeypatch.setattr(ffn, "swiglu", seen)
    token = ops.KERNEL_WORKERS.set(None)
    try:
        one = ffn.moe(x, ids, w, 1, m.experts)
        assert len(threads) == 1
        for n in (2, 3):
            ops.KERNEL_WORKERS.set(Workers(n))
            for _ in range(3):
                assert np.array_equal(ffn.moe(x, ids, w, 1, m.experts), one)
    finally:
        ops.KERNEL_WORKERS.reset(token)
    assert len(threads) > 1


def mapped_kib(path: str) -> int:
    """KiB of `path`'s pages mapped into this process (/proc/self/smaps: Rss of its mappings)."""
    total, ours = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                ours = line.rstrip().endswith(str(path))
            elif ours and head[0] == "Rss:":
                total += int(head[1])
    return total


def test_page_in_maps_the_whole_file_before_the_first_prompt(qdir, tmp_path):
    """Tensors.page_in maps every tensor's pages (one madvise a chunk), as the first prompt's products would
    otherwise fault them in a page at a time; a set Event stops it before any."""
    import shutil
    import threading

    from colichat.engine.gguf.tensors import Tensors, open_gguf

    path = tmp_path / "copy.gguf"  # (a file of its own: no other test's map of it in this process)
    shutil.copy(quantized_copy("ds-v3", "Q8_0", qdir), path)
    tensors = Tensors(open_gguf(str(path)), str(path))
    size_kib = path.stat().st_size // 1024
    before = mapped_kib(path)
    stopped = threading.Event()
    stopped.set()
    tensors.page_in(stopped)
    assert mapped_kib(path) == before < size_kib // 2
    tensors.page_in(threading.Event())
    assert mapped_kib(path) >= size_kib - 64  # (every tensor's pages: all but the header's few)


def test_a_file_larger_than_the_memory_allowed_is_not_paged_in(qdir, monkeypatch):
    """Model.page_in maps the file only where it fits in the memory this process may use (MemAvailable and
    its cgroup's limit): a larger one is left to the page cache."""
    from colichat.engine import model as model_module

    m = load(quantized_copy("ds-v3", "Q8_0", qdir), n_ctx=64)
    stopped = m.page_in()
    assert stopped is not None
    stopped.set()
    monkeypatch.setattr(model_module, "memory_limit", lambda: 1 << 20)  # a cgroup of 1 MiB
    assert m.page_in() is None
    monkeypatch.setattr(model_module, "memory_limit", lambda: None)
    monkeypatch.setattr(model_module, "available_memory", lambda: 1 << 20)
    assert m.page_in() is None


def test_memory_limit_reads_the_cgroup_and_skips_what_it_cannot_read(monkeypatch, tmp_path):
    """memory_limit(): a v2 memory.max under /sys/fs/cgroup, none for "max", and a line it cannot parse
    skipped rather than raised."""
    import builtins

    from colichat.engine.model import memory_limit

    files = {"/proc/self/cgroup": "garbage\n0::/user.slice\n", "/sys/fs/cgroup/user.slice/memory.max": "8589934592\n"}
    real = builtins.open

    def fake(path, *args, **kwargs):
        if str(path) in files:
            (tmp_path / "f").write_text(files[str(path)])
            return real(tmp_path / "f", *args, **kwargs)
        raise OSError(2, "no such file")

    monkeypatch.setattr(builtins, "open", fake)
    assert memory_limit() == 8 << 30
    files["/sys/fs/cgroup/user.slice/memory.max"] = "max\n"
    assert memory_limit() is None
