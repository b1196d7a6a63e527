"""Speculative decoding (prompt lookup, MTP drafts) and the BLAS thread policy, measured side by side in one run.

    python benchmarks/speculative.py            # SmolLM2 and the V2-Lite-shaped MLA model
    python benchmarks/speculative.py --quick    # fewer tokens
(bench.py runs it as part of `make bench`.)

1. Greedy answers to three tasks with draft = 0 (plain decoding) and several draft limits, taking turns
   for 3 rounds (1 with --quick), the median of each (the number of drafts per pass adapts to the
   acceptance rate up to the limit: speculative.draft_size): decode tok/s, the speedup over draft 0,
   the drafts' acceptance rate, whether the tokens are the same (they must be), and prompt lookup's
   ceiling on the answer (lookup_ceiling: each pass checking with foresight exactly the drafts that
   will be kept, at the draft cost measured in the runs; again at half that cost and with free drafts:
   what a cheaper verify row could at most give). Tasks: (a) echo-heavy: correct a 300-word
   paragraph given in the prompt; edit a function given in the prompt; (b) ordinary chat: a question
   with nothing to copy. The prompt is the SmolLM2 chat template's rendering, the same token ids for
   both models (the V2-Lite-shaped model has random weights: its "answers" are whatever it generates).
2. The verify pass: one pass over k + 1 tokens (k = 1..8) against one decode step, at a 512-token context.
3. Threads: prefill, decode and a verify pass with one thread, two sharing fixed row blocks and
   OpenBLAS's two (benchmarks/threads.py), on the machine as it is and with one core kept busy.
4. MTP drafts, on the V2-Lite-shaped model with one MTP block (random weights, so its drafts are
   not meant to be kept): one MTP draft step (1 and 2 new positions) and the verify pass of one
   draft against one decode step, the block's catch-up over a prompt against the prompt's prefill,
   and the chat task's greedy answer with prompt lookup alone and with MTP drafts too (the same
   tokens; MTP's rejected drafts pause it, so the answer must not be slower).
5. Ordinary chat, more of it (SmolLM2): ten questions (CHAT_MIX), each answered greedily with draft 0
   and draft 15, the order alternating over 3 rounds (1 with --quick): the median of the rounds'
   paired tok/s ratios, and the same ratio by the engine's cost model (model_speedup: the passes the
   answer took, each weighed by threads.pass_units at the draft cost measured in the runs), which the
   machine's noise does not move.

    python benchmarks/speculative.py --mtp-only   # part 4 alone
    python benchmarks/speculative.py --chat-only  # part 5 alone
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import threads  # noqa: E402  (benchmarks/threads.py)
from common import say  # noqa: E402

PARAGRAPH = (
    "Their are many reason why people choose to learn a new language later in life. Some want to travel "
    "and speak with the people they meet, others need it for there work, and a few simply enjoy the "
    "challenge of it. Learning a language as an adult is different from learning it as a child. Children "
    "absorb sounds and grammar without thinking about it, while adults tend to analyse every rule and "
    "worry about making mistake. However adults have advantages too: they can read, they know how to "
    "study, and they understand why the language matter to them. The most important thing is to practice "
    "every day, even if only for ten minutes. Listening to podcasts, watching films with subtitles, and "
    "speaking with native speakers all help. Many learners find that writing a short diary in the new "
    "language is usefull, because it forces them to find words for their own daily life. Mistakes is part "
    "of the process and should not be feared. A teacher or a friend who corrects you gently can make a big "
    "difference. Apps can help with vocabulary, but they rarely teach you to hold a real conversation. "
    "After a few months, most learners notice that they understand much more than they can say, which is "
    "normal. Speaking comes later, with confidence. Reading simple books, then newspapers, then novels, "
    "builds a rich vocabulary over time. It is also worth learning about the culture, the history and the "
    "food of the places where the language is spoken, since language and culture are closely linked. In "
    "the end, the learners who succeed are not the most talented ones but the ones who keep going when "
    "progress feels slow, and who find a way to make the language part of there everyday life."
)

CODE = '''def summarize(records):
    total = 0
    count = 0
    smallest = None
    largest = None
    for record in records:
        value = record["value"]
        total = total + value
        count = count + 1
        if smallest is None or value < smallest:
            smallest = value
        if largest is None or value > largest:
            largest = value
    if count == 0:
        return None
    average = total / count
    return {"total": total, "count": count, "average": average, "smallest": smallest, "largest": largest}
'''

TASKS = [  # phrased so that SmolLM2-135M does echo (other phrasings get a summary instead: BENCHMARKS.md)
    ("echo: correct a paragraph", "echo",
     f"Proofread this paragraph and write out the corrected paragraph in full:\n\n\"{PARAGRAPH}\""),
    ("echo: edit code", "echo",
     f"```python\n{CODE}```\n\nRewrite this function with `value` renamed to `amount`."),
    ("chat: a question", "chat", "What are three good habits for a healthy life? Explain each one briefly."),
]

CHAT_MIX = [TASKS[2][2],  # part 5: ordinary questions, nothing in the prompt for the answer to copy
            "Why is the sky blue? Answer for a ten-year-old.",
            "Write a short poem about autumn in a small town.",
            "What should I pack for a weekend hiking trip in the mountains?",
            "How do I make a simple tomato pasta sauce?",
            "Explain what a black hole is in two paragraphs.",
            "Give me some tips for sleeping better.",
            "What is the difference between weather and climate?",
            "Tell me a short story about a cat who learns to fly.",
            "How does a computer store numbers?"]


def prompt_ids(tok, text: str) -> list[int]:
    from colichat.engine.text.template import chat_template_for

    return tok.encode_prompt(chat_template_for(tok).render([{"role": "user", "content": text}], True))


def answer(model, ids: list[int], draft: int, max_tokens: int, mtp: bool = False) -> dict:
    """One greedy answer after `ids`: its tokens, decode seconds, drafts checked and kept (prompt
    lookup, and the model's MTP block too if `mtp`)."""
    from colichat.engine import Sampler, SamplerSettings
    from colichat.engine.generate import Generation
    from colichat.engine.speculative import PromptLookup

    model.reset()
    logits = model.prefill(ids, all_logits=False)[-1]
    greedy = SamplerSettings(temperature=0, repeat_penalty=1.0)  # no penalty, as BENCHMARKS.md measured it
    gen = Generation(model, logits, Sampler(greedy), model.tokenizer.eog_ids, max_tokens,
                     drafts=[PromptLookup()] + [model.mtp] * mtp, draft=draft)
    t0 = time.perf_counter()
    out = list(gen)
    dt = time.perf_counter() - t0
    passes, i = [], 0  # drafts checked by each pass of the answer (0: a plain decode step)
    while i < len(out):
        passes.append(out[i].drafted)
        i += out[i].accepted + 1 if out[i].drafted else 1
    return {"tokens": [t.id for t in out], "decode_s": dt, "tps": len(out) / dt, "drafted": gen.n_drafted,
            "accepted": gen.n_accepted, "by_source": gen.by_source, "passes": passes}


def model_speedup(tokens: int, passes: list[int], row_cost: float) -> float:
    """An answer's speed-up over plain decoding by the engine's cost model: its tokens over its passes
    (the drafts each checked; 0: a plain step), each weighed in decode steps by threads.pass_units."""
    from colichat.engine.threads import pass_units

    return tokens / sum(pass_units(d + 1, row_cost) for d in passes)


def bench_tasks(model, tok, drafts: list[int], max_tokens: int, rounds: int = 3) -> list[dict]:
    """Each task answered with every draft limit in turn, `rounds` times: the median tok/s of each limit
    (the rounds interleave the limits, so a slow minute of the machine falls on all of them)."""
    rows = []
    for label, kind, text in TASKS:
        ids = prompt_ids(tok, text)
        runs: dict[int, list[dict]] = {d: [] for d in drafts}
        for _ in range(rounds):
            for d in drafts:
                runs[d].append(answer(model, ids, d, max_tokens))
        base_tps = float(np.median([r["tps"] for r in runs[drafts[0]]]))
        row_cost = model.threads.row_cost()
        plain = runs[drafts[0]][0]["tokens"]
        # and what a cheaper verify row could at most give: at half the measured draft cost, and free
        ceiling, half, free = (lookup_ceiling(ids, plain, drafts[-1], c) for c in (row_cost, row_cost / 2, 0.0))
        say(f"  {label:<28} prompt lookup's ceiling: {ceiling:.2f}x (measured draft cost {row_cost:.2f} steps), "
            f"{half:.2f}x at half that cost, {free:.2f}x with free drafts")
        for d in drafts:
            r, tps = runs[d][0], float(np.median([x["tps"] for x in runs[d]]))
            rows.append({"task": label, "kind": kind, "prompt_tokens": len(ids), "draft": d,
                         "generated": len(r["tokens"]), "tps": tps, "speedup": tps / base_tps,
                         "tps_runs": [x["tps"] for x in runs[d]], "ceiling": ceiling, "row_cost": row_cost,
                         "ceiling_half_cost": half, "ceiling_free": free,
                         "acceptance": r["accepted"] / r["drafted"] if r["drafted"] else None,
                         "same_tokens": all(x["tokens"] == runs[drafts[0]][0]["tokens"] for x in runs[d])})
            say(f"  {label:<28} draft {d}: {tps:.2f} tok/s ({rows[-1]['speedup']:.2f}x; runs "
                + " ".join(f"{x['tps']:.1f}" for x in runs[d])
                + f"), {r['accepted']}/{r['drafted']} drafts kept, same tokens {rows[-1]['same_tokens']}")
    return rows


def bench_chat_mix(model, tok, max_tokens: int, rounds: int = 3, draft: int = 15) -> list[dict]:
    """Part 5: each CHAT_MIX question answered with draft 0 and `draft`, the order alternating over
    `rounds` rounds: measured and modelled (model_speedup) speed-ups of `draft` over draft 0."""
    rows = []
    for text in CHAT_MIX:
        ids = prompt_ids(tok, text)
        runs: dict[int, list[dict]] = {0: [], draft: []}
        for i in range(rounds):
            for d in (0, draft) if i % 2 == 0 else (draft, 0):
                runs[d].append(answer(model, ids, d, max_tokens))
        on, off = runs[draft], runs[0]
        row_cost = model.threads.row_cost()
        rows.append({"question": text, "generated": len(on[0]["tokens"]),
                     "tps_off": float(np.median([r["tps"] for r in off])),
                     "tps_on": float(np.median([r["tps"] for r in on])),
                     "paired": float(np.median([a["tps"] / b["tps"] for a, b in zip(on, off, strict=True)])),
                     "model": model_speedup(len(on[0]["tokens"]), on[0]["passes"], row_cost), "row_cost": row_cost,
                     "kept": on[0]["accepted"], "checked": on[0]["drafted"],
                     "same_tokens": all(r["tokens"] == off[0]["tokens"] for r in on + off)})
        r = rows[-1]
        say(f"  {text[:44]:<44} {r['generated']} tokens, {r['tps_off']:.2f} -> {r['tps_on']:.2f} tok/s, paired "
            f"{r['paired']:.3f}x, model {r['model']:.3f}x, {r['kept']}/{r['checked']} kept, "
            f"same tokens {r['same_tokens']}")
    return rows


def chat_mix_table(rows: list[dict], draft: int = 15) -> list[str]:
    lines = [f"| question | tokens | tok/s, draft 0 | tok/s, draft {draft} | measured (paired) | cost model | "
             "drafts kept | same tokens |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['question']} | {r['generated']} | {r['tps_off']:.2f} | {r['tps_on']:.2f} | "
                     f"{r['paired']:.3f}x | {r['model']:.3f}x | {r['kept']}/{r['checked']} | "
                     f"{'yes' if r['same_tokens'] else 'NO'} |")
    paired, modelled = [r["paired"] for r in rows], [r["model"] for r in rows]
    return lines + ["", f"Over the {len(rows)} questions: measured median {np.median(paired):.3f}x, mean "
                    f"{np.mean(paired):.3f}x, lowest {min(paired):.3f}x; cost model median {np.median(modelled):.3f}x, "
                    f"mean {np.mean(modelled):.3f}x, lowest {min(modelled):.3f}x.", ""]


def lookup_ceiling(ids: list[int], tokens: list[int], k_max: int, row_cost: float) -> float:
    """The most prompt lookup could speed up this greedy answer, as a multiple of plain decoding: the
    answer replayed with foresight, each pass checking exactly the drafts (at most k_max) the answer
    keeps, or none (a plain step), and costing threads.pass_units with the measured `row_cost`. A real
    pass cannot know how many of its drafts will be kept, so measured speed-ups stay below this, up to
    the cost model's error (a few percent)."""
    from colichat.engine.speculative import PromptLookup

    lookup, text = PromptLookup(), np.array(list(ids) + list(tokens), dtype=np.int64)  # (P + answer,)
    i, passes = 0, []  # answer tokens chosen, and the drafts each pass checked
    while i < len(tokens):
        kept = 0  # the pass feeds answer token i and the drafts after it that the answer keeps
        for d, t in zip(lookup.propose(text[: len(ids) + i + 1], k_max), tokens[i + 1 :], strict=False):
            if d != t:
                break
            kept += 1
        passes.append(kept)
        i += kept + 1
    return model_speedup(len(tokens), passes, row_cost)


def bench_verify(model, ctx: int = 512, reps: int = 3, filled: bool = False) -> list[dict]:
    """Seconds of one pass over k + 1 tokens after `ctx` cached ones, against one decode step (best of reps).
    filled: the cache already holds `ctx` rows (set from outside; a long prefill would take minutes)."""
    rng = np.random.default_rng(5)
    if filled:
        model.cache.set_length(ctx)
    else:
        model.reset()
        model.prefill(rng.integers(0, model.cfg.n_vocab, ctx), all_logits=False)

    def one(k: int) -> float:
        ids = rng.integers(0, model.cfg.n_vocab, k + 1)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            model.prefill(ids, all_logits=True)
            best = min(best, time.perf_counter() - t0)
            model.cache.truncate(ctx)
        return best

    one(0)  # warm-up
    decode = one(0)
    rows = [{"k": 0, "s": decode, "vs_decode": 1.0}]
    for k in range(1, 9):
        s = one(k)
        rows.append({"k": k, "s": s, "vs_decode": s / decode})
    say("  verify pass / decode: " + ", ".join(f"k={r['k']} {r['vs_decode']:.2f}x" for r in rows[1:]))
    return rows


def bench_mtp(path: Path, ctx: int = 512, reps: int = 5, max_tokens: int = 16) -> dict:
    """Part 4 (module docstring): seconds as ratios to one decode step after `ctx` cached tokens."""
    from colichat.engine import load
    from colichat.engine.mtp import step_cost

    say(f"MTP drafts: {path.name}")
    model = load(str(path), n_ctx=2048)
    mtp, rng = model.mtp, np.random.default_rng(7)
    ids = rng.integers(0, model.cfg.n_vocab, ctx)
    model.reset()
    t0 = time.perf_counter()
    model.prefill(ids, all_logits=False)
    prefill = time.perf_counter() - t0
    tid = int(rng.integers(0, model.cfg.n_vocab))
    hist = np.append(ids, tid).astype(np.int32)
    t0 = time.perf_counter()
    draft = mtp.propose(hist, 1)[0]  # the block catches up over the prompt
    catch_up = time.perf_counter() - t0

    def best(fn) -> float:
        fn()  # warm-up
        out = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out = min(out, time.perf_counter() - t0)
        return out

    def decode():
        model.decode(tid)
        model.cache.truncate(ctx)

    def verify():
        model.prefill([tid, draft], all_logits=True)
        model.cache.truncate(ctx)

    def mtp_step(new: int):
        def fn():
            mtp.block.truncate(ctx + 1 - new - mtp.base)  # the block has seen all but the last `new` positions
            mtp.propose(hist, 1)
        return fn

    step = best(decode)
    r = {"label": f"{path.name}", "ctx": ctx, "decode_s": step, "estimate": step_cost(model),
         "mtp1": best(mtp_step(1)) / step, "mtp2": best(mtp_step(2)) / step, "verify1": best(verify) / step,
         "catch_up_vs_prefill": catch_up / prefill}
    r["break_even"] = r["verify1"] + r["mtp1"] - 1  # acceptance above which one MTP draft per step pays
    say(f"  decode {step:.3f} s; MTP draft step {r['mtp1']:.3f}x (2 new positions {r['mtp2']:.3f}x, estimate "
        f"{r['estimate']:.3f}x); verify of 1 draft {r['verify1']:.2f}x; pays above {100 * r['break_even']:.0f}% kept; "
        f"catch-up over {ctx} prompt tokens {r['catch_up_vs_prefill']:.3f}x their prefill")
    label, _, text = TASKS[2]
    ids = prompt_ids(model.tokenizer, text)
    best = {}
    for mtp_on in (False, True, False, True):  # interleaved, best of 2 each: the machine's load drifts
        a = answer(model, ids, 4, max_tokens, mtp=mtp_on)
        say(f"  {label}, draft 4, {'lookup + MTP' if mtp_on else 'lookup only'}: {a['tps']:.3f} tok/s, "
            f"drafts {a['by_source']}")
        if mtp_on not in best or a["tps"] > best[mtp_on]["tps"]:
            best[mtp_on] = {"mtp": mtp_on, "tps": a["tps"], "tokens": a["tokens"], "by_source": a["by_source"]}
    r["chat"] = [best[False], best[True]]
    r["chat_same_tokens"] = r["chat"][0]["tokens"] == r["chat"][1]["tokens"]
    r["chat_speedup"] = r["chat"][1]["tps"] / r["chat"][0]["tps"]
    return r


def run(models: list[tuple[str, Path]], quick: bool = False, mtp_path: Path | None = None) -> dict:
    from colichat.engine import load, load_tokenizer
    from colichat.engine.threads import ThreadPolicy
    from colichat.models.default import default_model_path

    tok = load_tokenizer(str(default_model_path()))
    out = {"models": []}
    for i, (label, path) in enumerate(models):
        say(f"speculative decoding: {label}")
        model = load(str(path), n_ctx=2048)
        small = model.cfg.n_embd < 1024
        drafts = [0, 4, 8, 15] if small else [0, 8]
        max_tokens = (64 if quick else 160) if small else (12 if quick else 24)
        rounds = 1 if quick else 3
        m = {"label": label, "tasks": bench_tasks(model, tok, drafts, max_tokens, rounds),
             "verify": bench_verify(model)}
        if small:  # again with decode held to one thread, as on a machine with one free core
            say("  the same with decode on one thread")
            model.threads = ThreadPolicy(one_token=(1,))
            m["tasks_one_thread"] = bench_tasks(model, tok, drafts, max_tokens, rounds)
            m["verify_one_thread"] = bench_verify(model)
            model.threads = ThreadPolicy()
            say("  ordinary chat, ten questions")
            m["chat_mix"] = bench_chat_mix(model, tok, max_tokens, rounds)
        if i == 0 or not quick:
            m["threads"] = threads.bench_threads(model, 16 if small else 4, 256 if small else 64)
        out["models"].append(m)
        del model
    if mtp_path is not None:
        out["mtp"] = bench_mtp(mtp_path, max_tokens=8 if quick else 16)
    return out


def tasks_table(tasks: list[dict], verify: list[dict]) -> list[str]:
    lines = ["| task | prompt | draft | tokens | tok/s | vs draft 0 | drafts kept | same tokens | lookup's ceiling |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in tasks:
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        ceiling = (f"{r['ceiling']:.2f}x (draft cost {r['row_cost']:.2f}); {r['ceiling_half_cost']:.2f}x at "
                   f"{r['row_cost'] / 2:.2f}; {r['ceiling_free']:.2f}x free" if r["draft"] == 0 else "")
        lines.append(f"| {r['task']} | {r['prompt_tokens']} | {r['draft']} | {r['generated']} | {r['tps']:.2f} | "
                     f"{r['speedup']:.2f}x | {acc} | {'yes' if r['same_tokens'] else 'NO'} | {ceiling} |")
    return lines + ["", "verify pass of k + 1 tokens / one decode step (512 cached tokens): "
                    + ", ".join(f"k={r['k']}: {r['vs_decode']:.2f}x" for r in verify[1:]), ""]


def report(res: dict) -> str:
    lines = []
    for m in res["models"]:
        lines += [f"### {m['label']}", ""] + tasks_table(m["tasks"], m["verify"])
        if "tasks_one_thread" in m:
            lines += ["Decode held to one thread:", ""] + tasks_table(m["tasks_one_thread"], m["verify_one_thread"])
        if "chat_mix" in m:
            lines += ["Ordinary chat, ten questions:", ""] + chat_mix_table(m["chat_mix"])
        if "threads" in m:
            lines += threads.table(m["threads"]) + [""]
    if "mtp" in res:
        lines += ["", mtp_report(res["mtp"])]
    return "\n".join(lines)


def mtp_report(r: dict) -> str:
    chat = r["chat"]
    return (f"MTP drafts ({r['label']}, {r['ctx']} cached tokens; one decode step {r['decode_s']:.3f} s): "
            f"MTP draft step {r['mtp1']:.3f}x a decode step with 1 new position, {r['mtp2']:.3f}x with 2 "
            f"(estimate from the bytes read: {r['estimate']:.3f}x); verify pass of 1 draft {r['verify1']:.2f}x; "
            f"so one MTP draft per step pays when more than {100 * r['break_even']:.0f}% are kept. "
            f"Catch-up over the prompt: {r['catch_up_vs_prefill']:.3f}x its prefill. Chat task, draft 4: "
            f"lookup only {chat[0]['tps']:.3f} tok/s, lookup + MTP {chat[1]['tps']:.3f} tok/s "
            f"({r['chat_speedup']:.2f}x; drafts {chat[1]['by_source']}; same tokens: {r['chat_same_tokens']}).")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip-deepseek", action="store_true")
    p.add_argument("--ff", type=int, default=2816)
    p.add_argument("--mtp-only", action="store_true", help="only part 4 (MTP drafts)")
    p.add_argument("--chat-only", action="store_true", help="only part 5 (ordinary chat, ten questions)")
    args = p.parse_args(argv)
    from common import OUT, deepseek_gguf

    from colichat.models.default import default_model_path

    if args.mtp_only:
        OUT.mkdir(parents=True, exist_ok=True)
        r = bench_mtp(deepseek_gguf(args.ff, mtp=True), max_tokens=8 if args.quick else 16)
        (OUT / "speculative-mtp.json").write_text(json.dumps(r, indent=1))
        print(mtp_report(r))
        return 0

    if args.chat_only:
        from colichat.engine import load

        OUT.mkdir(parents=True, exist_ok=True)
        model = load(str(default_model_path()), n_ctx=2048)
        rows = bench_chat_mix(model, model.tokenizer, 64 if args.quick else 160, 1 if args.quick else 3)
        (OUT / "speculative-chat.json").write_text(json.dumps(rows, indent=1))
        print("\n".join(chat_mix_table(rows)))
        return 0

    models = [("SmolLM2-135M", Path(default_model_path()))]
    if not args.skip_deepseek:
        OUT.mkdir(parents=True, exist_ok=True)
        models.append((f"V2-Lite-shaped (FFN {args.ff})", deepseek_gguf(args.ff)))
    res = run(models, args.quick, None if args.skip_deepseek else deepseek_gguf(args.ff, mtp=True))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "speculative.json").write_text(json.dumps(res, indent=1))
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
