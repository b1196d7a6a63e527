"""What a user meets, the README model table's figures: the first start, later starts, the time to the first
token of a 20-word question and the answer's speed, with the program run as a person runs it, side by side with
llama.cpp (llama-cpp-python's chat completion) on the same file.

    .venv/bin/python benchmarks/as_used.py FILE [FILE ...] [--vs-llamacpp PYTHON] [--tokens 32]
    .venv/bin/python benchmarks/as_used.py default --vs-llamacpp PYTHON     # the default model's file

colichat: `colichat --model FILE --temperature 0 --draft 0 --max-tokens N -p QUESTION`, a new process each run.
The first start has a fresh COLICHAT_HOME (no compiled kernels, no prepared weights) and FILE dropped from the
page cache (posix_fadvise DONTNEED): the first run after a download and a reboot. Later starts keep that home
and find FILE in the page cache (the best of --later runs). Start: from the launch of the process to its
"memory:" line, the last before the prompt is read (python's imports, the kernels compiled or taken from their
cache, the file mapped). First token: from that line to the answer's first byte on stdout (template, prompt
read, first step): what a user waits after Enter. Answer: the tokens after the first over the time from the
first byte to the last (the footer's count). --draft 0: speculative drafts from the conversation would guess
the random files' repetitive answers, which a real answer does not repeat.

llama.cpp, in a child under the --vs-llamacpp python: the same file dropped from the page cache for the first
start; start from the launch of that child to Llama() returned (n_ctx 8192, 2 threads); first token and answer
from Llama.generate (greedy) on the token ids colichat reads for the question (the file's chat template, colichat's
tokenizer: the same prompt), until N tokens or the end of the answer.

The benchmark files are random weights of a real shape (~/.cache/colichat-bench/, benchmarks/dense.py and
moe.py write them), so the answers are nonsense of the right cost. Markdown on stdout, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402  (benchmarks/common.py)

QUESTION = ("In two short sentences, explain why the sky looks blue during the day and why sunsets look red or "
            "orange.")  # 20 words
N_CTX = 8192  # colichat's context for these files (the model's, at most 8192)


def drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to forget FILE's cached pages (clean pages of a file nobody maps go)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def colichat_run(path: Path, home: Path, tokens: int) -> dict:
    """One start of the program on FILE with COLICHAT_HOME=home: its timings, from the launch of the process."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"} | {"COLICHAT_HOME": str(home)}
    cmd = [str(Path(sys.executable).parent / "colichat"), "--model", str(path), "--temperature", "0", "--draft",
           "0", "--max-tokens", str(tokens), "--no-save", "-p", QUESTION]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, bufsize=0)
    lines, chunks = [], []  # (seconds since launch, stderr line) / (seconds, stdout bytes)

    def read_err() -> None:
        for line in p.stderr:
            lines.append((time.perf_counter() - t0, line.decode(errors="replace").rstrip()))

    reader = threading.Thread(target=read_err)
    reader.start()
    while chunk := p.stdout.read(4096):
        chunks.append((time.perf_counter() - t0, chunk))
    p.wait()
    reader.join()
    start = next((t for t, line in lines if line.startswith("memory:")), None)
    footer = next((line for _, line in lines if line.startswith("[") and "tok/s" in line), "")
    n = int(footer[1:].split()[0]) if footer[1:2].isdigit() else 0
    if p.returncode or start is None or not chunks:
        return {"error": f"exit {p.returncode}: " + " | ".join(line for _, line in lines)[-600:]}
    first, last = chunks[0][0], chunks[-1][0]
    kernels = next((line for _, line in lines if line.startswith("kernels:")), None)
    return {"start_s": start, "first_token_s": first - start, "tokens": n,
            "answer_tok_s": (n - 1) / (last - first) if n > 1 and last > first else None, "kernels": kernels}


def prompt_ids(path: Path) -> list[int]:
    """The question as colichat hands it to the model: the file's chat template, tokenized by colichat."""
    from colichat.engine.text.load import load_tokenizer
    from colichat.engine.text.template import chat_template_for

    tok = load_tokenizer(str(path))
    return tok.encode_prompt(chat_template_for(tok).render([{"role": "user", "content": QUESTION}], True))


def llamacpp_child(path: str, tokens: int, launched: float, ids: list[int]) -> dict:
    """In the --vs-llamacpp python: load FILE, read the prompt `ids`, answer greedily, time it (seconds since
    `launched`, wall clock: the child's launch included)."""
    from llama_cpp import Llama

    llm = Llama(path, n_ctx=N_CTX, n_batch=512, n_ubatch=512, n_threads=common.CHILD_THREADS,
                n_threads_batch=common.CHILD_THREADS, verbose=False)
    loaded = time.time()
    stamps = []
    for tid in llm.generate(ids, temp=0.0, repeat_penalty=1.0):
        stamps.append(time.time())
        if tid == llm.token_eos() or len(stamps) == tokens:
            break
    n = len(stamps)
    return {"start_s": loaded - launched, "first_token_s": stamps[0] - loaded, "tokens": n,
            "answer_tok_s": (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else None}


def llamacpp_run(python: str, path: Path, tokens: int) -> dict:
    ids = json.dumps(prompt_ids(path))
    return common.run_child([python, __file__, "--child", str(path), str(tokens), repr(time.time()), ids])


def measure(path: Path, tokens: int, later: int, python: str | None) -> dict:
    """First start, then `later` later starts (the best kept), of each engine on FILE."""
    out = {"prompt_tokens": len(prompt_ids(path))}
    with tempfile.TemporaryDirectory(prefix="colichat-as-used-") as home:
        drop_from_page_cache(path)
        common.say(f"{path.name}: colichat, first start")
        runs = [colichat_run(path, Path(home), tokens)]
        for i in range(later):
            common.say(f"{path.name}: colichat, later start {i + 1}")
            runs.append(colichat_run(path, Path(home), tokens))
        out["colichat"] = summary(runs)
    if python:
        drop_from_page_cache(path)
        runs = []
        for i in range(later + 1):
            common.say(f"{path.name}: llama.cpp, {'first' if not i else 'later'} start")
            runs.append(llamacpp_run(python, path, tokens))
        out["llamacpp"] = summary(runs)
    return out


def summary(runs: list[dict]) -> dict:
    """The first run's start, the later runs' best start, first token and answer speed."""
    bad = next((r for r in runs if "error" in r), None)
    if bad:
        return bad
    later = runs[1:] or runs
    best = lambda key, f: f(r[key] for r in later if r[key] is not None)  # noqa: E731
    return {"first_start_s": runs[0]["start_s"], "later_start_s": best("start_s", min),
            "first_token_s": best("first_token_s", min), "answer_tok_s": best("answer_tok_s", max),
            "tokens": runs[-1]["tokens"], "kernels": runs[0].get("kernels"), "runs": runs}


FIGURES = [("first_start_s", "first start, s"), ("later_start_s", "later start, s"),
           ("first_token_s", "first token of a 20-word question, s"), ("answer_tok_s", "answer, tok/s")]


def report(path: Path, res: dict) -> str:
    c, r = res["colichat"], res.get("llamacpp")
    rows = []
    for key, label in FIGURES:
        cv = c.get(key)
        rv = r.get(key) if r and "error" not in r else None
        # a ratio > 1 is colichat ahead: llama.cpp's time over colichat's, colichat's speed over llama.cpp's
        ratio = None if cv is None or rv is None else (cv / rv if key == "answer_tok_s" else rv / cv)
        rows.append([label, common.cell(cv), common.cell(rv), "-" if ratio is None else f"{ratio:.2f}x"])
    lines = [f"### {path.name}, {path.stat().st_size / 1e9:.2f} GB\n",
             common.table(["figure", "colichat", "llama.cpp", "ratio (>1: colichat ahead)"], rows, True) + "\n"]
    for name, x in (("colichat", c), ("llama.cpp", r)):
        if x and "error" in x:
            lines.append(f"{name} did not run: {x['error']}")
    if "error" not in c:
        lines.append(f"colichat's first start: {c['kernels'] or 'no kernels line'}; the question: "
                     f"{res['prompt_tokens']} tokens; answers of {c['tokens']} tokens")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="GGUF files ('default': the default model's)")
    p.add_argument("--vs-llamacpp", metavar="PYTHON", help="a python with llama-cpp-python 0.3.36: run it too")
    p.add_argument("--tokens", type=int, default=32, help="the answer's length, --max-tokens (default 32)")
    p.add_argument("--later", type=int, default=2, help="later starts, the best kept (default 2)")
    p.add_argument("--child", nargs=4, metavar=("GGUF", "TOKENS", "LAUNCHED", "IDS"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:  # llama.cpp on one file: its figures as JSON on the last line
        path, tokens, launched, ids = args.child
        print(json.dumps(llamacpp_child(path, int(tokens), float(launched), json.loads(ids))))
        return 0
    if shutil.which("colichat", path=str(Path(sys.executable).parent)) is None:
        sys.exit("run it with the python of colichat's venv (.venv/bin/python): its colichat program is beside it")
    load0 = os.getloadavg()
    results = {}
    for name in args.files:
        if name == "default":
            from colichat.models.default import default_model_path

            name = default_model_path()
        path = Path(name)
        results[str(path)] = res = measure(path, args.tokens, args.later, args.vs_llamacpp)
        print(report(path, res), flush=True)
    load1 = os.getloadavg()
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores; load average (1/5/15 min) before "
          f"{load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, after {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}\n")
    print(json.dumps({"question": QUESTION, "results": results, "loadavg": [load0, load1]}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
