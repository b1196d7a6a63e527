"""Models from the Hugging Face Hub: `--model hf:OWNER/REPO[:QUANT]` or `--model hf:OWNER/REPO/FILE.gguf`.

    path = model_file("hf:bartowski/Foo-GGUF:Q4_K_M", say)  # the local GGUF (a split one's first part)
    cached_models()                                         # [CachedModel] in the hub's cache (--models)

Files come through huggingface_hub (hf_hub_download) into its own cache (HF_HOME, HF_HUB_CACHE), with its
progress bar on a terminal and its resume of a download whose connection drops. Rules:
- A model whose files are all in the cache is used from there with no network request at all (offline,
  HF_HUB_OFFLINE or not).
- Which GGUF: /FILE.gguf names one; :QUANT takes the one whose name carries it as a word (Q4_K_M, q8_0);
  with neither, the only one of the repository, else its PREFERRED one (said), else a refusal listing
  the choices. Vision projectors (mmproj) are never taken unless named. A split model
  (NAME-00001-of-0000N.gguf, llama.cpp's gguf-split naming) is one choice: its parts download together
  and the engine opens it from the first.
- Before anything is downloaded, the headers of its parts are read from the hub (ranges of their first
  MiBs) and judged by the rule loading applies (engine.check_headers): an architecture colichat does
  not run, or dense weights that would not fit in memory as f32, is refused; so is a download the
  cache's disk has no room for.
- Every failure is one line (ModelError): no network, no such repository, file or quant, a gated one, a
  file list that is not JSON (a captive portal's page), a file whose body ends before the size announced.
- Every request has a connect and a read timeout (the hub's own where it sets one, HF_HUB_ETAG_TIMEOUT and
  HF_HUB_DOWNLOAD_TIMEOUT, else COLICHAT_HUB_TIMEOUT, 30 s); a request not answered after COLICHAT_HUB_WAIT
  (5 s) says what it waits for, once, and one that timed out is not sent again: the hub is not answering.
- The cache's refs (refs/main: which snapshot a branch is) are hints the hub's own code opens as they are:
  each is read first as hints are (hints.py), and one that is not a commit hash is removed and said (the
  next download writes it again).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
from contextlib import contextmanager
from typing import NamedTuple

from ..engine import ModelError, check_headers
from ..engine.gguf.header import Header, HeaderError, read_header
from ..errors import UsageError
from ..hints import Said, read_hint
from ..units import format_size
from .hub_requests import HubSilent, watched

PREFIX = "hf:"
PREFERRED = "Q4_K_M"  # with no :QUANT among several GGUFs (llama.cpp's -hf takes it too)
SPEC_RE = re.compile(r"hf:(?P<repo>[\w.-]+/[\w.-]+)(?::(?P<quant>[\w.+-]+)|/(?P<file>[^:]+\.gguf))?", re.A | re.I)
SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<n>\d{5})\.gguf$", re.I)
QUANT_RE = re.compile(r"(?<![A-Za-z0-9])(?:UD-)?(?:I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32|TQ\d_\d|MXFP4(?:_MOE)?)"
                      r"(?![A-Za-z0-9])", re.I)
HEADER_READ = 1 << 20  # bytes of a GGUF first asked for its header; four times more while it runs on
MAX_HEADER = 1 << 28   # a header longer than this is not a GGUF's
COMMIT_RE = re.compile(rb"[0-9a-f]{40}")


class HubSpec(NamedTuple):
    text: str          # as given: hf:OWNER/REPO[:QUANT | /FILE.gguf]
    repo: str          # OWNER/REPO
    quant: str | None
    file: str | None   # a path in the repository


class Choice(NamedTuple):
    """One model of a repository: a GGUF file, or the parts of a split one."""

    files: tuple       # repository paths, the parts in order (those the listing holds)
    parts: int         # how many parts the model has (1: not split)
    size: int          # bytes of the files listed

    @property
    def name(self) -> str:
        return self.files[0]


class CachedModel(NamedTuple):
    spec: str          # hf:OWNER/REPO/FILE.gguf: what --model takes to start it
    path: str          # the first part's file in the cache
    parts: int
    present: int       # parts in the cache
    size: int


def is_hub_model(text: str | None) -> bool:
    return bool(text) and text.startswith(PREFIX)


def parse(text: str) -> HubSpec:
    """The --model hf:... given, or UsageError (a command line no run could carry out)."""
    m = SPEC_RE.fullmatch(text)
    if m is None or ".." in m["repo"] or (m["file"] and ".." in m["file"].split("/")):
        raise UsageError(f"--model {text}: a model of the Hugging Face Hub is hf:OWNER/REPO, hf:OWNER/REPO:QUANT "
                         "(hf:bartowski/Foo-GGUF:Q4_K_M) or hf:OWNER/REPO/FILE.gguf")
    return HubSpec(text, m["repo"], m["quant"], m["file"])


def quant_of(path: str) -> str | None:
    """The quant type a GGUF's name carries (Q4_K_M, IQ4_XS, F16, UD-Q4_K_XL), or None."""
    found = QUANT_RE.findall(os.path.basename(path))
    return found[-1].upper() if found else None


def has_quant(path: str, quant: str) -> bool:
    """`quant` stands in `path` as a word (any case): Q4_K does not match Q4_K_M."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", path, re.I) is not None


def choices(listing: dict) -> list[Choice]:
    """The models among a repository's files ({path: size}): its GGUFs, a split one's parts grouped, by path."""
    singles, sets = [], {}
    for path in sorted(p for p in listing if p.lower().endswith(".gguf")):
        m = SPLIT_RE.match(path)
        if m is None or int(m["n"]) < 2:
            singles.append(Choice((path,), 1, listing[path]))
        else:
            sets.setdefault((m["stem"], int(m["n"])), []).append(path)
    for (_, n), paths in sets.items():
        singles.append(Choice(tuple(paths), n, sum(listing[p] for p in paths)))
    return sorted(singles, key=lambda c: c.name)


def _is_projector(c: Choice) -> bool:
    return "mmproj" in os.path.basename(c.name).lower()


def _offer(spec: HubSpec, models: list[Choice]) -> str:
    """What the repository offers, as --model takes it: `:QUANT` where that names one, else `/FILE`."""
    if not models:
        return f"{spec.repo} holds no GGUF file"
    return f"it has {_names(models)}"


def _names(models: list[Choice]) -> str:
    labels = [quant_of(c.name) for c in models]
    shown = [f":{q}" if q and labels.count(q) == 1 else f"/{c.name}" for q, c in zip(labels, models, strict=True)]
    more = f", ... ({len(shown)} in all)" if len(shown) > 12 else ""
    return ", ".join(shown[:12]) + more


def choose(spec: HubSpec, listing: dict) -> tuple[Choice, str | None]:
    """The model `spec` names among a repository's GGUFs ({path: size}), and a note when it was taken
    for the user (no :QUANT among several); ModelError naming the choices where it names none."""
    every = choices(listing)
    models = [c for c in every if not _is_projector(c)]
    note = None
    if spec.file:
        found = [c for c in every if spec.file in c.files]  # (a part names its whole split model)
        if not found:
            raise ModelError(f"{spec.text}: {spec.repo} has no file {spec.file}; {_offer(spec, models)}")
        pick = found[0]
    elif spec.quant:
        found = [c for c in models if has_quant(c.name, spec.quant)]
        if not found:
            raise ModelError(f"{spec.text}: {spec.repo} has no {spec.quant} GGUF; {_offer(spec, models)}")
        if len(found) > 1:
            raise ModelError(f"{spec.text}: several GGUFs of {spec.repo} are {spec.quant}: "
                             f"{', '.join(c.name for c in found)}; name one as hf:{spec.repo}/FILE.gguf")
        pick = found[0]
    elif len(models) == 1:
        pick = models[0]
    else:
        found = [c for c in models if has_quant(c.name, PREFERRED)]
        if len(found) != 1:
            raise ModelError(f"{spec.text}: {spec.repo} holds several GGUFs: add :QUANT (or /FILE.gguf) to take "
                             f"one; {_offer(spec, models)}" if models else f"{spec.text}: {_offer(spec, models)}")
        pick = found[0]
        note = (f"{spec.text}: taking {PREFERRED}, {pick.name}, of {len(models)} GGUFs (hf:{spec.repo}:QUANT takes "
                f"another: {_names([c for c in models if c is not pick])})")
    if len(pick.files) < pick.parts:
        raise ModelError(f"{spec.text}: {pick.name} is a model in {pick.parts} parts, but {spec.repo} holds "
                         f"{len(pick.files)} of them")
    return pick, note


# ---- the hub's cache ----------------------------------------------------------------------------------


def _cache_dir(cache_dir=None) -> str:
    from huggingface_hub import constants

    return str(cache_dir or constants.HF_HUB_CACHE)


def _cached_repos(cache_dir=None, said: Said | None = None) -> dict:
    """{repo id: {path in the repository: file in the cache}} of the models in the hub's cache, each at
    the revision its main branch points to (else its newest); ModelError if the cache cannot be read.
    Its refs are checked first (_check_refs), a damaged one said through `said`."""
    from huggingface_hub import scan_cache_dir

    root = _cache_dir(cache_dir)
    if not os.path.isdir(root):
        return {}
    _check_refs(root, said or Said())
    try:
        found = scan_cache_dir(root).repos
    except OSError as e:
        raise ModelError(f"cannot read the Hugging Face cache {root}: {_reason(e)}; fix that, or set HF_HOME to "
                         "another directory") from None
    repos = {}
    for repo in found:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = max(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
        repos[repo.repo_id] = {f.file_path.relative_to(rev.snapshot_path).as_posix(): str(f.file_path)
                               for f in rev.files}
    return repos


def _check_refs(root: str, said: Said) -> None:
    """Each ref of the cache's models (models--O--R/refs/**) read as a hint: one that is not a commit hash
    in a small regular file (a FIFO, a link to /dev/zero, other bytes) is removed, and a directory at
    refs/main, which the hub would open as a file, is said and left; said once each."""
    try:
        repos = [e.path for e in os.scandir(root) if e.name.startswith("models--")]
    except OSError:
        return
    for refs in (os.path.join(r, "refs") for r in repos):
        todo = [refs]
        while todo:
            try:
                entries = list(os.scandir(todo.pop()))
            except OSError:
                continue
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    todo.append(e.path)
                    problem = "a directory, not a file" if e.path == os.path.join(refs, "main") else None
                else:
                    problem = read_hint(e.path, _commit, 256).problem
                    if problem:
                        try:
                            os.unlink(e.path)
                        except OSError:
                            problem += "; it could not be removed"
                if problem:
                    said(e.path, f"the Hugging Face cache's ref {e.path} cannot be used ({problem}): ignored")


def _commit(data: bytes) -> str:
    """A ref's commit hash (ValueError: it holds something else)."""
    if not COMMIT_RE.fullmatch(data.strip()):
        raise ValueError("not a commit hash")
    return data.strip().decode()


def cached_models(cache_dir=None, on_note=None) -> list[CachedModel]:
    """The GGUF models in the hub's cache (vision projectors left out), by repository and path."""
    found = []
    for repo, files in sorted(_cached_repos(cache_dir, Said(on_note)).items()):
        ggufs = {p: os.path.getsize(f) for p, f in files.items() if p.lower().endswith(".gguf") and os.path.isfile(f)}
        for c in choices(ggufs):
            if not _is_projector(c):
                found.append(CachedModel(f"{PREFIX}{repo}/{c.name}", files[c.name], c.parts, len(c.files), c.size))
    return found


# ---- the hub -----------------------------------------------------------------------------------------


def model_file(text: str, say, endpoint: str | None = None, cache_dir=None, offline: bool = False) -> str:
    """The local GGUF of --model hf:... (a split model's first part): from the hub's cache, else downloaded
    (saying what and where) once its headers show it runs and fits; offline=True: from the cache or a
    ModelError. `endpoint`, `cache_dir`: the hub's own (HF_ENDPOINT, HF_HUB_CACHE) unless given."""
    spec = parse(text)
    said = Said(lambda line: say(f"note: {line}"))
    with _hub_errors(spec, endpoint, cache_dir):
        cached = _cached_repos(cache_dir, said).get(spec.repo, {})
        try:
            pick, _ = choose(spec, dict.fromkeys(cached, 0))
            if not (spec.quant or spec.file):  # taken for the user, as a download's choice is: said
                n = sum(not _is_projector(c) for c in choices(dict.fromkeys(cached, 0)))
                say(f"{text}: taking {pick.name}, {'the one' if n == 1 else f'of the {n} GGUFs'} downloaded "
                    f"(hf:{spec.repo}:QUANT takes another)")
            return cached[pick.files[0]]
        except ModelError:
            if offline:
                raise ModelError(f"{text}: not downloaded yet (colichat --model {text} downloads it)") from None
        _quiet_hub(said)
        with watched(Said(say)):  # (its lines: what a request waits for)
            return _download(spec, say, endpoint, cache_dir, cached)


def _download(spec: HubSpec, say, endpoint: str | None, cache_dir, cached: dict) -> str:
    """model_file's network side: the listing, the choice, the headers checked, the files downloaded."""
    from huggingface_hub import HfApi, RepoFile, hf_hub_download

    text = spec.text
    try:
        listing = {f.path: f.size for f in HfApi(endpoint=endpoint).list_repo_tree(spec.repo, recursive=True)
                   if isinstance(f, RepoFile)}
    except json.JSONDecodeError:
        raise ModelError(f"{text}: the Hugging Face Hub at {_site(endpoint)} answered the list of files of "
                         f"{spec.repo} with something that is not JSON (a network's login page?); check the "
                         "network connection, or HF_ENDPOINT") from None
    pick, note = choose(spec, listing)
    if note:
        say(note)
    missing = [f for f in pick.files if f not in cached]
    try:
        check_headers(f"{text} ({pick.name})", [_remote_header(spec.repo, f, endpoint) for f in pick.files])
    except ModelError as e:
        raise ModelError(f"{e} (nothing was downloaded)") from None
    _check_room(text, sum(listing[f] for f in missing), _cache_dir(cache_dir))
    paths = []
    for f in pick.files:
        if f in missing:
            say(f"downloading {f} ({format_size(listing[f])}) from {spec.repo} into {_cache_dir(cache_dir)}")
        paths.append(hf_hub_download(spec.repo, f, cache_dir=cache_dir, endpoint=endpoint, tqdm_class=download_bar()))
    return paths[0]


def download_bar():
    """The hub's progress bar (shown on a terminal only), in colichat's units (MiB, GiB: binary, as the
    line above it) and without a file name: that line names the file whole, the bar would cut it."""
    from huggingface_hub.utils import tqdm

    class Bar(tqdm):
        def __init__(self, *args, **kw):
            super().__init__(*args, **{**kw, "desc": "", "unit": "iB", "unit_scale": True, "unit_divisor": 1024,
                                       "bar_format": "{l_bar}{bar}| {n_fmt}iB/{total_fmt}iB [{elapsed}<{remaining}, "
                                                     "{rate_fmt}]"})

    return Bar


def _quiet_hub(said: Said) -> None:
    """The hub's own warnings (each retry of a request) are not for the user: its errors become one line
    here. Its progress bars show on a terminal only, as colichat's own progress does. The list of agent
    harnesses the hub keeps in HF_HOME (read with a plain open() by every request's headers: a FIFO there
    would hang it) is read first as a hint: one that cannot be used is removed (the hub fetches it again)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import disable_progress_bars, logging

    logging.set_verbosity_error()
    if not (sys.stderr and sys.stderr.isatty()):
        disable_progress_bars()
    path = constants.AGENT_HARNESSES_PATH
    problem = read_hint(path, _registry).problem
    if problem:
        if not os.path.isdir(path):
            try:
                os.unlink(path)
            except OSError:
                problem += "; it could not be removed"
        said(path, f"the Hugging Face cache's list of agent harnesses {path} cannot be used ({problem}): ignored")


def _registry(data: bytes) -> dict:
    """The hub's cached agent-harness registry (ValueError: not a JSON object)."""
    registry = json.loads(data)
    if not isinstance(registry, dict):
        raise ValueError("not a JSON object")
    return registry


def _site(endpoint: str | None) -> str:
    from huggingface_hub import constants

    return (endpoint or constants.ENDPOINT).rstrip("/")


def _remote_header(repo: str, file: str, endpoint: str | None) -> Header:
    """The header of GGUF `file` of `repo` on the hub, read by ranges from its start (tensor infos included)."""
    buf = b""
    want = HEADER_READ
    while True:
        buf += _read_range(repo, file, endpoint, len(buf), want)
        try:
            return read_header(buf, lambda key: key in ("general.architecture", "split.count", "split.no"))
        except struct.error:
            if len(buf) < want or want >= MAX_HEADER:
                raise ModelError(f"hf:{repo}/{file}: its GGUF header ends after {len(buf):,} bytes: "
                                 "a damaged file, not one colichat can run") from None
            want *= 4
        except HeaderError as e:
            raise ModelError(f"hf:{repo}/{file}: not a GGUF file colichat reads ({e})") from None


def _read_range(repo: str, file: str, endpoint: str | None, start: int, end: int) -> bytes:
    """Bytes start..end-1 of a file on the hub (fewer at its end), through the hub's own client (its
    token, its retries of an error status); a server that sends the whole file is read no further than
    `end`; one whose body ends before what it announced is refused (ModelError). (A broken connection is
    not retried here: the hub's retry inside a `with` it yields from ends in a RuntimeError.)"""
    import httpx2
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

    url = hf_hub_url(repo, file, endpoint=endpoint)
    headers = {**build_hf_headers(), "Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
    out = bytearray()
    with http_stream_backoff("GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
                             retry_on_exceptions=()) as r:
        if r.status_code == 416:  # the file ends before `start`
            return b""
        hf_raise_for_status(r)
        skip = start if r.status_code == 200 else 0  # the range was not honoured: the file from its start
        try:
            for chunk in r.iter_bytes():
                out += chunk
                if len(out) >= skip + end - start:
                    break
        except (httpx2.RemoteProtocolError, httpx2.ReadError):
            announced = r.headers.get("Content-Length", "?")
            raise ModelError(f"hf:{repo}/{file}: the Hugging Face Hub announced {announced} bytes but the "
                             f"connection ended after {len(out):,}; try again") from None
    return bytes(out[skip : skip + end - start])


def _check_room(text: str, need: int, cache_dir: str) -> None:
    """Refuse a download the disk of the hub's cache has no room for (the hub itself only warns)."""
    d = cache_dir
    while not os.path.isdir(d) and os.path.dirname(d) != d:
        d = os.path.dirname(d)
    free = shutil.disk_usage(d).free
    if need > free:
        raise ModelError(f"{text}: the download needs {format_size(need)} but {d} has {format_size(free)} free; "
                         "free some space, or set HF_HOME to a directory on another disk (nothing was downloaded)")


@contextmanager
def _hub_errors(spec: HubSpec, endpoint: str | None, cache_dir):
    """The hub's errors, each as one line saying what is wrong and what to do (ModelError)."""
    import httpx2
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    site = _site(endpoint)
    unreachable = (f"{spec.text}: cannot reach the Hugging Face Hub at {site} ({{}}); check the network "
                   "connection (a model already downloaded starts without one)")
    try:
        yield
    except HubSilent as e:
        raise ModelError(f"{spec.text}: {e}") from None
    except GatedRepoError:
        raise ModelError(f"{spec.text}: {spec.repo} is gated: accept its conditions at {site}/{spec.repo}, then "
                         "log in with `hf auth login` (or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ModelError(f"{spec.text}: there is no repository {spec.repo} on the Hugging Face Hub (a private one "
                         "needs `hf auth login` or HF_TOKEN); check the name") from None
    except OfflineModeIsEnabled:
        raise ModelError(f"{spec.text}: not in the Hugging Face cache ({_cache_dir(cache_dir)}) and HF_HUB_OFFLINE "
                         "is set: unset it to download the model") from None
    except LocalEntryNotFoundError as e:  # hf_hub_download: no answer from the hub, nothing in the cache
        cause = e.__cause__
        raise ModelError(unreachable.format(_reason(cause) if cause else "no answer")) from None
    except EntryNotFoundError:
        raise ModelError(f"{spec.text}: the file is no longer in {spec.repo} on the Hub; try again") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "an error"
        raise ModelError(f"{spec.text}: the Hugging Face Hub answered {status} ({_reason(e)}); "
                         "try again later") from None
    except httpx2.RemoteProtocolError as e:  # an answer that ends before the size it announced
        raise ModelError(f"{spec.text}: the Hugging Face Hub at {site} sent less than it announced ({_reason(e)}); "
                         "try again") from None
    except httpx2.HTTPError as e:  # no connection, a timeout, a connection cut for good
        raise ModelError(unreachable.format(_reason(e))) from None
    except OSError as e:  # writing the cache (a full disk, no permission: an errno), or the hub's size check
        what = ("check that the Hugging Face cache (HF_HOME) has room and can be written" if e.errno else
                "what arrived is not the size the Hub announced; try again")
        raise ModelError(f"{spec.text}: the download failed: {_reason(e)}; {what}") from None


def _reason(e: BaseException) -> str:
    """An exception's message in one short line."""
    text = (getattr(e, "strerror", None) or str(e) or type(e).__name__).strip()
    return text.splitlines()[0][:200]
