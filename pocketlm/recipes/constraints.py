"""Instruction chats built from answers the recipe already has (constraint back-translation).

The teacher follows few appended instructions (about 40 % of the ones the recipe asks; some,
such as "no commas", under a quarter), and the kinds an app asks for most (begin or end with a
given sentence, wrap in quotes, answer as JSON, mark key words, a postscript, paragraphs) need
no new answers at all: a kept teacher answer is made to follow them by the edit a compliant
writer would make (put the sentence first, wrap the answer in quotes or in a JSON object, blank
lines between its paragraphs), or the instruction is chosen to be true of the answer as it is
(at most N words where it has fewer, "use the word X at least twice" where it does, "no
commas" where it has none). Every instruction added is then verified by the capability
suite's own checker on the final text, and a chat that fails one is not made.

The prompt and the answer stay the teacher's; the wording of the instructions is this
recipe's own (none of the capability suite's prompts is used). :func:`constrained_chat` is
deterministic in (seed, prompt id).
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter

from ..evaluate.instructions import CHECKERS, count_sentences, count_words, count_zh_chars
from .prompts import _key

_EN_WORD = re.compile(r"[A-Za-z][a-z]{4,}")
_ZH_PAIR = re.compile(r"[\u4e00-\u9fff]{2}")
_ZH_FUNCTION = set("的了是在和有我你他她它这那一不也就都而及与或其之为以于个们要会对很把被")
_EN_STOP = {
    "about", "after", "again", "also", "because", "before", "being", "below", "between",
    "could", "every", "first", "other", "their", "there", "these", "thing", "things", "think",
    "those", "through", "under", "which", "while", "would", "where", "should", "however",
    "might", "still", "since", "until", "whether", "within", "without", "your", "yours",
}
_EN_AVOID = ("very", "really", "basically", "actually", "simply", "stuff", "literally",
             "obviously", "definitely", "totally", "amazing", "awesome")
_ZH_AVOID = ("非常", "其实", "总之", "总而言之", "显然", "绝对", "特别", "简直", "十分", "当然")

_EN_START = ("Sure.", "Of course.", "Good question.", "Here is what I think:", "Happy to help.",
             "In short:", "Great question!", "Here you go:")
_ZH_START = ("好的。", "没问题。", "以下是我的回答：", "简单来说：", "你好！", "这个问题很好。")
_EN_END = ("Hope this helps.", "Let me know if you have questions.", "Good luck!",
           "Thanks for asking.", "That is all.", "Have a great day!", "Feel free to ask more.")
_ZH_END = ("希望对你有帮助。", "祝你顺利！", "以上就是全部内容。", "如有问题欢迎再问。", "谢谢提问。")
_EN_PS = ("Feel free to ask a follow-up question.", "Thanks for reading!",
          "Let me know how it goes.", "I can give more detail if you need it.")
_ZH_PS = ("如果还有疑问，欢迎继续提问。", "感谢阅读！", "需要更多细节可以告诉我。")
_JSON_KEYS = ("answer", "reply", "response", "text")

# kind: (English wordings, Chinese wordings); {n} {p} {k} {k2} {w} {w2} {key} are filled in
_WORDING: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "starts_with": (("Start your reply with \"{p}\"", "Your answer must begin with \"{p}\"",
                     "Open your answer with the words \"{p}\""),
                    ("回答请以“{p}”开头。", "回答的第一句必须是“{p}”")),
    "ends_with": (("End your answer with the exact sentence \"{p}\"",
                   "The last words of your answer must be \"{p}\"",
                   "Close with this exact line: \"{p}\""),
                  ("回答的最后一句必须是“{p}”", "请用“{p}”结束你的回答。")),
    "quoted": (("Wrap your whole reply in double quotation marks.",
                "Enclose the entire answer in double quotes."),
               ("把整个回答放在双引号里。", "整个回答要用双引号括起来。")),
    "postscript": (("After your answer, add a line starting with P.S.",
                    "Include a postscript at the end that starts with \"P.S.\""),
                   ("在回答最后加一句附言，以“附言”开头。", "结尾请加上附言（以“附言：”开头）。")),
    "lowercase": (("Use only lowercase letters in your reply.",
                   "Do not use any capital letters at all."), ()),
    "uppercase": (("Write your reply in capital letters only.",
                   "Answer entirely in uppercase letters."), ()),
    "json_keys": (("Reply with a JSON object only, with the key \"{key}\" holding your answer.",
                   "Output nothing but JSON: an object whose \"{key}\" field is your answer."),
                  ("只输出一个JSON对象，用键\"{key}\"存放你的回答。",
                   "请以JSON格式回答，只输出一个对象，键为\"{key}\"。")),
    "repeat_request": (("Before you answer, repeat the request below exactly as it is written, "
                        "then answer it.\nRequest: {p}",
                        "Copy the following request word for word first, and only then give "
                        "your answer.\nRequest: {p}"),
                       ("请先一字不差地重复下面的请求，然后再回答。\n请求：{p}",
                        "回答之前，先把下面这个请求原样抄写一遍，再作答。\n请求：{p}")),
    "paragraphs_exactly": (("Write exactly {n} paragraphs, with a blank line between them.",
                            "Your answer should have {n} paragraphs separated by empty lines."),
                           ("请分{n}段回答，段与段之间空一行。", "回答要正好{n}段，每段之间用空行隔开。")),
    "highlights_at_least": (("Mark at least {n} key words in bold with markdown, like *this*.",
                             "Highlight at least {n} important phrases with asterisks, for "
                             "example *key point*."),
                            ("请用markdown的星号突出至少{n}处重点，例如*重点*。",
                             "回答中至少用星号标出{n}个关键词，如*关键词*。")),
    "keywords_include": (("Make sure you mention \"{k}\" and \"{k2}\".",
                          "Your answer has to include the words {k} and {k2}."),
                         ("回答中要包含“{k}”和“{k2}”。", "请在回答里提到“{k}”和“{k2}”这两个词。")),
    "keyword_frequency_at_least": (("Use the word \"{k}\" at least {n} times.",
                                    "The word {k} should appear {n} times or more."),
                                   ("“{k}”这个词至少要出现{n}次。", "回答中至少使用{n}次“{k}”。")),
    "words_exclude": (("Do not use the words \"{w}\" or \"{w2}\".",
                       "Avoid the words {w} and {w2} completely."),
                      ("不要使用“{w}”和“{w2}”这两个词。", "回答中不能出现“{w}”或“{w2}”。")),
    "words_at_most": (("Keep it under {n} words.", "Use no more than {n} words."), ()),
    "words_at_least": (("Write at least {n} words.", "Your answer should be {n} words or more."),
                       ()),
    "chars_zh_at_most": ((), ("字数控制在{n}字以内。", "回答最多{n}个字。")),
    "chars_zh_at_least": ((), ("至少写{n}个字。", "回答不能少于{n}字。")),
    "sentences_at_most": (("Answer in no more than {n} sentences.", "Use at most {n} sentences."),
                          ("最多用{n}句话回答。", "回答不要超过{n}句。")),
    "sentences_at_least": (("Use at least {n} sentences.", "Write {n} or more sentences."),
                           ("至少写{n}句话。", "回答不少于{n}句。")),
    "no_commas": (("Avoid commas entirely.", "Write your answer without a single comma."),
                  ("全文不要用逗号。", "回答里一个逗号也不要用。")),
    "placeholders_at_least": (("Include at least {n} placeholders in square brackets, like "
                               "[name].", "Leave at least {n} blanks to fill in, written in "
                               "square brackets such as [date]."),
                              ("用方括号写至少{n}个占位符，例如[姓名]。", "至少留{n}处方括号占位，比如[日期]。")),
    "bullets_exactly": (("Format the answer as exactly {n} bullet points starting with \"- \".",
                         "Give exactly {n} points, one per line, each beginning with \"- \"."),
                        ("请写成正好{n}个要点，每个要点一行，以“- ”开头。", "用{n}条“- ”开头的列表回答。")),
}

# kinds that change the answer, in the order they are applied (innermost first)
_EDITS = ("lowercase", "uppercase", "highlights_at_least", "paragraphs_exactly", "postscript",
          "ends_with", "starts_with", "quoted", "json_keys", "repeat_request")
_EXCLUSIVE = {"json_keys", "repeat_request"}  # asked alone
_CLASHES = [{"quoted", "ends_with"}, {"quoted", "starts_with"}, {"quoted", "postscript"},
            {"lowercase", "uppercase"}, {"starts_with", "repeat_request"},
            {"paragraphs_exactly", "bullets_exactly"}]


def _content_words(text: str, lang: str, prompt: str) -> list[str]:
    """Candidate keywords of the answer, most frequent first: English words of five letters
    or more that are not function words; Chinese two-character pieces without a function
    character that the prompt also uses (so they are the topic's words, not fragments)."""
    if lang == "en":
        words = [w.lower() for w in _EN_WORD.findall(text) if w.lower() not in _EN_STOP]
    else:
        words = [p for i in range(len(text) - 1) if _ZH_PAIR.fullmatch(p := text[i:i + 2])
                 and not set(p) & _ZH_FUNCTION and p in prompt]
    counts = Counter(words)
    return sorted(counts, key=lambda w: (-counts[w], w))


def _highlight(text: str, words: list[str], n: int) -> str | None:
    """``text`` with the first occurrence of ``n`` of ``words`` marked ``**like this**``."""
    done = 0
    for w in words:
        if done == n:
            break
        m = re.search(rf"(?<![A-Za-z*]){re.escape(w)}(?![A-Za-z*])", text, re.I)
        if m:
            text = f"{text[:m.start()]}**{m.group(0)}**{text[m.end():]}"
            done += 1
    return text if done == n else None


def _paragraphs(text: str) -> tuple[str, int] | None:
    """The answer's lines as blank-line-separated paragraphs (2 to 5 of them); an answer of
    one line and four sentences or more is cut into two or three paragraphs of whole
    sentences. None for lists and for what cannot be cut so."""
    parts = [p.strip() for p in re.split(r"\n\s*\n|\n", text.strip()) if p.strip()]
    if any(re.match(r"[-*]\s|\d+[.、]", p) for p in parts):
        return None
    if len(parts) == 1:
        sentences = [s for s in _SENTENCE_CUT.split(parts[0]) if s.strip()]
        if len(sentences) < 4:
            return None
        n = 3 if len(sentences) >= 6 else 2
        size = -(-len(sentences) // n)
        joiner = "" if _ZH_PAIR.search(parts[0]) else " "
        parts = [joiner.join(s.strip() for s in sentences[i:i + size])
                 for i in range(0, len(sentences), size)]
    if not 2 <= len(parts) <= 5:
        return None
    return "\n\n".join(parts), len(parts)


_SENTENCE_CUT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])|(?<=[。！？])")


def _round_up(n: int, steps=(20, 30, 40, 50, 60, 80, 100, 120, 150, 200, 250, 300)) -> int | None:
    return next((s for s in steps if s >= n + max(2, n // 10)), None)


def _round_down(n: int, steps=(10, 20, 30, 40, 50, 60, 80, 100, 120, 150, 200)) -> int | None:
    return next((s for s in reversed(steps) if s <= n - max(2, n // 10)), None)


def _plan(kind: str, text: str, prompt: str, lang: str, rng: random.Random
          ) -> tuple[dict, dict] | None:
    """(checker args, wording fields) for one instruction of ``kind`` about ``text`` (the
    answer as the earlier edits left it), or None where it does not apply."""
    zh = lang == "zh"
    if kind == "starts_with":
        p = rng.choice(_ZH_START if zh else _EN_START)
        return {"phrase": p}, {"p": p}
    if kind == "ends_with":
        p = rng.choice(_ZH_END if zh else _EN_END)
        return {"phrase": p}, {"p": p}
    if kind == "postscript":
        return {"marker": "附言" if zh else "P.S."}, {}
    if kind in ("quoted", "lowercase", "uppercase", "no_commas"):
        if kind == "uppercase" and count_words(text) > 60:
            return None
        if kind == "no_commas" and not CHECKERS["no_commas"](text):
            return None
        return {}, {}
    if kind == "json_keys":
        key = rng.choice(_JSON_KEYS)
        return {"keys": [key]}, {"key": key}
    if kind == "repeat_request":
        if len(prompt) > 400:
            return None
        return {"request": prompt}, {"p": prompt}
    if kind == "paragraphs_exactly":
        got = _paragraphs(text)
        return None if got is None else ({"n": got[1]}, {"n": got[1]})
    if kind == "highlights_at_least":
        n = rng.choice((2, 3))
        return ({"n": n}, {"n": n}) if len(_content_words(text, lang, prompt)) >= n else None
    if kind == "keywords_include":
        words = _content_words(text, lang, prompt)[:6]
        if len(words) < 2:
            return None
        k, k2 = rng.sample(words, 2)
        return {"keywords": [k, k2]}, {"k": k, "k2": k2}
    if kind == "keyword_frequency_at_least":
        words = [w for w in _content_words(text, lang, prompt)[:3]
                 if CHECKERS["keyword_frequency_at_least"](text, keyword=w, n=2)]
        if not words:
            return None
        k = rng.choice(words)
        n = 3 if CHECKERS["keyword_frequency_at_least"](text, keyword=k, n=3) else 2
        return {"keyword": k, "n": n}, {"k": k, "n": n}
    if kind == "words_exclude":
        pool = [w for w in (_ZH_AVOID if zh else _EN_AVOID)
                if CHECKERS["words_exclude"](text, words=[w])]
        if len(pool) < 2:
            return None
        w, w2 = rng.sample(pool, 2)
        return {"words": [w, w2]}, {"w": w, "w2": w2}
    if kind in ("words_at_most", "words_at_least", "chars_zh_at_most", "chars_zh_at_least",
                "sentences_at_most", "sentences_at_least"):
        count = (count_zh_chars if kind.startswith("chars") else
                 count_sentences if kind.startswith("sentences") else count_words)(text)
        if kind.startswith("sentences"):
            n = count + rng.choice((0, 1)) if kind.endswith("most") else max(1, count - 1)
            if count < 2:
                return None
        else:
            n = _round_up(count) if kind.endswith("most") else _round_down(count)
        return None if n is None else ({"n": n}, {"n": n})
    if kind == "placeholders_at_least":
        n = next((k for k in (3, 2) if CHECKERS[kind](text, n=k)), None)
        return None if n is None else ({"n": n}, {"n": n})
    if kind == "bullets_exactly":
        n = next((k for k in range(2, 8) if CHECKERS[kind](text, n=k)), None)
        return None if n is None else ({"n": n}, {"n": n})
    raise ValueError(kind)


def _apply(kind: str, text: str, args: dict, prompt: str, lang: str, rng: random.Random
           ) -> str | None:
    zh = lang == "zh"
    if kind == "lowercase":
        return text.lower()
    if kind == "uppercase":
        return text.upper()
    if kind == "highlights_at_least":
        return _highlight(text, _content_words(text, lang, prompt), args["n"])
    if kind == "paragraphs_exactly":
        got = _paragraphs(text)
        return None if got is None else got[0]
    if kind == "postscript":
        return f"{text}\n\n" + (f"附言：{rng.choice(_ZH_PS)}" if zh else f"P.S. {rng.choice(_EN_PS)}")
    if kind == "ends_with":
        return f"{text}\n\n{args['phrase']}"
    if kind == "starts_with":
        sep = "" if zh else " " if len(text) < 200 else "\n"
        return f"{args['phrase']}{sep}{text}"
    if kind == "quoted":
        return f"“{text}”" if zh else f"\"{text}\""
    if kind == "json_keys":
        return json.dumps({args["keys"][0]: text}, ensure_ascii=False, indent=2)
    if kind == "repeat_request":
        return f"{prompt}\n\n{text}"
    raise ValueError(kind)


def kinds_for(lang: str) -> list[str]:
    """The instruction kinds this module writes in ``lang``."""
    return [k for k, (en, zh) in _WORDING.items() if (zh if lang == "zh" else en)]


def constrained_chat(prompt: dict, answer: str, seed: int, salt: str = "constraints"
                     ) -> dict | None:
    """A chat of ``prompt`` (a recipe prompt without instructions) with one to three
    instructions added and ``answer`` made to follow them, or None when no combination drawn
    is verified. Returns ``{"messages": [...], "checks": [{"check", "args"}, ...]}``;
    deterministic in (seed, salt, prompt id)."""
    lang = prompt["lang"]
    rng = random.Random(_key(seed, salt, prompt["id"]))
    kinds = kinds_for(lang)
    for _ in range(4):
        want = 1 if (r := rng.random()) < 0.5 else 2 if r < 0.85 else 3
        picks = rng.sample(kinds, want)
        if len(picks) > 1 and any(k in _EXCLUSIVE for k in picks):  # asked alone
            picks = [k for k in picks if k not in _EXCLUSIVE] if rng.random() < 0.5 else \
                [next(k for k in picks if k in _EXCLUSIVE)]
        if not picks or any(pair <= set(picks) for pair in _CLASHES):
            continue
        # edits in their order, then what describes the final text
        order = [k for k in _EDITS if k in picks] + [k for k in picks if k not in _EDITS]
        text, plan = answer.strip(), []
        for kind in order:
            got = _plan(kind, text, prompt["prompt"], lang, rng)
            if got is None:
                break
            args, fields = got
            if kind in _EDITS:
                text = _apply(kind, text, args, prompt["prompt"], lang, rng)
                if text is None:
                    break
            plan.append((kind, args, fields))
        else:
            checks = [{"check": k, "args": a} for k, a, _ in plan]
            if not all(CHECKERS[c["check"]](text, **c["args"]) for c in checks):
                continue
            return {"messages": [{"role": "user", "content": _ask(prompt, plan, lang, rng)},
                                 {"role": "assistant", "content": text}], "checks": checks}
    return None


def _ask(prompt: dict, plan: list, lang: str, rng: random.Random) -> str:
    """The prompt with the instructions' wording, after it (or, one time in five, before)."""
    zh = lang == "zh"
    if plan[0][0] == "repeat_request":
        return rng.choice(_WORDING["repeat_request"][zh]).format(**plan[0][2])
    texts = [rng.choice(_WORDING[k][zh]).format(**f) for k, _, f in plan]
    said = ("" if zh else " ").join(texts)
    body = prompt["prompt"].rstrip()
    if rng.random() < 0.2:
        return f"{said}\n{body}" if zh else f"{said}\n\n{body}"
    return f"{body}\n{said}" if zh else f"{body}\n\n{said}"
