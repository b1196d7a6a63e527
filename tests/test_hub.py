"""--model hf:OWNER/REPO[:QUANT | /FILE.gguf] and --models, against a stand-in for the Hugging Face Hub
(hub_server.py: the endpoints huggingface_hub calls) serving the tiny GGUFs; the hub's cache in tmp_path.
In-process tests give colichat.models.hub the server as `endpoint` and the cache as `cache_dir`; the processes
get HF_ENDPOINT and HF_HOME, as a user would set them."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_helpers import GREEDY, TINY_LLAMA, chat, copy_gguf
from conftest import TINY
from gguf_factory import DS2Spec, write_deepseek2
from hub_server import HubServer, SilentServer

from colichat.engine import ModelError, load
from colichat.errors import UsageError
from colichat.models import hub
from colichat.units import format_size

REPO = "test/tiny-GGUF"
LLAMA = Path(TINY_LLAMA).read_bytes()


def blobs(cache: Path) -> list[Path]:
    """The files the hub's cache holds (downloads completed)."""
    return [p for p in cache.glob("models--*/blobs/*") if p.is_file()]


def fetch(server: HubServer, cache: Path, spec: str, said: list | None = None) -> str:
    return hub.model_file(spec, (said if said is not None else []).append, endpoint=server.url, cache_dir=cache)


def huge_header(path: Path) -> bytes:
    """A llama GGUF's header declaring a 16 TiB f32 token_embd (its data never sent: the refusal comes first)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor_info("token_embd.weight", (1 << 22, 1 << 20), np.dtype(np.float32), 4 << 42)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path.read_bytes()


def split_model(tmp_path: Path, parts: int = 3) -> dict:
    """A tiny deepseek2 model written as `parts` parts: {repo path: bytes}."""
    (tmp_path / "split").mkdir()
    first = write_deepseek2(tmp_path / "split" / "tiny-Q8_0.gguf", DS2Spec(qtype="Q8_0", shards=parts))
    return {p.name: p.read_bytes() for p in sorted(first.parent.glob("tiny-Q8_0-*-of-*.gguf"))}


# ---- which file: the rules over a repository's listing (no hub) ------------------------------------------


def test_no_quant_takes_the_only_gguf_or_q4_k_m_and_says_so_or_lists_the_choices():
    one, _ = hub.choose(hub.parse("hf:a/b"), {"x-Q8_0.gguf": 5, "README.md": 1, "mmproj-x-F16.gguf": 2})
    assert one.files == ("x-Q8_0.gguf",)  # a vision projector is never taken unasked
    pick, note = hub.choose(hub.parse("hf:a/b"), {"x-Q8_0.gguf": 5, "x-Q4_K_M.gguf": 3, "x-Q4_K_S.gguf": 3})
    assert pick.files == ("x-Q4_K_M.gguf",)
    assert note == "hf:a/b: taking Q4_K_M, x-Q4_K_M.gguf, of 3 GGUFs (hf:a/b:QUANT takes another: :Q4_K_S, :Q8_0)"
    with pytest.raises(ModelError, match=r"^hf:a/b: a/b holds several GGUFs: add :QUANT \(or /FILE.gguf\) to take "
                                         r"one; it has :Q5_K_M, :Q8_0$"):
        hub.choose(hub.parse("hf:a/b"), {"x.Q8_0.gguf": 5, "x.Q5_K_M.gguf": 4})
    with pytest.raises(ModelError, match="^hf:a/b: a/b holds no GGUF file$"):
        hub.choose(hub.parse("hf:a/b"), {"config.json": 5})


def test_quant_is_a_word_of_the_name_in_any_case():
    listing = {"M-Q4_K.gguf": 1, "M-Q4_K_M.gguf": 1, "M-IQ4_XS.gguf": 1}
    assert hub.choose(hub.parse("hf:a/b:q4_k_m"), listing)[0].files == ("M-Q4_K_M.gguf",)
    assert hub.choose(hub.parse("hf:a/b:Q4_K"), listing)[0].files == ("M-Q4_K.gguf",)
    with pytest.raises(ModelError, match=r"has no Q6_K GGUF; it has :IQ4_XS, :Q4_K, :Q4_K_M$"):
        hub.choose(hub.parse("hf:a/b:Q6_K"), listing)
    two = {"a/M-Q8_0.gguf": 1, "b/M-Q8_0.gguf": 1}
    with pytest.raises(ModelError, match=r"several GGUFs of a/b are Q8_0: a/M-Q8_0.gguf, b/M-Q8_0.gguf; name one as "
                                         r"hf:a/b/FILE.gguf$"):
        hub.choose(hub.parse("hf:a/b:Q8_0"), two)
    assert hub.choose(hub.parse("hf:a/b/b/M-Q8_0.gguf"), two)[0].files == ("b/M-Q8_0.gguf",)


def test_a_split_model_is_one_choice_of_all_its_parts():
    listing = {f"Q4_K_M/Big-Q4_K_M-0000{i}-of-00003.gguf": 10 for i in (1, 2, 3)} | {"Big-Q2_K.gguf": 7}
    pick, _ = hub.choose(hub.parse("hf:a/b:Q4_K_M"), listing)
    assert pick.files == tuple(f"Q4_K_M/Big-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3))
    assert pick.size == 30
    by_part = hub.choose(hub.parse("hf:a/b/Q4_K_M/Big-Q4_K_M-00002-of-00003.gguf"), listing)[0]
    assert by_part == pick  # any part names the whole model
    del listing["Q4_K_M/Big-Q4_K_M-00003-of-00003.gguf"]
    with pytest.raises(ModelError, match=r"Big-Q4_K_M-00001-of-00003.gguf is a model in 3 parts, but a/b holds 2 "
                                         "of them$"):
        hub.choose(hub.parse("hf:a/b:Q4_K_M"), listing)


def test_a_malformed_hub_model_is_a_usage_error():
    for bad in ("hf:", "hf:owner", "hf:owner/repo/", "hf:owner/repo/file.bin", "hf:../x", "hf:o/r/../x.gguf"):
        with pytest.raises(UsageError, match=r"a model of the Hugging Face Hub is hf:OWNER/REPO"):
            hub.parse(bad)


# ---- downloads (in process) ----------------------------------------------------------------------------


def test_quant_and_file_pick_which_file_is_downloaded(tmp_path):
    other = Path(copy_gguf(TINY_LLAMA, tmp_path / "other.gguf", scale={"output_norm.weight": 2.0})).read_bytes()
    files = {"llama-Q4_K_M.gguf": LLAMA, "llama-Q8_0.gguf": other, "mmproj-llama-F16.gguf": LLAMA}
    cache = tmp_path / "hf"
    with HubServer({REPO: files}) as server:
        path = fetch(server, cache, f"hf:{REPO}:q8_0")
        assert Path(path).name == "llama-Q8_0.gguf" and Path(path).read_bytes() == other
        assert server.full_gets(f"{REPO}/llama-Q8_0.gguf") == 1
        assert server.full_gets(f"{REPO}/llama-Q4_K_M.gguf") == 0
        path = fetch(server, cache, f"hf:{REPO}/llama-Q4_K_M.gguf")
        assert Path(path).name == "llama-Q4_K_M.gguf"
        assert server.full_gets(f"{REPO}/llama-Q4_K_M.gguf") == 1
        assert server.full_gets(f"{REPO}/mmproj-llama-F16.gguf") == 0
        with pytest.raises(ModelError, match=rf"^hf:{REPO}:Q5_K_M: {REPO} has no Q5_K_M GGUF; it has :Q4_K_M, :Q8_0$"):
            fetch(server, cache, f"hf:{REPO}:Q5_K_M")


def test_a_cached_model_starts_with_no_request(tmp_path):
    cache = tmp_path / "hf"
    with HubServer({REPO: {"llama-Q4_K_M.gguf": LLAMA, "llama-Q8_0.gguf": LLAMA}}) as server:
        said = []
        first = fetch(server, cache, f"hf:{REPO}", said)
        assert said[0].startswith(f"hf:{REPO}: taking Q4_K_M, llama-Q4_K_M.gguf, of 2 GGUFs")
        assert said[1] == f"downloading llama-Q4_K_M.gguf (9.0 MiB) from {REPO} into {cache}"
        server.requests.clear()
        again = []
        assert fetch(server, cache, f"hf:{REPO}:Q4_K_M", again) == first
        assert fetch(server, cache, f"hf:{REPO}", again) == first  # the one downloaded is the only one cached
        assert server.requests == [] and again == [
            f"hf:{REPO}: taking llama-Q4_K_M.gguf, the one downloaded (hf:{REPO}:QUANT takes another)"]


def test_a_split_model_downloads_as_a_set_and_loads(tmp_path):
    parts = split_model(tmp_path)
    cache = tmp_path / "hf"
    with HubServer({REPO: {**parts, "llama-Q4_K_M.gguf": LLAMA}}) as server:
        said = []
        path = fetch(server, cache, f"hf:{REPO}:Q8_0", said)
        assert Path(path).name == "tiny-Q8_0-00001-of-00003.gguf"
        assert [line.split(" (")[0] for line in said] == [f"downloading {name}" for name in parts]
        for name in parts:
            assert server.full_gets(f"{REPO}/{name}") == 1
    model = load(path, n_ctx=64)
    assert model.cfg.arch == "deepseek2" and model.cfg.n_layer == DS2Spec().n_layer
    assert np.isfinite(model.prefill([1, 2, 3])).all()


def test_a_dropped_download_resumes_where_it_stopped(tmp_path):
    data = (TINY / "glm-dsa.gguf").read_bytes()  # 15 MiB: the hub's client writes 10 MiB chunks
    cache = tmp_path / "hf"
    cut = 12 << 20
    with HubServer({REPO: {"glm-Q4_K_M.gguf": data}}) as server:
        server.cut[f"{REPO}/glm-Q4_K_M.gguf"] = cut
        path = fetch(server, cache, f"hf:{REPO}")
        ranges = [r for m, p, r in server.requests if m == "GET" and p == f"{REPO}/glm-Q4_K_M.gguf"]
    assert ranges[1] is None and ranges[2] == "bytes=10485760-"  # (after the header's range) the whole file,
    assert len(ranges) == 3  # then, once the connection dropped, only what was not written yet
    assert hashlib.sha256(Path(path).read_bytes()).digest() == hashlib.sha256(data).digest()


def test_a_model_too_big_for_memory_is_refused_before_downloading(tmp_path):
    cache = tmp_path / "hf"
    other = copy_gguf(TINY_LLAMA, tmp_path / "other.gguf", arch="qwen3")
    with HubServer({REPO: {"huge-F32.gguf": huge_header(tmp_path / "huge.gguf"),
                           "other.gguf": Path(other).read_bytes()}}) as server:
        with pytest.raises(ModelError, match=rf"^hf:{REPO}:F32 \(huge-F32.gguf\): its weights need 16384.0 GiB as f32 "
                                             r"but only [\d.]+ GiB of memory is available; use a smaller model "
                                             r"\(nothing was downloaded\)$"):
            fetch(server, cache, f"hf:{REPO}:F32")
        with pytest.raises(ModelError, match=r"architecture 'qwen3' is not supported; colichat runs: llama, .* "
                                             r"\(nothing was downloaded\)$"):
            fetch(server, cache, f"hf:{REPO}/other.gguf")
        assert server.full_gets(f"{REPO}/huge-F32.gguf") == server.full_gets(f"{REPO}/other.gguf") == 0
    assert blobs(cache) == []


def test_hub_failures_are_one_line_each(tmp_path, monkeypatch):
    cache = tmp_path / "hf"
    with HubServer({REPO: {"llama-Q4_K_M.gguf": LLAMA}, "test/gated": {"g-Q4_K_M.gguf": LLAMA}},
                   gated={"test/gated"}) as server:
        with pytest.raises(ModelError, match=r"^hf:test/nothing: there is no repository test/nothing on the Hugging "
                                             r"Face Hub \(a private one needs `hf auth login` or HF_TOKEN\); check the "
                                             "name$"):
            fetch(server, cache, "hf:test/nothing")
        with pytest.raises(ModelError, match=rf"^hf:test/gated: test/gated is gated: accept its conditions at "
                                             rf"{server.url}/test/gated, then log in with `hf auth login` \(or set "
                                             r"HF_TOKEN\)$"):
            fetch(server, cache, "hf:test/gated")
        url = server.url
    monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda s: None)  # (the hub's retries, at once)
    with pytest.raises(ModelError, match=rf"^hf:{REPO}: cannot reach the Hugging Face Hub at {url} \(.+\); check "
                                         r"the network connection \(a model already downloaded starts without one\)$"):
        hub.model_file(f"hf:{REPO}", print, endpoint=url, cache_dir=cache)  # (the server is gone)
    assert blobs(cache) == []


def test_a_file_list_that_is_not_json_is_refused_in_one_line(tmp_path):
    with HubServer({REPO: {"llama-Q4_K_M.gguf": LLAMA}}) as server:
        server.portal = True  # a captive portal answers every request with its sign-in page
        with pytest.raises(ModelError, match=rf"^hf:{REPO}: the Hugging Face Hub at {server.url} answered the list "
                                             rf"of files of {REPO} with something that is not JSON \(a network's "
                                             r"login page\?\); check the network connection, or HF_ENDPOINT$"):
            fetch(server, tmp_path / "hf", f"hf:{REPO}")
    assert blobs(tmp_path / "hf") == []


@pytest.mark.parametrize("sent", [100_000, len(LLAMA)], ids=["in-the-header", "in-the-download"])
def test_a_file_whose_body_stops_before_the_size_announced_is_refused_in_one_line(sent, tmp_path, monkeypatch):
    """10^15 bytes announced, `sent` of them sent, then the connection closed: while its header is read (the
    hub's retry inside its stream gave `RuntimeError: generator didn't stop after throw()`), or while it
    downloads (after the hub's own retries)."""
    monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda s: None)  # (the hub's retries, at once)
    with HubServer({REPO: {"llama-Q4_K_M.gguf": LLAMA[:sent]}}) as server:
        server.announce[f"{REPO}/llama-Q4_K_M.gguf"] = 10**15
        with pytest.raises(ModelError) as refused:
            fetch(server, tmp_path / "hf", f"hf:{REPO}")
    line = str(refused.value)
    assert "\n" not in line
    if sent < len(LLAMA):
        assert line == (f"hf:{REPO}/llama-Q4_K_M.gguf: the Hugging Face Hub announced 1000000000000000 bytes but the "
                        f"connection ended after {sent:,}; try again (nothing was downloaded)")
    else:
        assert line.startswith(f"hf:{REPO}: the Hugging Face Hub at {server.url} sent less than it announced (")
        assert line.endswith("expected 1000000000000000)); try again")


def test_a_file_longer_than_the_size_announced_is_refused_in_one_line(tmp_path, monkeypatch):
    """Half the file's size announced and the whole file sent: what arrives does not match, refused in one
    line, and nothing is kept."""
    monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda s: None)  # (the hub's retries, at once)
    with HubServer({REPO: {"llama-Q4_K_M.gguf": LLAMA}}) as server:
        server.announce[f"{REPO}/llama-Q4_K_M.gguf"] = len(LLAMA) // 2
        with pytest.raises(ModelError) as refused:
            fetch(server, tmp_path / "hf", f"hf:{REPO}")
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"hf:{REPO}"), line
    assert "Consistency check failed" in line and line.endswith("is not the size the Hub announced; try again"), line
    assert blobs(tmp_path / "hf") == []


def test_every_request_gets_a_timeout_where_the_hub_sets_none():
    import httpx2

    from colichat.hints import Said
    from colichat.models.hub_requests import TIMEOUT, Watch

    watch = Watch(Said())
    none = httpx2.Request("GET", "http://127.0.0.1:9/api/models/a/b/tree/main",
                          extensions={"timeout": dict.fromkeys(("connect", "read", "write", "pool"))})
    given = httpx2.Request("HEAD", "http://127.0.0.1:9/a/b/resolve/main/x.gguf",
                           extensions={"timeout": dict.fromkeys(("connect", "read", "write", "pool"), 5.0)})
    for request in (none, given):
        watch.request(request)
    watch.stop()
    assert none.extensions["timeout"] == dict.fromkeys(("connect", "read", "write", "pool"), TIMEOUT)
    assert given.extensions["timeout"] == dict.fromkeys(("connect", "read", "write", "pool"), 5.0)


# ---- the program (processes: HF_ENDPOINT and HF_HOME as a user sets them) -----------------------------------


@pytest.mark.process
def test_a_hub_that_never_answers_says_what_it_waits_for_then_ends_in_one_line(tmp_path):
    """A server that accepts and never answers (it was silent for over 300 s, whatever HF_HUB_ETAG_TIMEOUT):
    after COLICHAT_HUB_WAIT s a line says what colichat waits for, after COLICHAT_HUB_TIMEOUT s one line ends
    it (the run itself is bounded by the test's timeout)."""
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "hf").mkdir()  # (the hub's agent registry, kept fresh: it is not fetched first)
    (tmp_path / "hf" / ".agent_harnesses.json").write_text('{"standardEnvVars": [], "harnesses": {}}')
    with SilentServer() as url:
        run = chat(home, ["--model", f"hf:{REPO}", "-p", "hi"], timeout=60,
                   env_extra=hub_env(url, tmp_path / "hf", COLICHAT_HUB_TIMEOUT="2", COLICHAT_HUB_WAIT="1")).failed()
    assert run.out == b""
    assert run.err.splitlines() == [
        f"waiting for the Hugging Face Hub at 127.0.0.1 to answer: the list of files of {REPO} ...",
        f"colichat: hf:{REPO}: the Hugging Face Hub at {url} did not answer in 2 s (the list of files of {REPO}); "
        "check the network connection (a model already downloaded starts without one)"]



def hub_env(server_url: str, hf_home: Path, **more) -> dict:
    return {"HF_ENDPOINT": server_url, "HF_HOME": str(hf_home), **more}


@pytest.mark.process
def test_hf_model_downloads_loads_and_answers_then_starts_offline(tmp_path):
    home, hf_home = tmp_path / "home", tmp_path / "hf"
    home.mkdir()
    args = ["--model", f"hf:{REPO}", *GREEDY, "--max-tokens", "8", "-p", "hello"]
    with HubServer({REPO: {"llama-Q4_K_M.gguf": LLAMA}}) as server:
        first = chat(home, args, env_extra=hub_env(server.url, hf_home)).ok()
        assert f"downloading llama-Q4_K_M.gguf (9.0 MiB) from {REPO} into {hf_home / 'hub'}" in first.err
        assert first.out and len(first.footers()) == 1
        server.requests.clear()
        again = chat(home, args, env_extra=hub_env(server.url, hf_home)).ok()
        assert server.requests == [] and "downloading" not in again.err
    offline = chat(home, args, env_extra=hub_env(server.url, hf_home, HF_HUB_OFFLINE="1")).ok()
    assert first.out == again.out == offline.out  # the same file, greedy: the same answer
    kept = [*args[:-2], "--session", "kept", "-p", "hello"]
    chat(home, kept, env_extra=hub_env(server.url, hf_home, HF_HUB_OFFLINE="1")).ok()
    export = chat(home, ["--export", "kept", "--model", f"hf:{REPO}"],
                  env_extra=hub_env(server.url, hf_home, HF_HUB_OFFLINE="1")).ok()
    assert "hello" in export.out.decode()  # (the conversation of the model in the cache)
    missing = chat(home, ["--model", "hf:test/other", "-p", "hi"],
                   env_extra=hub_env(server.url, hf_home, HF_HUB_OFFLINE="1")).failed()
    assert missing.errors() == [f"colichat: hf:test/other: not in the Hugging Face cache ({hf_home / 'hub'}) and "
                                "HF_HUB_OFFLINE is set: unset it to download the model"]


@pytest.mark.process
def test_a_missing_repository_is_one_line(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    with HubServer({REPO: {"llama-Q4_K_M.gguf": LLAMA}}) as server:
        r = chat(home, ["--model", "hf:test/nothing:Q4_K_M", "-p", "hi"],
                 env_extra=hub_env(server.url, tmp_path / "hf")).failed()
    assert r.err.strip().splitlines() == [
        "colichat: hf:test/nothing:Q4_K_M: there is no repository test/nothing on the Hugging Face Hub (a private "
        "one needs `hf auth login` or HF_TOKEN); check the name"]
    bad = chat(home, ["--model", "hf:nothing", "-p", "hi"]).exits(2)
    assert bad.errors()[0].startswith("colichat: --model hf:nothing: a model of the Hugging Face Hub is hf:OWNER/REPO")


@pytest.mark.process
def test_models_lists_used_and_cached_models_one_line_each(tmp_path):
    home, hf_home = tmp_path / "home", tmp_path / "hf"
    home.mkdir()
    chat(home, ["--model", TINY_LLAMA, *GREEDY, "--max-tokens", "2", "--session", "used", "-p", "hi"]).ok()
    parts = split_model(tmp_path)
    other = Path(copy_gguf(TINY_LLAMA, tmp_path / "other.gguf", arch="qwen3")).read_bytes()
    with HubServer({REPO: {"llama-Q4_K_M.gguf": LLAMA}, "test/split": parts, "test/other": {"o.gguf": other}}) as s:
        hub.model_file(f"hf:{REPO}", print, endpoint=s.url, cache_dir=hf_home / "hub")
        from huggingface_hub import hf_hub_download  # what another tool leaves: a file colichat would refuse,
        hf_hub_download("test/other", "o.gguf", cache_dir=hf_home / "hub", endpoint=s.url)  # and a part of a set
        hf_hub_download("test/split", next(iter(parts)), cache_dir=hf_home / "hub", endpoint=s.url)
    r = chat(home, ["--models"], env_extra={"HF_HOME": str(hf_home)}).ok()
    lines = r.out.decode().splitlines()
    assert lines[0] == f"{TINY_LLAMA}: llama F32, 9.0 MiB, runs (9.0 MiB of weights as f32); colichat's cache: " \
                       "9.0 MiB"  # used first; its quant from its header (its name has none)
    assert lines[1].endswith("SmolLM2-135M-Instruct.Q4_1.gguf (default): llama Q4_1, 93.8 MiB, runs (513.1 MiB of "
                             "weights as f32); colichat's cache: none yet (the first start fills it)")
    assert lines[2:] == [
        "hf:test/other/o.gguf: qwen3 F32, 9.0 MiB, does not run: architecture 'qwen3' is not supported; colichat "
        "runs: llama, deepseek2, plm, minicpm3, deepseek32, glm-dsa",
        f"hf:test/split/tiny-Q8_0-00001-of-00003.gguf: {format_size(len(next(iter(parts.values()))))}, "
        "incomplete: 1 of 3 parts downloaded (colichat --model hf:test/split/tiny-Q8_0-00001-of-00003.gguf downloads "
        "the rest)",
        f"hf:{REPO}/llama-Q4_K_M.gguf: llama Q4_K_M, 9.0 MiB, runs (9.0 MiB of weights as f32); colichat's cache: "
        "none yet (the first start fills it)"]


@pytest.mark.process
def test_models_lists_a_file_of_the_hub_cache_once_however_its_conversations_reached_it(tmp_path):
    """A conversation made with a file of the hub's cache through another revision's snapshot (or another
    path to that cache): one row, by its hf: name, not its path and its name."""
    home, hf_home = tmp_path / "home", tmp_path / "hf"
    home.mkdir()
    with HubServer({REPO: {"llama-Q4_K_M.gguf": LLAMA}}) as s:
        path = Path(hub.model_file(f"hf:{REPO}", print, endpoint=s.url, cache_dir=hf_home / "hub"))
    older = path.parents[1] / ("0" * 40) / path.name  # another revision's snapshot of the same file
    older.parent.mkdir()
    older.write_bytes(path.read_bytes())
    chat(home, ["--model", str(older), *GREEDY, "--max-tokens", "2", "--session", "used", "-p", "hi"]).ok()
    lines = chat(home, ["--models"], env_extra={"HF_HOME": str(hf_home)}).ok().out.decode().splitlines()
    assert [line.split(":")[0] + ":" + line.split(":")[1] for line in lines if "llama-Q4_K_M" in line] == [
        f"hf:{REPO}/llama-Q4_K_M.gguf"]


def test_the_download_bar_counts_in_binary_units_and_leaves_the_name_to_the_line_above(tmp_path, capsys):
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    from colichat.models.hub import download_bar

    was = are_progress_bars_disabled()  # (off after a download in a test: stderr is no terminal)
    enable_progress_bars()
    try:
        bar = download_bar()(total=3 << 30, desc="(…)a-very-long-name-of-a-model-cut-by-the-hub-Q4_K_M.gguf",
                             disable=False,
                             file=sys.stderr, mininterval=0)
        bar.update(1 << 30)
        bar.close()
    finally:
        if was:
            disable_progress_bars()
    shown = capsys.readouterr().err
    assert "1.00GiB/3.00GiB" in shown and "(…)" not in shown and "MB" not in shown and "GB" not in shown
