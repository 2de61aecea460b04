"""The 20 hand-written chat requests of the pocket-zh-en model card (tests/data/pocket_zh_en_chat
.jsonl: 10 Chinese, 10 English; app-like tasks: extract, summarize, classify, rewrite, answer,
translate, reply), answered greedily by each model with its chat template.

    python benchmarks/pocket_zh_en_chat.py run -m pocket-zh-en -m qwen2.5-0.5b \\
        --out benchmarks/pocket_zh_en_chat.jsonl
    python benchmarks/pocket_zh_en_chat.py write benchmarks/pocket_zh_en_chat.jsonl

``run`` appends one JSON line per answer (model, file sha256, request, answer, whether it is in
the language the request asks for, tokens, seconds). The language check is automatic (the share
of CJK ideographs among the letters: >= 0.5 for Chinese, <= 0.02 for English); whether an
answer is on topic and right is reviewed by hand and written in the card. ``write`` puts the
latest answers of every model into docs/pocket-zh-en.md between its markers.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = ROOT / "tests" / "data" / "pocket_zh_en_chat.jsonl"
CARD = ROOT / "docs" / "pocket-zh-en.md"
START, END = "<!-- chat:start -->", "<!-- chat:end -->"
CELL = 240  # characters of an answer shown in the card (the JSONL has them whole)


def in_language(text: str, lang: str) -> bool:
    from pocketlm.recipes.prompts import cjk_share

    share = cjk_share(text)
    return share >= 0.5 if lang == "zh" else share <= 0.02 and any(c.isalpha() for c in text)


def run(models: list[str], out: Path, max_tokens: int) -> None:
    import pocketlm
    from pocketlm.data.download import sha256_file

    requests = [json.loads(x) for x in REQUESTS.read_text(encoding="utf-8").splitlines()]
    with open(out, "a", encoding="utf-8") as f:
        for name in models:
            model = pocketlm.load(name)
            sha = sha256_file(model.path)
            for r in requests:
                t0 = time.perf_counter()
                answer = model.chat([{"role": "user", "content": r["prompt"]}],
                                    max_tokens=max_tokens, temperature=0.0)
                row = {"bench": "pocket_zh_en_chat", "model": name, "sha256": sha,
                       "command": " ".join(sys.argv), "machine": platform.machine(),
                       "max_tokens": max_tokens, "id": r["id"], "lang": r["lang"],
                       "answer_lang": r["answer_lang"], "prompt": r["prompt"],
                       "answer": answer, "in_language": in_language(answer, r["answer_lang"]),
                       "tokens": len(model.last_state.generated),
                       "seconds": round(time.perf_counter() - t0, 3)}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                f.flush()
                print(f"{name} {r['id']}: {answer[:80]!r}", file=sys.stderr)


def write(path: Path) -> None:
    rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    latest: dict[tuple[str, str], dict] = {}
    for r in rows:
        latest[(r["model"], r["id"])] = r
    models = list(dict.fromkeys(r["model"] for r in rows))
    ids = list(dict.fromkeys(r["id"] for r in rows))
    lines = ["| request | " + " | ".join(models) + " |", "|---" * (len(models) + 1) + "|"]
    for i in ids:
        first = next(latest[(m, i)] for m in models if (m, i) in latest)
        cells = []
        for m in models:
            r = latest.get((m, i))
            if r is None:
                cells.append("–")
                continue
            text = " ".join(r["answer"].split()).replace("|", "\\|")
            if len(text) > CELL:
                text = text[:CELL] + " …"
            cells.append(("" if r["in_language"] else "(wrong language) ") + text)
        prompt = " ".join(first["prompt"].split()).replace("|", "\\|")
        lines.append(f"| {prompt} | " + " | ".join(cells) + " |")
    ok = {m: sum(latest[(m, i)]["in_language"] for i in ids if (m, i) in latest)
          for m in models}
    lines.append("")
    lines.append("In the asked language: " + ", ".join(f"{m} {ok[m]}/{len(ids)}"
                                                       for m in models) + ".")
    card = CARD.read_text(encoding="utf-8")
    a, b = card.index(START) + len(START), card.index(END)
    CARD.write_text(card[:a] + "\n" + "\n".join(lines) + "\n" + card[b:], encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    p.add_argument("-m", "--model", action="append", required=True)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "pocket_zh_en_chat.jsonl")
    p.add_argument("--max-tokens", type=int, default=160)
    p = sub.add_parser("write")
    p.add_argument("path", type=Path, nargs="?",
                   default=ROOT / "benchmarks" / "pocket_zh_en_chat.jsonl")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args.model, args.out, args.max_tokens)
    else:
        write(args.path)


if __name__ == "__main__":
    main()
