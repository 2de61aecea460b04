"""Vocabulary trimming, measured: trimmed models against their untrimmed source (JSON lines).

    python benchmarks/vocab_trim.py run [--models gemma3-270m qwen2.5-0.5b smollm2-135m]
    python benchmarks/vocab_trim.py backfill [--models ...] [--shares 0 0.5 0.75 0.9 0.95]
    python benchmarks/vocab_trim.py write      # the tables in docs/vocabulary.md and README.md

For each model, every variant is packed with the same quantization (the plain default pack: the
GGUF's own 4-8-bit types kept, nothing calibrated), so that only the vocabulary differs:

* ``untrimmed``: the source as it is;
* ``corpus``: the corpus rule on the built-in corpora of the languages (zh + en; smollm2: en),
  with its default backfill;
* ``corpus-no-backfill``: the same with ``--vocab-backfill 0`` (only the pieces produced);
* ``corpus-65536``: the same, capped at 65,536 pieces (the registry's ``*-zh-en`` variants);
* ``script``: the script rule;
* ``corpus-65536-calibrated``: the capped set packed with calibrated quantization
  (``--bits-per-weight 4.6``), the combined figure;
* ``untrimmed-calibrated``: the source packed the same way, so that the calibrated trimmed
  pack is also compared with an untrimmed one of the same quantization (``decode_x_same_quant``).

Measured per variant: pieces kept; deploy file size; on held-out zh and en lines of the built-in
corpora (documents the kept set was never chosen on): the share of lines tokenized identically
to the source, the extra tokens, and bits per character (the model's loss on that text over its
character count, so that it compares across vocabularies); greedy answers of the untrimmed model
to zh and en chat prompts: how often its choice is a piece the trimmed model lacks, and whether
the trimmed model's greedy answer is identical up to that point; the reference multilingual
text's extra tokens. Speed and memory come from one ``pocket bench`` run per model with every
variant alternating (``--compare``): medians and ratios against the untrimmed pack.

``backfill`` measures the corpus rule's ``--vocab-backfill`` share (the kept set only, no
packing): pieces kept and held-out lines tokenized identically per share, with the script rule
as the reference (benchmarks/vocab_backfill.jsonl, the second table in docs/vocabulary.md).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

JSONL = ROOT / "benchmarks" / "vocab_trim.jsonl"
BACKFILL_JSONL = ROOT / "benchmarks" / "vocab_backfill.jsonl"
DOC = ROOT / "docs" / "vocabulary.md"
README = ROOT / "README.md"
LANGS = {"gemma3-270m": "zh,en", "qwen2.5-0.5b": "zh,en", "smollm2-135m": "en"}
VARIANTS = ("untrimmed", "corpus", "corpus-no-backfill", "corpus-65536", "script",
            "corpus-65536-calibrated", "untrimmed-calibrated")
PROMPTS = {
    "en": ["Explain in two sentences why the sky is blue.",
           "Write a short polite email asking a colleague to review my report.",
           "List three tips for saving battery on a phone.",
           "What is the difference between a list and a tuple in Python?"],
    "zh": ["用两句话解释为什么天空是蓝色的。",
           "写一封简短礼貌的邮件，请同事帮我看一下报告。",
           "给出三个手机省电的小建议。",
           "介绍一下北京的气候特点。"],
}


def _variant_spec(model: str, variant: str):
    from pocketlm.vocab import VocabSpec

    langs = LANGS[model]
    if variant in ("untrimmed", "untrimmed-calibrated"):
        return None
    if variant == "script":
        return VocabSpec(languages=langs, rule="script")
    size = 65536 if variant.startswith("corpus-65536") else None
    if variant == "corpus-no-backfill":
        return VocabSpec(languages=langs, backfill=0.0)
    return VocabSpec(languages=langs, size=size)


def _pack(model: str, variant: str, work: Path, force: bool) -> tuple[Path, dict]:
    from pocketlm.pack import pack
    from pocketlm.registry import pull

    out = work / f"{model}-{variant}.pocket"
    info = work / f"{model}-{variant}.json"
    spec = _variant_spec(model, variant)
    if out.is_file() and info.is_file() and not force:
        rec = json.loads(info.read_text())
        # a cached pack made with other settings (e.g. an earlier default backfill) is stale
        if spec is None or all(rec.get("vocab", {}).get(k) == v
                               for k, v in spec.record().items() if k != "corpus"):
            return out, rec
    if spec is not None and spec.size is not None and spec.size >= 49152 and model == "smollm2-135m":
        raise SystemExit("smollm2-135m has 49,152 pieces: no capped variant")
    kw = {"bits_per_weight": 4.6} if variant.endswith("calibrated") else {}
    t0 = time.time()
    report = pack(pull(model, quiet=True), out, progress=False, vocab=spec, **kw)
    rec = {"file_mb": round(report.file_bytes / 1e6, 2), "pack_s": round(time.time() - t0, 1),
           "vocab": report.vocab}
    info.write_text(json.dumps(rec))
    return out, rec


def _heldout(langs: tuple[str, ...], lines_per_lang: int = 4000
             ) -> tuple[dict[str, list[str]], dict[str, float]]:
    """Held-out corpus lines per language written in the languages' scripts (a ShareGPT line in
    Korean is not an English line), and the share of lines that were not."""
    from pocketlm.vocab import _Script, corpus_documents

    script = _Script(langs)
    out: dict[str, list[str]] = {}
    seen: dict[str, int] = {}
    for lang, doc in corpus_documents(langs, heldout=True):
        bucket = out.setdefault(lang, [])
        if len(bucket) >= lines_per_lang:
            continue
        for ln in doc.splitlines():
            if ln.strip():
                seen[lang] = seen.get(lang, 0) + 1
                if script.text_ok(ln):
                    bucket.append(ln)
    return ({k: v[:lines_per_lang] for k, v in out.items()},
            {k: round(1 - len(out[k]) / max(seen[k], 1), 4) for k in out})


def _identity(src_tok, tok, source_ids, lines: list[str]) -> dict:
    a = src_tok.encode_batch(lines, special=False)
    b = tok.encode_batch(lines, special=False)
    same, examples = 0, []
    for line, x, y in zip(lines, a, b):
        if source_ids is None or [int(source_ids[i]) for i in y] == x:
            same += 1
        elif len(examples) < 2:
            missing = [src_tok.id_to_token(i) for i in x if i not in set(source_ids.tolist())]
            examples.append({"line": line[:60], "missing": missing[:3]})
    return {"lines": len(lines), "identical": round(same / max(len(lines), 1), 4),
            "extra_tokens": round(sum(map(len, b)) / max(sum(map(len, a)), 1) - 1, 4),
            "examples": examples}


def _bpc(m, text: str, chunk: int = 1024) -> float:
    """Bits per character of ``text`` under model ``m`` (its own tokenization)."""
    ids = m.tokenize(text)
    nll = 0.0
    for start in range(0, len(ids) - 1, chunk):
        seg = ids[start:start + chunk + 1]
        if len(seg) < 2:
            break
        lg = m.logits(seg[:-1]).astype(np.float64)
        lg -= lg.max(axis=1, keepdims=True)
        logp = lg - np.log(np.exp(lg).sum(axis=1, keepdims=True))
        nll -= float(logp[np.arange(len(seg) - 1), seg[1:]].sum())
    return nll / math.log(2) / len(text)


def _greedy(full, trim, source_ids, langs: tuple[str, ...], n_tokens: int = 48) -> dict:
    """The untrimmed model's greedy answers: how often its choice is not kept, and whether the
    trimmed model's greedy answer agrees up to the first such choice (KV-cached decoding)."""
    keep = {int(s): i for i, s in enumerate(source_ids)}
    steps = missing = agree = prompts = 0
    for lang in langs:
        for text in PROMPTS[lang]:
            msgs = [{"role": "user", "content": text}]
            seq_f, seq_t = full.chat_ids(msgs), trim.chat_ids(msgs)
            ok = [int(source_ids[i]) for i in seq_t] == seq_f
            cf = full.runtime.new_cache(len(seq_f) + n_tokens + 1)
            ct = trim.runtime.new_cache(len(seq_t) + n_tokens + 1)
            lf, lt = full.runtime.forward(seq_f, cf), trim.runtime.forward(seq_t, ct)
            prompts += 1
            for _ in range(n_tokens):
                nf = int(np.argmax(lf))
                steps += 1
                if nf not in keep:
                    missing += 1
                    ok = False  # the trimmed model cannot follow from here
                if ok:
                    nt = int(np.argmax(lt))
                    ok = int(source_ids[nt]) == nf
                    lt = trim.runtime.forward([nt], ct)
                if full.tokenizer.is_eos(nf):
                    break
                lf = full.runtime.forward([nf], cf)
            agree += ok
    return {"prompts": prompts, "steps": steps,
            "choice_not_kept": round(missing / max(steps, 1), 4), "answers_identical": agree}


def run(models: list[str], variants: list[str], runs: int, force: bool) -> None:
    import pocketlm
    from pocketlm.bench import bench, machine_info
    from pocketlm.formats.pocketfile import PocketFile
    from pocketlm.registry import pocket_home
    from pocketlm.vocab import SOURCE_IDS_TENSOR, parse_languages

    work = pocket_home() / "vocab_trim"
    work.mkdir(parents=True, exist_ok=True)
    for model in models:
        langs = parse_languages(LANGS[model])
        held, outside = _heldout(langs)
        texts = {k: "\n".join(v)[:12000 if k == "zh" else 24000] for k, v in held.items()}
        todo = [v for v in variants if not (model == "smollm2-135m" and "65536" in v)]
        packs = {v: _pack(model, v, work, force) for v in todo}
        full = pocketlm.load(packs["untrimmed"][0])
        base_bpc = {k: _bpc(full, t) for k, t in texts.items()}
        rows = []
        for v in todo:
            path, rec = packs[v]
            m = pocketlm.load(path)
            ids = None
            if not v.startswith("untrimmed"):
                ids = np.asarray(PocketFile(path).tensor(SOURCE_IDS_TENSOR))
            row = {"model": model, "variant": v, "languages": LANGS[model],
                   "kept": m.config.vocab_size, "source_vocab": full.config.vocab_size,
                   "file_mb": rec["file_mb"],
                   "reference_cost": (rec["vocab"] or {}).get("reference_cost"),
                   "heldout_lines_outside_scripts": outside,
                   "tokenization": {k: _identity(full.tokenizer, m.tokenizer, ids, lines)
                                    for k, lines in held.items()} if ids is not None else None,
                   "bpc": {k: round(_bpc(m, t) if v != "untrimmed" else base_bpc[k], 4)
                           for k, t in texts.items()},
                   "bpc_untrimmed": {k: round(b, 4) for k, b in base_bpc.items()},
                   # against the untrimmed pack: meaningful where only the vocabulary differs
                   "greedy": _greedy(full, m, ids, langs)
                   if ids is not None and not v.endswith("calibrated") else None}
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("model", "variant", "kept", "file_mb", "bpc")}),
                  file=sys.stderr, flush=True)
            del m
        del full
        results = bench(str(packs["untrimmed"][0]), runs=runs, n_prompt=512, n_gen=128,
                        compare=[str(packs[v][0]) for v in todo if v != "untrimmed"])
        by_path = {r.model: r for r in results}
        base = results[0]
        # the calibrated trimmed pack against the untrimmed pack of the same quantization
        same = by_path.get(str(packs["untrimmed-calibrated"][0])) \
            if "untrimmed-calibrated" in packs else None
        same_mb = packs["untrimmed-calibrated"][1]["file_mb"] if same else None
        date = time.strftime("%Y-%m-%d")
        with open(JSONL, "a", encoding="utf-8") as f:
            for row in rows:
                r = by_path[str(packs[row["variant"]][0])]
                row.update({
                    "decode_tps": round(r.decode_tps, 1), "prefill_tps": round(r.prefill_tps, 1),
                    "peak_rss_delta_mb": round(r.peak_rss_delta_mb, 1),
                    "decode_x": round(r.decode_tps / base.decode_tps, 3),
                    "peak_x": round(r.peak_rss_delta_mb / base.peak_rss_delta_mb, 3),
                    "file_x": round(row["file_mb"] / rows[0]["file_mb"], 3),
                    "threads": r.threads, "n_prompt": r.n_prompt, "n_gen": r.n_gen,
                    "runs": r.runs, "machine": machine_info(), "date": date,
                    "command": "python benchmarks/vocab_trim.py " + " ".join(sys.argv[1:]),
                })
                if same is not None and row["variant"] == "corpus-65536-calibrated":
                    row.update({
                        "decode_x_same_quant": round(r.decode_tps / same.decode_tps, 3),
                        "peak_x_same_quant": round(r.peak_rss_delta_mb
                                                   / same.peak_rss_delta_mb, 3),
                        "file_x_same_quant": round(row["file_mb"] / same_mb, 3)})
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                print(json.dumps(row, ensure_ascii=False), flush=True)


def backfill(models: list[str], shares: list[float]) -> None:
    """The corpus rule's kept set and its exactness on held-out lines, per backfill share."""
    from pocketlm.bench import machine_info
    from pocketlm.formats import open_source
    from pocketlm.registry import pull
    from pocketlm.vocab import (
        VocabSpec,
        choose_kept,
        corpus_counts,
        parse_languages,
        trim_tokenizer,
    )

    date = time.strftime("%Y-%m-%d")
    command = "python benchmarks/vocab_trim.py " + " ".join(sys.argv[1:])
    for model in models:
        langs = parse_languages(LANGS[model])
        src = open_source(pull(model, quiet=True))
        tok = src.tokenizer
        held, _ = _heldout(langs)
        counts, _ = corpus_counts(tok, VocabSpec(languages=langs))
        specs = [("script", None, VocabSpec(languages=langs, rule="script"))]
        specs += [("corpus", q, VocabSpec(languages=langs, backfill=q)) for q in shares]
        with open(BACKFILL_JSONL, "a", encoding="utf-8") as f:
            for rule, q, spec in specs:
                ids, rec = choose_kept(tok, spec, chat_template=src.chat_template,
                                       counts=counts if rule == "corpus" else None)
                new = trim_tokenizer(tok, ids)
                row = {"model": model, "languages": LANGS[model], "rule": rule,
                       "backfill": q, "kept": int(ids.size), "source_vocab": tok.vocab_size,
                       "backfilled": rec.get("backfilled", 0),
                       "tokenization": {k: _identity(tok, new, ids, lines)
                                        for k, lines in held.items()},
                       "machine": machine_info(), "date": date, "command": command}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                print(json.dumps({k: row[k] for k in ("model", "rule", "backfill", "kept")}
                                 | {"identical": {k: t["identical"] for k, t in
                                                  row["tokenization"].items()}}), flush=True)


# ------------------------------------------------------------------------------------- tables


def _read(path: Path = JSONL) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]


def table(rows: list[dict]) -> str:
    latest: dict[tuple[str, str], dict] = {}
    for r in rows:
        latest[(r["model"], r["variant"])] = r
    models = list(dict.fromkeys(m for m, _ in latest))
    order = {v: k for k, v in enumerate(VARIANTS)}
    latest = dict(sorted(latest.items(), key=lambda kv: (models.index(kv[0][0]),
                                                         order.get(kv[0][1], len(order)))))
    out = ["| model | vocabulary | pieces | file MB | decode tok/s (x) | peak MiB (x) | "
           "identical lines zh / en | extra tokens zh / en | bits/char zh / en (untrimmed) | "
           "greedy choice not kept | reference text extra tokens |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (model, variant), r in latest.items():
        tok = r.get("tokenization") or {}

        def pair(key, fmt, t=tok):
            return " / ".join(fmt(t[k][key]) if k in t else "-" for k in ("zh", "en"))

        ident = pair("identical", lambda x: f"{100 * x:.1f} %") if tok else "100 % (source)"
        extra = pair("extra_tokens", lambda x: f"+{100 * x:.2f} %") if tok else "-"
        bpc = " / ".join(
            f"{r['bpc'][k]:.3f} ({r['bpc_untrimmed'][k]:.3f})" if k in r["bpc"] else "-"
            for k in ("zh", "en"))
        greedy = r.get("greedy") if not variant.endswith("calibrated") else None
        g = (f"{100 * greedy['choice_not_kept']:.1f} % ({greedy['answers_identical']}/"
             f"{greedy['prompts']} answers identical)") if greedy else "-"
        ref = r.get("reference_cost")
        ref_s = f"+{100 * ref['extra_tokens']:.0f} %" if ref else "-"
        same = (f"; x{r['decode_x_same_quant']:.2f} untrimmed-calibrated"
                if "decode_x_same_quant" in r else "")
        same_peak = (f"; x{r['peak_x_same_quant']:.2f} untrimmed-calibrated"
                     if "peak_x_same_quant" in r else "")
        out.append(
            f"| {model} | {variant} | {r['kept']:,} | {r['file_mb']:.1f} | "
            f"{r['decode_tps']:.0f} (x{r['decode_x']:.2f}{same}) | "
            f"{r['peak_rss_delta_mb']:.0f} (x{r['peak_x']:.2f}{same_peak}) | {ident} | "
            f"{extra} | {bpc} | {g} | {ref_s} |")
    first = next(iter(latest.values()), None)
    if first:
        m = first["machine"]
        out.append("")
        runs = dict.fromkeys(
            (r["date"], r["machine"].get("kernel_level"), r["runs"], r["command"])
            for r in latest.values())
        out.append(f"Measured on {m.get('cpu')} ({m.get('cores')} CPUs), "
                   f"{first['threads']} threads, prompt {first['n_prompt']} / decode "
                   f"{first['n_gen']} tokens, the median of alternating runs: "
                   + "; ".join(f"{d} ({k} kernels, {n} runs) `{c}`" for d, k, n, c in runs)
                   + ". x: against the untrimmed pack of the same model in the same run, so "
                   "ratios compare within a run; absolute speeds differ between machines and "
                   "between runs (an untrimmed row shows the latest run's).")
    return "\n".join(out)


BLOCK = re.compile(r"(<!-- vocab_trim:start -->\n)(.*?)(<!-- vocab_trim:end -->)", re.S)
BACKFILL_BLOCK = re.compile(r"(<!-- vocab_backfill:start -->\n)(.*?)(<!-- vocab_backfill:end -->)",
                            re.S)


def _shown(piece: str) -> str:
    """A piece as text: byte-level symbols decoded (a Qwen piece 'æĸ°å¾ģç¨ĭ' is 新征程)."""
    from pocketlm.tokenizer import _CHAR_TO_BYTE as back

    if all(c in back for c in piece):
        return bytes(back[c] for c in piece).decode("utf-8", "replace")
    return piece


def backfill_table(rows: list[dict]) -> str:
    latest: dict[tuple, dict] = {}
    for r in rows:
        latest[(r["model"], r["rule"], r["backfill"])] = r
    out = ["| model | rule | --vocab-backfill | pieces kept | of which backfilled | "
           "identical held-out lines zh / en | examples of lines that differ (missing piece) |",
           "|---|---|---:|---:|---:|---:|---|"]
    for (model, rule, q), r in latest.items():
        t = r["tokenization"]
        ident = " / ".join(f"{100 * t[k]['identical']:.2f} %" if k in t else "-"
                           for k in ("zh", "en"))
        ex = "; ".join(f"{_shown(e['missing'][0])}" for k in ("zh", "en") if k in t
                       for e in t[k]["examples"][:1] if e["missing"])
        out.append(f"| {model} | {rule} | {'-' if q is None else q} | {r['kept']:,} | "
                   f"{r['backfilled']:,} | {ident} | {ex or '-'} |")
    if latest:
        first = next(iter(latest.values()))
        out.append("")
        out.append(f"Measured {first['date']} (" + ", ".join(f"`{c}`" for c in dict.fromkeys(
            r["command"] for r in latest.values())) + "); held-out lines: up to 4,000 per "
            "language, written in the languages' scripts, from documents the kept set was "
            "never chosen on.")
    return "\n".join(out)


def write(check: bool = False) -> None:
    """Write the table into the docs (``check``: only say whether they are current)."""
    text = table(_read())
    fill = backfill_table(_read(BACKFILL_JSONL))
    stale = []
    for path in (DOC, README):
        doc = path.read_text(encoding="utf-8")
        if not BLOCK.search(doc):
            raise SystemExit(f"{path}: no <!-- vocab_trim:start --> block")
        new = BLOCK.sub(lambda m: m.group(1) + text + "\n" + m.group(3), doc)
        if path == DOC:
            if not BACKFILL_BLOCK.search(new):
                raise SystemExit(f"{path}: no <!-- vocab_backfill:start --> block")
            new = BACKFILL_BLOCK.sub(lambda m: m.group(1) + fill + "\n" + m.group(3), new)
        if check:
            if new != doc:
                stale.append(str(path))
            continue
        path.write_text(new, encoding="utf-8")
        print(f"wrote the table into {path}")
    if stale:
        raise SystemExit(f"stale vocab_trim tables in {', '.join(stale)}: run "
                         "python benchmarks/vocab_trim.py write")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="pack and measure the variants; append JSON lines")
    p.add_argument("--models", nargs="+", default=list(LANGS), choices=list(LANGS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--force", action="store_true", help="pack again even when cached")
    b = sub.add_parser("backfill", help="measure the corpus rule's backfill shares (kept set "
                       "and exactness, no packing); append JSON lines")
    b.add_argument("--models", nargs="+", default=list(LANGS), choices=list(LANGS))
    b.add_argument("--shares", nargs="+", type=float, default=[0.0, 0.5, 0.75, 0.9, 0.95])
    w = sub.add_parser("write", help="regenerate the tables from the JSON lines")
    w.add_argument("--check", action="store_true", help="fail if the tables are not current")
    args = ap.parse_args()
    if args.cmd == "run":
        variants = list(dict.fromkeys(["untrimmed", *args.variants]))
        run(args.models, variants, args.runs, args.force)
    elif args.cmd == "backfill":
        backfill(args.models, args.shares)
    else:
        write(args.check)


if __name__ == "__main__":
    main()
