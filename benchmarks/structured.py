"""Structured output, measured: grammar engines, constrained decode speed, and validity.

    python benchmarks/structured.py engines [--out benchmarks/structured.jsonl]
    python benchmarks/structured.py speed -m smollm2-135m -m gemma3-270m -m qwen2.5-0.5b \\
        [--runs 5] [--out ...]
    python benchmarks/structured.py validity -m smollm2-135m ... [--per-schema 20] [--out ...]
    python benchmarks/structured.py table benchmarks/structured.jsonl

``engines``: the three grammar engines on the package index (llguidance, outlines-core,
xgrammar), on the three registry vocabularies (49k smollm2, 152k qwen2.5, 262k gemma3): the
time to prepare the vocabulary, to compile a JSON schema, and to compute the next-token mask
at each step of a schema-valid document (median and max per token), with what each needs
installed. xgrammar imports torch and transformers; run this subcommand with an interpreter
that has them (PYTHONPATH=.venv/lib/python3.11/site-packages VENV/bin/python ...) to include
it, otherwise it is reported as not importable.

``speed``: per model, the same JSON requests decoded plain and constrained, alternating run by
run in one process (greedy): decode tokens/s (the tokens after the first over the time after
the first) and time to the first token, medians and the constrained/plain ratio; the
grammar is compiled (and cached) before the timed runs, as the server does after a schema's
first request; the first request's compile time is reported apart.

``validity``: ten app schemas (contacts, sentiment with aspects, intent routing, calendar
events, orders, addresses, translation pairs, yes/no with confidence, entity lists through
$defs, replies through anyOf) over real zh + en text pocketlm already fetches (People's Daily
sentences, product reviews, ShareGPT requests): each model answers every (schema, text) pair
free (asked for JSON matching the schema) and constrained; the share that parses and the
share that validates (jsonschema), per mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMAS: dict[str, dict] = {
    "contact": {"type": "object", "properties": {
        "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 8},
        "places": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 8},
        "organisations": {"type": "array", "items": {"type": "string", "maxLength": 60},
                          "maxItems": 8},
        "dates": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 8}},
        "required": ["people", "places", "organisations", "dates"],
        "additionalProperties": False},
    "sentiment": {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "aspects": {"type": "array", "maxItems": 5, "items": {"type": "object", "properties": {
            "aspect": {"type": "string", "maxLength": 20},
            "opinion": {"enum": ["positive", "negative", "neutral"]}},
            "required": ["aspect", "opinion"], "additionalProperties": False}}},
        "required": ["sentiment", "aspects"], "additionalProperties": False},
    "intent": {"type": "object", "properties": {
        "intent": {"enum": ["question", "request", "complaint", "chit_chat", "other"]},
        "urgent": {"type": "boolean"}}, "required": ["intent", "urgent"],
        "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 60},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "attendees": {"type": "integer", "minimum": 0, "maximum": 100000}},
        "required": ["title", "date"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                             "quantity": {"type": "integer", "minimum": 1,
                                                          "maximum": 99}},
            "required": ["name", "quantity"], "additionalProperties": False}},
        "total": {"type": "number", "minimum": 0}},
        "required": ["items"], "additionalProperties": False},
    "address": {"type": "object", "properties": {
        "country": {"type": "string", "maxLength": 30}, "city": {"type": "string",
                                                                  "maxLength": 30},
        "street": {"type": ["string", "null"], "maxLength": 60}},
        "required": ["country", "city", "street"], "additionalProperties": False},
    "translation": {"type": "object", "properties": {
        "source_language": {"enum": ["zh", "en", "other"]},
        "english": {"type": "string", "maxLength": 300},
        "chinese": {"type": "string", "maxLength": 200}},
        "required": ["source_language", "english", "chinese"], "additionalProperties": False},
    "verdict": {"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["answer", "confidence"], "additionalProperties": False},
    "entities": {"$defs": {"entity": {"type": "object", "properties": {
        "text": {"type": "string", "maxLength": 40},
        "kind": {"enum": ["person", "place", "organisation", "date", "number", "other"]}},
        "required": ["text", "kind"], "additionalProperties": False}},
        "type": "object", "properties": {"entities": {"type": "array", "maxItems": 6,
                                                      "items": {"$ref": "#/$defs/entity"}}},
        "required": ["entities"], "additionalProperties": False},
    "reply": {"type": "object", "properties": {"reply": {"anyOf": [
        {"type": "object", "properties": {"text": {"type": "string", "maxLength": 200}},
         "required": ["text"], "additionalProperties": False},
        {"type": "object", "properties": {"refuse": {"const": True},
                                          "reason": {"type": "string", "maxLength": 80}},
         "required": ["refuse", "reason"], "additionalProperties": False}]}},
        "required": ["reply"], "additionalProperties": False},
}

ASKS = {
    "contact": "List the people, places, organisations and dates named in this text.",
    "sentiment": "Give the overall sentiment of this text and the aspects it judges.",
    "intent": "Classify the intent of this message and whether it is urgent.",
    "event": "Extract the main event of this text: a title, its date (YYYY-MM-DD) and how "
             "many attended, if said.",
    "order": "Turn this text into an order: the items it mentions with quantities.",
    "address": "Give the country, city and street this text is about (street null if none).",
    "translation": "Say which language this text is in and translate it into English and "
                   "Chinese (a sentence each).",
    "verdict": "Is this text about government or politics? Answer yes or no with your "
               "confidence.",
    "entities": "List the named entities in this text with their kinds.",
    "reply": "Reply to this text in one sentence, or refuse with a reason if it asks for "
             "something harmful.",
}


def texts(n: int) -> list[str]:
    """``n`` real texts, zh and en alternating: People's Daily sentences, product reviews and
    ShareGPT requests (deterministic)."""
    from pocketlm.data.corpora import corpus_lines, first_chats
    from pocketlm.evaluate.recipes import sentiment_split

    news = corpus_lines("peoples-daily", lambda ln: 40 <= len(ln) <= 160 and ln.endswith("。"),
                        400)
    reviews = [e["text"] for e in sentiment_split()[0] if 20 <= len(e["text"]) <= 160]

    def first_message(chat: dict) -> str:
        return chat["messages"][0]["content"] if chat["messages"] else ""

    english = [first_message(c) for c in first_chats(
        lambda c: 40 <= len(first_message(c)) <= 300 and first_message(c).isascii(), 400)]
    zh = [x for pair in zip(news[::7], reviews[::11], strict=False) for x in pair]
    out = []
    for i in range(n):
        out.append(zh[i // 2] if i % 2 == 0 else english[(i * 13) % len(english)])
    return out


def machine() -> dict:
    from pocketlm.bench import machine_info

    return machine_info()


def emit(row: dict, out) -> None:
    """Print ``row`` as a JSON line, and append it to the file ``out`` when given."""
    line = json.dumps(row, ensure_ascii=False)
    print(line, flush=True)
    if out:
        with open(out, "a", encoding="utf-8") as f:
            f.write(line + "\n")


# -- engines ---------------------------------------------------------------------------------
DOC_SCHEMA = SCHEMAS["order"]
DOC = {"items": [{"name": "green tea 绿茶", "quantity": 2}, {"name": "jasmine rice",
                                                             "quantity": 10}], "total": 86.5}


def _walk(ids, mask, advance, *, prep: float, comp: float, **info) -> dict:
    """Time ``mask()`` before each of ``ids`` (then ``advance(id)``): the engine's row."""
    steps = []
    for i in ids:
        t = time.perf_counter()
        mask()
        steps.append(time.perf_counter() - t)
        advance(i)
    return {**info, "prepare_s": round(prep, 3), "compile_ms": round(comp * 1e3, 2),
            "mask_us_median": round(statistics.median(steps) * 1e6, 1),
            "mask_us_max": round(max(steps) * 1e6, 1)}


def engines(args) -> None:
    import numpy as np

    import pocketlm
    from pocketlm.structured import JSON_LAYOUT

    for name in args.model:
        m = pocketlm.load(name)
        tok, V = m.tokenizer, m.config.vocab_size
        doc = json.dumps(DOC, ensure_ascii=False)
        ids = tok.encode(doc, add_bos=False, special=False)
        row = {"bench": "structured-engines", "model": name, "vocab": V, "doc_tokens": len(ids),
               "machine": machine()}
        # llguidance
        from pocketlm.structured import compile_grammar, ll_tokenizer, parse_grammar

        t = time.perf_counter()
        ll_tokenizer(tok, V)
        prep = time.perf_counter() - t
        g = parse_grammar(json_schema=DOC_SCHEMA)
        t = time.perf_counter()
        c = compile_grammar(g, tok, V)
        comp = time.perf_counter() - t
        row["llguidance"] = _walk(ids, c.allowed, c.consume, prep=prep, comp=comp,
                                  version=_dist("llguidance"), needs="nothing")
        # outlines-core: a regex from the schema, an index over the vocabulary
        try:
            import outlines_core as oc
            from outlines_core.json_schema import build_regex_from_schema
        except ImportError as e:
            row["outlines_core"] = {"error": f"not importable: {e}"}
        else:
            t = time.perf_counter()
            vmap: dict[bytes, list[int]] = {}
            eos = tok.eos_ids[0]
            for i in range(tok.vocab_size):
                if i == eos or tok.is_special(i):
                    continue
                vmap.setdefault(tok.token_bytes(i), []).append(i)
            vocab = oc.Vocabulary(eos, vmap)
            prep = time.perf_counter() - t
            regex = build_regex_from_schema(json.dumps(DOC_SCHEMA), r"[ ]?")
            t = time.perf_counter()
            index = oc.Index(regex, vocab)
            comp = time.perf_counter() - t
            guide = oc.Guide(index)
            mask = np.zeros((V + 31) // 32, dtype=np.int32)
            row["outlines_core"] = _walk(
                ids, partial(guide.write_mask_into, mask.ctypes.data, mask.size, 4),
                guide.advance, prep=prep, comp=comp, version=_dist("outlines_core"),
                needs="nothing", covers="JSON Schema and regex (no grammars)")
        # xgrammar (imports torch and transformers)
        try:
            import xgrammar as xgr
        except ImportError as e:
            row["xgrammar"] = {"error": f"not importable without torch and transformers: {e}"}
        else:
            t = time.perf_counter()
            vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
            info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=V,
                                     stop_token_ids=list(tok.eos_ids))
            compiler = xgr.GrammarCompiler(info, max_threads=1)
            prep = time.perf_counter() - t
            t = time.perf_counter()
            compiled = compiler.compile_json_schema(
                json.dumps(DOC_SCHEMA), any_whitespace=False,
                separators=(JSON_LAYOUT["item_separator"], JSON_LAYOUT["key_separator"]))
            comp = time.perf_counter() - t
            matcher = xgr.GrammarMatcher(compiled)
            mask = xgr.allocate_token_bitmask(1, V)
            row["xgrammar"] = _walk(ids, partial(matcher.fill_next_token_bitmask, mask),
                                    matcher.accept_token, prep=prep, comp=comp,
                                    version=_dist("xgrammar"),
                                    needs="torch, transformers, triton")
        emit(row, args.out)


def _dist(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name.replace("_", "-"))
    except PackageNotFoundError:
        return "?"


# -- speed -----------------------------------------------------------------------------------
def _timed(m, ids, max_tokens, constrain, sampling):
    """(ttft_s, decode tok/s, tokens, finish) of one generation."""
    from pocketlm.generate import run_sequence

    t0 = time.perf_counter()
    seq, cache = m._sequence(ids, 128, max_tokens, sampling, None, [],
                             constrain=constrain)
    first = last = None
    n = 0
    for _ in run_sequence(m.runtime, cache, seq):
        now = time.perf_counter()
        if first is None:
            first = now
        last = now
        n += 1
    rate = (n - 1) / (last - first) if n > 1 and last > first else float("nan")
    return first - t0, rate, n, seq.state.finish_reason


def speed(args) -> None:
    import pocketlm
    from pocketlm.structured import _compiled

    names = ["contact", "order", "translation"]
    for name in args.model:
        m = pocketlm.load(name)
        tx = texts(len(names))
        jobs = []
        for sname, text in zip(names, tx, strict=True):
            msgs = [{"role": "user", "content": f"{ASKS[sname]} Answer in JSON.\n\n{text}"}]
            jobs.append((sname, m.chat_ids(msgs) if m.chat_template else
                         m.tokenize(f"{ASKS[sname]}\n\n{text}\n\nJSON:")))
        compile_ms = []
        for sname, _ in jobs:  # the first request with each schema compiles it
            _compiled.clear()
            t = time.perf_counter()
            m.constraint(json_schema=SCHEMAS[sname])
            compile_ms.append((time.perf_counter() - t) * 1e3)
        rows = {"plain": [], "constrained": []}
        for run in range(args.runs):
            for sname, ids in jobs:
                for mode in ("plain", "constrained"):
                    c = {"json_schema": SCHEMAS[sname]} if mode == "constrained" else None
                    sampling = {"temperature": args.temperature, "seed": run}
                    rows[mode].append(_timed(m, ids, args.max_tokens, c, sampling))
        med = {mode: {"ttft_ms": round(statistics.median(r[0] for r in v) * 1e3, 1),
                      "decode_tok_s": round(statistics.median(r[1] for r in v), 1),
                      "tokens": round(statistics.median(r[2] for r in v))}
               for mode, v in rows.items()}
        emit({"bench": "structured-speed", "model": name, "vocab": m.config.vocab_size,
               "schemas": names, "runs": args.runs, "temperature": args.temperature, "threads": m.runtime.threads
               if hasattr(m.runtime, "threads") else None, "max_tokens": args.max_tokens,
               "first_compile_ms": [round(x, 1) for x in compile_ms], **med,
               "decode_ratio": round(med["constrained"]["decode_tok_s"]
                                     / med["plain"]["decode_tok_s"], 3),
               "ttft_extra_ms": round(med["constrained"]["ttft_ms"] - med["plain"]["ttft_ms"],
                                      1),
               "command": " ".join(sys.argv), "machine": machine()}, args.out)


# -- validity --------------------------------------------------------------------------------
def validity(args) -> None:
    import jsonschema

    import pocketlm

    tx = texts(args.per_schema)
    for name in args.model:
        m = pocketlm.load(name)
        for mode in ("free", "constrained"):
            ok_parse = ok_valid = n = stopped = 0
            per_schema = {}
            t0 = time.perf_counter()
            tokens = 0
            for sname, schema in SCHEMAS.items():
                convs = []
                for text in tx:
                    ask = ASKS[sname]
                    if mode == "free":
                        ask += (" Reply with only a JSON object matching this JSON Schema: "
                                + json.dumps(schema, ensure_ascii=False))
                    convs.append([{"role": "user", "content": f"{ask}\n\n{text}"}])
                kw = {"json_schema": schema} if mode == "constrained" else {}
                good = 0
                limit = args.max_tokens if mode == "free" else args.constrained_max_tokens
                for _, reply, state in m.chat_batch(convs, max_tokens=limit,
                                                    temperature=0, **kw):
                    n += 1
                    tokens += len(state.generated)
                    stopped += state.finish_reason == "stop"
                    doc = _parse(reply)
                    if doc is _BAD:
                        continue
                    ok_parse += 1
                    try:
                        jsonschema.validate(doc, schema)
                    except jsonschema.ValidationError:
                        continue
                    ok_valid += 1
                    good += 1
                per_schema[sname] = good
            dt = time.perf_counter() - t0
            emit({"bench": "structured-validity", "model": name, "mode": mode,
                   "generations": n, "schemas": len(SCHEMAS), "parsed": ok_parse,
                   "valid": ok_valid, "valid_rate": round(ok_valid / n, 4),
                   "valid_per_schema": per_schema, "ended_by_themselves": stopped,
                   "max_tokens": args.max_tokens if mode == "free"
                   else args.constrained_max_tokens,
                   "tokens": tokens, "seconds": round(dt, 1),
                   "command": " ".join(sys.argv), "machine": machine()}, args.out)


_BAD = object()


def _parse(text: str):
    """The JSON document of a reply (a fenced ```json block is unwrapped, as apps do)."""
    s = text.strip()
    if s.startswith("```"):
        s = s.split("\n", 1)[1] if "\n" in s else ""
        s = s.rsplit("```", 1)[0]
    try:
        return json.loads(s)
    except ValueError:
        return _BAD


# -- table -----------------------------------------------------------------------------------
def table(args) -> None:
    rows = [json.loads(x) for x in Path(args.file).read_text().splitlines() if x.strip()]
    for r in rows:
        if r["bench"] == "structured-engines":
            cells = []
            for eng in ("llguidance", "outlines_core", "xgrammar"):
                e = r.get(eng, {})
                cells.append(f"{eng}: " + (e["error"][:40] if "error" in e else
                             f"prep {e['prepare_s']} s, compile {e['compile_ms']} ms, mask "
                             f"{e['mask_us_median']}/{e['mask_us_max']} us"))
            print(f"{r['model']:>14} V={r['vocab']}: " + " | ".join(cells))
        elif r["bench"] == "structured-speed":
            print(f"{r['model']:>14} t={r.get('temperature', 0)} decode plain {r['plain']['decode_tok_s']} constrained "
                  f"{r['constrained']['decode_tok_s']} (x{r['decode_ratio']}), ttft +"
                  f"{r['ttft_extra_ms']} ms, first compile {r['first_compile_ms']} ms")
        elif r["bench"] == "structured-validity":
            print(f"{r['model']:>14} {r['mode']:>11}: {r['valid']}/{r['generations']} valid, "
                  f"{r['parsed']} parse")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("engines", "speed", "validity"):
        p = sub.add_parser(cmd)
        p.add_argument("-m", "--model", action="append", default=None)
        p.add_argument("--out", default=None)
        p.add_argument("--runs", type=int, default=5)
        p.add_argument("--max-tokens", type=int, default=160)
        p.add_argument("--per-schema", type=int, default=20)
        p.add_argument("--constrained-max-tokens", type=int, default=512,
                       help="validity: the length a constrained answer may take (a schema "
                       "with long strings and arrays needs room; one cut short cannot parse)")
        p.add_argument("--temperature", type=float, default=0.0,
                       help="speed: 0 = greedy (the model's own legal choice skips the mask); "
                       "above 0, every step computes the mask")
    p = sub.add_parser("table")
    p.add_argument("file")
    args = ap.parse_args(argv)
    if args.cmd != "table" and not args.model:
        args.model = ["smollm2-135m", "qwen2.5-0.5b", "gemma3-270m"]
    {"engines": engines, "speed": speed, "validity": validity, "table": table}[args.cmd](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
