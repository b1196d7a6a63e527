"""End to end: a conversation saved by one process and resumed in another continues bit-identically.

Exchanges 1-3 run in this process (the reference). A child runs exchanges 1-2, saving after each,
and exits; a second child resumes the session (no forward pass over the old tokens) and runs
exchange 3. Its cache and its exchange-3 logits must equal the reference's to the bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import TINY

from colichat.persist.kvfile import read_header

pytestmark = pytest.mark.process  # every test here starts a process or a terminal

N_CTX = 256
N_GEN = 4

SCRIPT = """
import sys
import numpy as np
from colichat.engine import load
from colichat.persist import CacheLayout, Store, Turn, model_identity

def exchange(model, i):
    # Exchange i: a user prompt (prefill), then N_GEN greedy tokens. Returns its turns and logits.
    rng = np.random.default_rng(100 + i)
    start = model.cache.length
    ids = rng.integers(1, model.cfg.n_vocab, 5 + 3 * i).tolist()
    logits = [model.prefill(ids)]  # (T, V)
    mid = model.cache.length
    last = logits[0][-1]  # (V,)
    for _ in range(N_GEN):
        last = model.decode(int(np.argmax(last)))
        logits.append(last[None])
    end = model.cache.length
    turns = [Turn("user", f"prompt {{i}}", start, mid), Turn("assistant", f"answer {{i}}", mid, end)]
    return turns, np.concatenate(logits)

def session_args(model, path):
    ident = model_identity(path, model.cfg.arch, model.cfg.name, model.rope_factors)
    return ident, CacheLayout.from_cache(model.cache, model.cfg.n_vocab)

def main(phase, path, out):
    model = load(path, n_ctx={n_ctx})
    ident, layout = session_args(model, path)
    if phase == "reference":
        turns, logits = [], None
        for i in range(3):
            new, logits = exchange(model, i)
            turns += new
            if i == 1:
                after2 = model.cache.records[: model.cache.length].copy()
        cfg = model.cfg
        layout = (cfg.n_layer, cfg.kv_lora_rank, cfg.rope_dim) if cfg.kv_lora_rank else (
            cfg.n_layer, cfg.n_head_kv * cfg.head_dim, cfg.n_head_kv * cfg.head_dim)
        np.savez(out, records=model.cache.records[: model.cache.length], after2=after2, logits=logits,
                 layout=layout)
    elif phase == "save":
        turns = []
        with Store().create(ident, layout, name="resume", sampler={{"temperature": 0}}) as sess:
            for i in range(2):
                turns += exchange(model, i)[0]
                sess.append(model.cache, turns)
    else:
        with Store().open(ident, "resume", layout) as sess:
            res = sess.load(model.cache, ctx_limit=model.n_ctx)
            print(res.summary(), file=sys.stderr)
            after2 = model.cache.records[: model.cache.length].copy()
            new, logits = exchange(model, 2)
            sess.append(model.cache, res.turns + new)
        np.savez(out, records=model.cache.records[: model.cache.length], after2=after2, logits=logits,
                 n_turns=len(res.turns), warnings=len(res.warnings))

main(*sys.argv[1:])
"""


def run(phase: str, model_path, out) -> subprocess.CompletedProcess:
    script = SCRIPT.format(n_ctx=N_CTX).replace("N_GEN", str(N_GEN))
    done = subprocess.run([sys.executable, "-c", script, phase, str(model_path), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.parametrize("model", ["llama.gguf", "ds-v3.gguf", "ds-v32.gguf", "glm-dsa.gguf", "plm.gguf",
                                   "minicpm3.gguf"])
def test_resume_in_a_new_process_is_bit_identical(colichat_home, tmp_path, model):
    path = TINY / model
    run("reference", path, tmp_path / "ref.npz")
    run("save", path, tmp_path / "unused.npz")
    resumed = run("resume", path, tmp_path / "resumed.npz")
    assert "resumed" in resumed.stderr and "no re-prefill" in resumed.stderr
    ref, got = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "resumed.npz")
    assert int(got["n_turns"]) == 4 and int(got["warnings"]) == 0
    assert np.array_equal(got["after2"]["token"], ref["after2"]["token"])
    assert np.array_equal(got["after2"]["kv"], ref["after2"]["kv"])  # the loaded cache
    assert np.array_equal(got["records"]["token"], ref["records"]["token"])
    assert np.array_equal(got["records"]["kv"], ref["records"]["kv"])  # the cache after exchange 3
    assert got["records"].dtype == ref["records"].dtype
    if "ic" in ref["records"].dtype.names:  # sparse attention: the indexer keys too
        assert np.array_equal(got["after2"]["ic"], ref["after2"]["ic"])
        assert np.array_equal(got["records"]["ic"], ref["records"]["ic"])
    assert got["logits"].shape == ref["logits"].shape
    assert np.array_equal(got["logits"], ref["logits"])  # exchange-3 logits, to the bit
    [kv_path] = colichat_home.rglob("resume.coli_kv")  # its header: the latent layout for MLA models
    fd = os.open(kv_path, os.O_RDONLY)
    try:
        header, _ = read_header(fd, str(kv_path))
    finally:
        os.close(fd)
    assert header.magic == (b"COLIGQA\0" if model == "llama.gguf" else b"COLIKV1\0")
    assert (header.n_layer, header.a_width, header.b_width, header.nrec) == (*ref["layout"], len(ref["records"]))
    model_section = json.loads(kv_path.with_suffix(".json").read_text())["model"]
    assert model_section.get("rope_factors") == ("short" if model == "minicpm3.gguf" else None)  # N_CTX 256
