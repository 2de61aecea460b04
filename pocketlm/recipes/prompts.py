"""The instruction data of the pocket-zh-en recipe: prompts built from the corpora pocketlm
fetches, deterministic from a seed.

Every prompt is a dict ``{"id", "lang", "source", "kind", "prompt", "gold", "checks"}``:

* ``gold``: the answer, where the corpus holds it (an idiom's meaning from the idiom
  dictionary, a character's reading and meaning from the Xinhua dictionary, a poem's author,
  a review's label); the teacher is not asked. Otherwise None: the teacher answers.
* ``checks``: verifiable instructions appended to the prompt (IFEval-style: "answer in at most
  50 words", "请用英文回答"), each a checker of :mod:`pocketlm.evaluate.instructions`; a teacher
  answer that fails one is dropped (rejection by verifier), so the student only sees answers
  that follow them.

Sources (all fetched by :mod:`pocketlm.data.corpora`, licences in docs/data.md):

* English: the first user turn of ShareGPT conversations whose first answer was short (a proxy
  for answers that fit the teacher's token budget), in English, without code fences.
* Chinese: paragraphs of People's Daily (1998) with a task (summarize, title, list the names,
  rewrite plainly, tone, translate to English, extract as JSON); idioms (meaning: gold; a
  sentence using it, a short story on it: teacher); Xinhua dictionary characters (gold);
  classical poems (author: gold; appreciation: teacher); product reviews (label: gold).

What the capability suite measures is kept out: idioms that are asked, or whose meaning is a
choice, in the idioms-zh task, every poem of the two anthologies cloze-zh is built from, and
the held-out test split of the review data are never used.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
import unicodedata
from collections.abc import Iterator

PROMPTS_VERSION = 2  # bumped whenever the prompts a seed gives change (2: idioms whose
# answer holds an idioms-zh meaning or names its idiom are left out)

_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")
_LATIN = re.compile(r"[A-Za-z]")


def _key(*parts: object) -> str:
    return hashlib.sha256("|".join(map(str, parts)).encode("utf-8")).hexdigest()


def cjk_share(text: str) -> float:
    """CJK ideographs among the letters of ``text`` (0 when it has none)."""
    cjk = len(_CJK.findall(text))
    latin = len(_LATIN.findall(text))
    return cjk / (cjk + latin) if cjk + latin else 0.0


_FULL_WIDTH = {c: unicodedata.normalize("NFKC", chr(c)) for r in (
    range(0xFF10, 0xFF1A), range(0xFF21, 0xFF3B), range(0xFF41, 0xFF5B)) for c in r}


def _ascii_digits(text: str) -> str:
    """Full-width digits and Latin letters as ASCII (the news corpus writes １９９８); Chinese
    punctuation stays as it is."""
    return text.translate(_FULL_WIDTH)


def _balanced(text: str) -> str:
    """Drop the closing quotes a dictionary entry has without an opening one."""
    return text.replace("”", "") if text.count("“") < text.count("”") else text


# -- verifiable instructions ------------------------------------------------------------------
# (text, checker, args); {n} / {p} are filled from the args. The wording is this recipe's own;
# the checkers are the capability suite's, so "passes" means the same thing here and there.

EN_CHECKS = (
    ("Answer in at most {n} words.", "words_at_most", [{"n": 40}, {"n": 60}, {"n": 100}]),
    ("Use exactly {n} bullet points, each on its own line starting with \"- \".",
     "bullets_exactly", [{"n": 2}, {"n": 3}, {"n": 4}]),
    ("Write the whole answer in lowercase letters, with no capitals.", "lowercase", [{}]),
    ("Do not use any commas.", "no_commas", [{}]),
    ("Finish with the exact sentence \"{p}\"", "ends_with",
     [{"phrase": "Hope this helps."}, {"phrase": "Let me know if you have questions."}]),
    ("Begin your answer with \"{p}\"", "starts_with",
     [{"phrase": "Sure."}, {"phrase": "Here is my answer:"}]),
    ("Give the answer a title in double angular brackets, such as <<my title>>.", "title", [{}]),
    ("Put the entire answer inside double quotation marks.", "quoted", [{}]),
    ("Add a postscript at the end, starting with P.S.", "postscript", [{"marker": "P.S."}]),
    ("Answer in Chinese.", "language_zh", [{}]),
)

ZH_CHECKS = (
    ("回答不超过{n}个字。", "chars_zh_at_most", [{"n": 60}, {"n": 100}, {"n": 150}]),
    ("回答不少于{n}个字。", "chars_zh_at_least", [{"n": 80}, {"n": 150}]),
    ("请分{n}点回答，每点单独一行，以“- ”开头。", "bullets_exactly", [{"n": 2}, {"n": 3}]),
    ("回答中不要使用逗号。", "no_commas", [{}]),
    ("请在回答的最后写上“{p}”", "ends_with", [{"phrase": "希望对你有帮助。"},
                                          {"phrase": "以上就是我的回答。"}]),
    ("请给回答加一个标题，用<<>>括起来，例如<<标题>>。", "title", [{}]),
    ("请用英文回答。", "language_en", [{}]),
)


def _instruction_text(text: str, args: dict) -> str:
    return text.format(n=args.get("n", ""), p=args.get("phrase", ""))


def add_checks(prompt: str, lang: str, rng: random.Random) -> tuple[str, list[dict]]:
    """``prompt`` with one or two verifiable instructions appended (drawn by ``rng``, never
    two of one checker, never two language switches), and the instructions."""
    pool = EN_CHECKS if lang == "en" else ZH_CHECKS
    picks = rng.sample(range(len(pool)), 1 if rng.random() < 0.7 else 2)
    texts, checks = [], []
    for i in picks:
        text, check, variants = pool[i]
        args = dict(variants[rng.randrange(len(variants))])
        if check in ("language_zh", "language_en") and len(picks) > 1:
            continue  # a language switch alone: the other checks are worded for the prompt's
        texts.append(_instruction_text(text, args))
        checks.append({"check": check, "args": args})
    if not checks:  # the switch was dropped: keep the other pick
        return add_checks(prompt, lang, rng)
    sep = " " if lang == "en" else ""
    return prompt.rstrip() + ("\n\n" if lang == "en" else "\n") + sep.join(texts), checks


# -- what the capability suite measures ------------------------------------------------------


def held_out_items() -> dict[str, set[str]]:
    """What the recipe must not train on: ``idioms`` (every idiom and meaning of the idioms-zh
    task), ``poems`` (first lines of every poem of the cloze-zh anthologies), ``reviews`` (the
    sentiment test split)."""
    from ..evaluate import recipes

    _, idioms = recipes.build_idioms()
    meanings = {c for ex in idioms for c in ex["choices"]}
    _, cloze = recipes.build_cloze()
    _, test = recipes.sentiment_split()
    halves = set()  # every first half-line the cloze prompts show
    for ex in cloze:
        for line in ex["context"].split("\n"):
            if "，" in line:
                halves.add(line.split("，")[0])
    return {"idioms": {ex["idiom"] for ex in idioms}, "meanings": meanings,
            "poems": {ex["title"] + "|" + ex["author"] for ex in cloze},
            "poem_lines": halves, "reviews": {ex["text"] for ex in test}}


_HELD_MIN = 6  # held-out meanings this long or longer are matched inside a text too


def held_in(text: str, held: dict[str, set[str]]) -> bool:
    """Whether ``text`` holds an idioms-zh meaning of :data:`_HELD_MIN` characters or more, or
    names one of its idioms: looked up window by window (``held`` keeps the indexes)."""
    index = held.get("_meaning_index")
    if index is None:  # meanings by their first _HELD_MIN characters, built once
        index = {}
        for m in held["meanings"]:
            if len(m) >= _HELD_MIN:
                index.setdefault(m[:_HELD_MIN], []).append(m)
        held["_meaning_index"] = index
        held["_idiom_lengths"] = sorted({len(w) for w in held["idioms"] if len(w) >= 3})
    idioms, lengths = held["idioms"], held["_idiom_lengths"]
    for i in range(len(text)):
        if any(text[i:i + k] in idioms for k in lengths):
            return True
        if any(text.startswith(m, i) for m in index.get(text[i:i + _HELD_MIN], ())):
            return True
    return False


# -- the sources -------------------------------------------------------------------------------


def sharegpt_prompts(n: int, seed: int) -> Iterator[dict]:
    """English first turns of ShareGPT chats, in a seeded hash order."""
    from ..data.corpora import SHAREGPT, ReadReport, fetch_source, sharegpt_chats

    rows = []
    for chat in sharegpt_chats(fetch_source(SHAREGPT), ReadReport()):
        msgs = chat["messages"]
        if len(msgs) < 2 or msgs[0]["role"] != "user" or msgs[1]["role"] != "assistant":
            continue
        q, a = msgs[0]["content"].strip(), msgs[1]["content"].strip()
        if not 16 <= len(q) <= 600 or len(a) > 900 or "```" in q or "```" in a:
            continue
        if cjk_share(q) > 0 or len(_LATIN.findall(q)) < 0.6 * len(q.replace(" ", "")):
            continue
        if re.search(r"chatgpt|openai|as an ai|language model", q + " " + a, re.I):
            continue
        rows.append(q)
    rows = sorted(set(rows), key=lambda q: _key(seed, "sharegpt", q))
    for q in rows[:n]:
        yield {"lang": "en", "source": "sharegpt", "kind": "chat", "prompt": q}


NEWS_TASKS = (
    ("summary", "用一句话概括下面这段新闻的主要内容。\n\n{p}"),
    ("headline", "为下面这段新闻拟一个简短的标题。\n\n{p}"),
    ("entities", "下面这段文字提到了哪些人物、机构或地点？请列出来。\n\n{p}"),
    ("rewrite", "请把下面这段话改写得更通俗易懂。\n\n{p}"),
    ("tone", "下面这段新闻的基调是积极、消极还是中性？请简要说明理由。\n\n{p}"),
    ("translate", "把下面这段话翻译成英文。\n\n{p}"),
    ("json", "从下面这段新闻中提取人物和地点，以JSON格式输出，键为\"people\"和\"places\"，"
             "值为列表。\n\n{p}"),
    ("question", "根据下面这段新闻提一个问题，并给出答案。\n\n{p}"),
)


def news_prompts(n: int, seed: int) -> Iterator[dict]:
    """People's Daily paragraphs (80-300 characters) with a task each."""
    from ..data.corpora import corpus_documents

    paras = set()
    for doc in corpus_documents("peoples-daily", manifest=False):
        for line in doc.split("\n"):
            line = _ascii_digits(line.strip())
            if 80 <= len(line) <= 300 and cjk_share(line) > 0.9 and line[-1] in "。！？”":
                paras.add(line)
    ordered = sorted(paras, key=lambda p: _key(seed, "news", p))
    for i, p in enumerate(ordered[:n]):
        kind, template = NEWS_TASKS[i % len(NEWS_TASKS)]
        yield {"lang": "zh", "source": "peoples-daily", "kind": kind,
               "prompt": template.format(p=p)}


def idiom_prompts(n_gold: int, n_teacher: int, seed: int, held: dict[str, set[str]]
                  ) -> Iterator[dict]:
    """Idioms: their meaning (gold, from the dictionary), a sentence or a short story using
    them (teacher). Idioms of the idioms-zh task are never used."""
    from ..data import corpora

    path = corpora.fetch_source(corpora.CHARACTERS_WORDS)
    records = json.loads(corpora.read_zip_member(path, corpora.IDIOMS_MEMBER).decode("utf-8"))
    pool = []
    for r in records:
        if not isinstance(r, dict) or not isinstance(r.get("word"), str):
            continue
        word, meaning = r["word"].strip(), _balanced((r.get("explanation") or "").strip())
        if (not 3 <= len(word) <= 5 or not meaning or meaning == "无" or word in held["idioms"]
                or meaning in held["meanings"] or meaning.replace(word, "～") in held["meanings"]):
            continue
        example = (r.get("example") or "").strip()
        example = "" if example == "无" else example.replace("～", word)
        # nor one whose answer holds a meaning the task offers (a variant's gloss: "执迷不悟；
        # …。同遂迷不寤。") or names an idiom it asks
        if held_in(meaning + "\n" + example, held):
            continue
        pool.append((word, meaning, example))
    pool = list({x[0]: x for x in pool}.values())
    pool.sort(key=lambda x: _key(seed, "idiom", x[0]))
    for word, meaning, example in pool[:n_gold]:
        answer = f"“{word}”的意思是：{meaning}"
        if example:
            answer += f"\n例句：{example}"
        yield {"lang": "zh", "source": "idioms", "kind": "meaning",
               "prompt": f"成语“{word}”是什么意思？", "gold": answer}
    for i, (word, _, _) in enumerate(pool[n_gold:n_gold + n_teacher]):
        prompt = (f"请用成语“{word}”造一个句子。" if i % 2 == 0
                  else f"请以成语“{word}”为主题，写一个一百字左右的小故事。")
        yield {"lang": "zh", "source": "idioms", "kind": "use", "prompt": prompt}


def character_prompts(n: int, seed: int) -> Iterator[dict]:
    """Xinhua dictionary characters: reading and meaning (gold)."""
    from ..data import corpora

    path = corpora.fetch_source(corpora.CHARACTERS_WORDS)
    records = json.loads(corpora.read_zip_member(path, corpora.DICTIONARY_MEMBER)
                         .decode("utf-8"))
    pool = []
    for r in records:
        if not isinstance(r, dict):
            continue
        word, pinyin = r.get("word"), r.get("pinyin")
        explanation = r.get("explanation")
        if not (isinstance(word, str) and len(word) == 1 and isinstance(pinyin, str)
                and pinyin and isinstance(explanation, str)):
            continue
        text = " ".join(explanation.split())
        if not 10 <= len(text) <= 200:
            continue
        pool.append((word, pinyin, text))
    pool = list({x[0]: x for x in pool}.values())
    pool.sort(key=lambda x: _key(seed, "char", x[0]))
    for word, pinyin, text in pool[:n]:
        yield {"lang": "zh", "source": "xinhua-dictionary", "kind": "character",
               "prompt": f"“{word}”字怎么读？是什么意思？",
               "gold": f"“{word}”读作 {pinyin}。{text}"}


def poem_prompts(n_gold: int, n_teacher: int, seed: int, held: dict[str, set[str]]
                 ) -> Iterator[dict]:
    """Tang and Song poems outside the cloze-zh anthologies: who wrote it (gold), what it
    says (teacher)."""
    from ..data.corpora import corpus_documents

    poems = []
    for doc in corpus_documents("chinese-poetry", manifest=False):
        lines = doc.split("\n")
        if len(lines) < 3:
            continue
        title, author, body = lines[0].strip(), lines[1].strip(), "\n".join(lines[2:]).strip()
        if not (title and author and 16 <= len(body) <= 120) or len(author) > 8:
            continue
        if any(not line or line[-1] not in "。？！" for line in lines[2:]) or "(" in body:
            continue  # verse only: no stage directions or unfinished lines
        halves = re.split(r"[，。？！；\n]", body)
        if title + "|" + author in held["poems"] or any(h in held["poem_lines"] for h in halves):
            continue
        poems.append((title, author, body))
    poems = list(dict.fromkeys(poems))
    poems.sort(key=lambda p: _key(seed, "poem", p[0], p[1], p[2]))
    for title, author, body in poems[:n_gold]:
        yield {"lang": "zh", "source": "chinese-poetry", "kind": "author",
               "prompt": f"下面这首诗的作者是谁？题目是什么？\n\n{body}",
               "gold": f"这首诗是{author}的《{title}》。"}
    for title, author, body in poems[n_gold:n_gold + n_teacher]:
        yield {"lang": "zh", "source": "chinese-poetry", "kind": "explain",
               "prompt": f"请用现代汉语解释这首诗的大意：\n\n《{title}》 {author}\n{body}"}


def review_prompts(n: int, seed: int, held: dict[str, set[str]]) -> Iterator[dict]:
    """Product reviews of the sentiment training split: the label (gold)."""
    from ..evaluate.recipes import sentiment_split

    train, _ = sentiment_split()
    rows = [ex for ex in train if ex["text"] not in held["reviews"] and 6 <= len(ex["text"])]
    rows.sort(key=lambda ex: _key(seed, "review", ex["text"]))
    for ex in rows[:n]:
        yield {"lang": "zh", "source": "sentiment", "kind": "classify",
               "prompt": f"判断下面这条评论的情感是正面还是负面，只回答“正面”或“负面”。\n\n{ex['text']}",
               "gold": ex["label"]}


# -- the whole set -----------------------------------------------------------------------------

# how many prompts of each kind (the recipe's data budget)
DEFAULT_COUNTS = {
    "sharegpt": 1200, "news": 800, "idiom_gold": 600, "idiom_teacher": 200,
    "character": 300, "poem_gold": 200, "poem_teacher": 150, "review": 300,
}
CHECK_SHARE = 0.25  # teacher prompts that get verifiable instructions appended


def build_prompts(seed: int = 0, counts: dict[str, int] | None = None) -> list[dict]:
    """The recipe's prompts, the same list for the same seed and counts (see the module
    docstring), each with a stable ``id``."""
    c = {**DEFAULT_COUNTS, **(counts or {})}
    held = held_out_items()
    sources = itertools.chain(
        sharegpt_prompts(c["sharegpt"], seed),
        news_prompts(c["news"], seed),
        idiom_prompts(c["idiom_gold"], c["idiom_teacher"], seed, held),
        character_prompts(c["character"], seed),
        poem_prompts(c["poem_gold"], c["poem_teacher"], seed, held),
        review_prompts(c["review"], seed, held),
    )
    out, seen = [], set()
    for p in sources:
        p = {"gold": None, "checks": None, **p}
        rng = random.Random(_key(seed, "checks", p["prompt"]))
        if p["gold"] is None and p["kind"] not in ("json", "translate") and \
                rng.random() < CHECK_SHARE:
            p["prompt"], p["checks"] = add_checks(p["prompt"], p["lang"], rng)
        p["id"] = _key(PROMPTS_VERSION, p["source"], p["kind"], p["prompt"])[:16]
        if p["id"] not in seen:  # a dictionary lists some entries twice
            seen.add(p["id"])
            out.append(p)
    return out
