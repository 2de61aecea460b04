"""Tiny training inputs for the tests that train a model through ``pocket train`` /
``pocket finetune``: a learnable zh+en corpus, a chat file, and the flags of a tiny run.

Standard library only (no torch, no pocketlm), so any test file imports it without coupling to
another test module.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ANIMALS = ["cat", "dog", "bird", "fox", "horse", "rabbit"]
PLACES = ["mat", "hill", "river", "garden", "roof", "bridge"]
ZH_SUBJ = ["小猫", "小狗", "小鸟", "狐狸"]
ZH_PLACE = ["山上", "河边", "花园里", "屋顶上"]

# the flags of a tiny run that learns make_corpus in a few dozen steps on one CPU thread
TINY_TRAIN_ARGS = ["--preset", "tiny", "--seq-len", "64", "--batch-size", "8", "--lr", "3e-3",
                   "--warmup", "5", "--eval-batches", "4", "--threads", "1", "--quiet"]


def make_corpus(path: Path, n_docs: int = 900, seed: int = 0) -> Path:
    """A learnable zh+en corpus: short documents from a few sentence patterns."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sents = []
        for _ in range(rng.randint(2, 5)):
            if rng.random() < 0.5:
                a, p = rng.choice(ANIMALS), rng.choice(PLACES)
                sents.append(f"The {a} sat on the {p}. The {a} was happy on the {p}.")
            else:
                a, p = rng.choice(ZH_SUBJ), rng.choice(ZH_PLACE)
                sents.append(f"{a}在{p}玩。{a}很高兴。")
        docs.append(" ".join(sents))
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def make_chats(path: Path, n: int = 60) -> Path:
    """``n`` one-turn chats (JSON lines of ``{"messages": [...]}``) about make_corpus's animals."""
    rows = []
    for i in range(n):
        a = ANIMALS[i % len(ANIMALS)]
        rows.append({"messages": [{"role": "user", "content": f"Where is the {a}?"},
                                  {"role": "assistant", "content": f"The {a} sat on the mat."}]})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path
