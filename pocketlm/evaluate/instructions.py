"""Instruction following: prompts that carry verifiable instructions, each checked by code.

The task is built in the manner of IFEval (Zhou et al. 2023, "Instruction-Following Evaluation
for Large Language Models"): every prompt asks for something ordinary (a note, a summary, a
list of tips, a reply) and adds one to three instructions that a short function can verify
("answer in at most 50 words", "use exactly three bullet points", "output JSON only"). The
prompts (80 English, 80 Chinese: 40 of each before version 5) and the checkers were written
for pocketlm.

A *checker* is a pure function ``(response, **args) -> bool`` registered by id in
:data:`CHECKERS`; its docstring says exactly what passes. An instruction is
``{"check": "<checker id>", "args": {...}}``. :func:`check_response` scores one greedy output
against an example's instructions: ``correct`` is the prompt-level strict accuracy (every
instruction passes on the response as written) and ``correct_loose`` the loose one (each
instruction passes on at least one of :func:`loose_variants` of the response).

Counting rules, shared by the checkers:

* an English *word* is a run of ASCII letters and digits, with inner apostrophes or hyphens
  (``don't``, ``well-known``, ``2024``): see :func:`count_words`;
* Chinese length (``chars_zh_*``) counts each CJK ideograph as one 字 and each run of ASCII
  letters and digits as one more (``用App记账2次`` is 6); punctuation and spaces are not counted:
  see :func:`count_zh_chars`;
* sentences end at ``. ! ? …`` followed by a space or the end, or at ``。！？``; not after an
  abbreviation (``Mr.``, ``p.m.``, :data:`ABBREVIATIONS`) or a capital initial (``J.``), nor
  at an ellipsis followed by a lowercase word: close to how IFEval's sentence tokenizer
  (NLTK's Punkt) reads them;
* language: the share of CJK ideographs among all letters (``str.isalpha``; a run of ASCII
  letters and digits counts as one, as in the Chinese length, so a reply naming ``iCloud`` or
  ``Francesco Cirillo`` stays Chinese) must be at least :data:`ZH_MIN_CJK_SHARE` for Chinese; English needs a share of Latin letters (ASCII and
  accented ones such as ``é``) of at least :data:`EN_MIN_LATIN_SHARE`. These check the script,
  not the language: a French reply passes as "English";
* JSON may be wrapped in one Markdown code fence (```` ```json ... ``` ````, on one line or
  several) that encloses the whole response, as IFEval allows; anything else around the JSON
  fails.

Where these rules still differ from IFEval's reference checkers, on purpose: keywords match
whole words (``refund`` is not found in ``refunds``; IFEval matches substrings, so ``art`` is
found in ``start``); a word is a run of letters with inner apostrophes or hyphens (IFEval counts
``don't`` as two); a postscript starts a line; lowercase and uppercase replies are not also
required to be English (IFEval's language detector misjudges short replies); the Chinese
checks (length, language, ``，`` as a comma) have no IFEval counterpart.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import typing
from collections.abc import Callable

from ..errors import PocketError

# bumped when a prompt, an instruction or a checker changes (2: bullets_exactly no longer counts
# a horizontal rule such as "* * *" as a bullet; 3: an empty reply, or an empty loose variant of
# a one- or two-line reply, follows no instruction, as in IFEval: "at most N words" and "no
# commas" held for the empty text; 4: judged as IFEval judges them where pocketlm's rule was
# stricter by accident: a sentence does not end at an abbreviation, an initial or an ellipsis
# before a lowercase word, a postscript may be emphasised (**P.S.**), ends_with allows closing
# quotation marks, a JSON fence may sit on one line, a Chinese reply's language counts each
# run of ASCII letters and digits as one unit; "under N words" is fewer than N; 5: 80 more
# prompts, 40 en and 40 zh, so that a difference of 10 points is measurable: 160 in all)
INSTRUCTIONS_VERSION = 5

ZH_MIN_CJK_SHARE = 0.5  # language_zh: CJK ideographs / letters
EN_MIN_LATIN_SHARE = 0.95  # language_en: Latin letters (ASCII, U+00C0-U+024F) / letters
REPEAT_MIN_EXTRA_CHARS = 1  # repeat_request: non-blank characters needed after the repeat

_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002ffff"
_CJK_CHAR = re.compile(f"[{_CJK}]")
_WORD = re.compile(r"[A-Za-z0-9]+(?:['’\-][A-Za-z0-9]+)*")
_ASCII_RUN = re.compile(r"[A-Za-z0-9]+")
_SENTENCE_END = re.compile(r"[.!?。！？…]+(?:[\"'”’)）\]]*)(?=\s|$)|[。！？]+")
# what a "." after which no sentence ends follows, as written (the dot before it dropped):
# titles and a few abbreviations that are no English word ("No." and "fig." are words too)
ABBREVIATIONS = frozenset(["Mr", "Mrs", "Ms", "Dr", "Prof", "Jr", "Sr", "St", "Mt", "vs",
                           "a.m", "p.m", "A.M", "P.M", "Ph.D", "U.S", "U.K"])
_BEFORE_DOT = re.compile(r"([A-Za-z](?:[A-Za-z.]*[A-Za-z])?)$")
_BULLET = re.compile(r"[ \t]*[-*][ \t]+\S")
# a Markdown horizontal rule: three or more of one of - * _, spaces between them allowed
_RULE = re.compile(r"[ \t]*([-*_])(?:[ \t]*\1){2,}\s*")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_FENCE = re.compile(r"^```[A-Za-z]*[ \t]*\r?\n?(.*?)\r?\n?```$", re.S)
_TITLE = re.compile(r"<<[^<>\n]*\S[^<>\n]*>>")
_PLACEHOLDER = re.compile(r"\[[^\[\]\n]*\S[^\[\]\n]*\]")
_HIGHLIGHT = re.compile(r"(\*\*?)(?=[^\s*])([^\n*]+?)(?<=[^\s*])\1")


# -- counting -----------------------------------------------------------------------------------


def count_words(text: str) -> int:
    """English words: runs of ASCII letters/digits with inner ``'``, ``’`` or ``-``."""
    return len(_WORD.findall(text))


def count_zh_chars(text: str) -> int:
    """Chinese length: CJK ideographs plus one per run of ASCII letters/digits."""
    return len(_CJK_CHAR.findall(text)) + len(_ASCII_RUN.findall(text))


def count_sentences(text: str) -> int:
    """Sentences: pieces ended by ``. ! ? …`` (followed by a space or the end) or by
    ``。！？``, plus a final unterminated piece, each holding a letter, digit or ideograph. A
    single ``.`` after an abbreviation (:data:`ABBREVIATIONS`, as written) or a capital
    initial ends none, nor does an ellipsis (``...``, ``…``) followed by a lowercase letter."""
    pieces, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        mark = m.group().rstrip("\"'”’)）]")
        if mark == ".":
            word = _BEFORE_DOT.search(text, 0, m.start())
            if word and (len(word.group(1)) == 1 and word.group(1).isupper()
                         or word.group(1) in ABBREVIATIONS):
                continue
        elif mark in ("...", "…", "……"):
            after = text[m.end():].lstrip()
            if after[:1].islower():
                continue
        pieces.append(text[start:m.start()])
        start = m.end()
    pieces.append(text[start:])
    return sum(1 for p in pieces if any(ch.isalnum() for ch in p))


def _is_cjk(ch: str) -> bool:
    return _CJK_CHAR.match(ch) is not None


def _letters(text: str) -> list[str]:
    return [ch for ch in text if ch.isalpha()]


def _mentions(text: str, word: str) -> int:
    """Case-insensitive occurrences of ``word``: at word boundaries when it starts and ends
    with an ASCII letter or digit, else as a plain substring (Chinese keywords)."""
    if not word:
        return 0
    pattern = re.escape(word.casefold())
    if word[0].isascii() and word[0].isalnum():
        pattern = r"(?<![A-Za-z0-9])" + pattern
    if word[-1].isascii() and word[-1].isalnum():
        pattern += r"(?![A-Za-z0-9])"
    return len(re.findall(pattern, text.casefold()))


def _squash(text: str) -> str:
    return " ".join(text.casefold().split())


def _json_body(text: str) -> str:
    body = text.strip()
    m = _FENCE.match(body)
    return m.group(1).strip() if m else body


# -- checkers -----------------------------------------------------------------------------------


def words_at_most(response: str, n: int) -> bool:
    """At most ``n`` English words (:func:`count_words`)."""
    return count_words(response) <= n


def words_at_least(response: str, n: int) -> bool:
    """At least ``n`` English words (:func:`count_words`)."""
    return count_words(response) >= n


def chars_zh_at_most(response: str, n: int) -> bool:
    """At most ``n`` 字 (:func:`count_zh_chars`: ideographs + ASCII runs)."""
    return count_zh_chars(response) <= n


def chars_zh_at_least(response: str, n: int) -> bool:
    """At least ``n`` 字 (:func:`count_zh_chars`: ideographs + ASCII runs)."""
    return count_zh_chars(response) >= n


def sentences_at_most(response: str, n: int) -> bool:
    """At most ``n`` sentences (:func:`count_sentences`), and at least one."""
    return 1 <= count_sentences(response) <= n


def sentences_at_least(response: str, n: int) -> bool:
    """At least ``n`` sentences (:func:`count_sentences`)."""
    return count_sentences(response) >= n


def bullets_exactly(response: str, n: int) -> bool:
    """Exactly ``n`` bullet lines: a line that starts (after indentation) with ``-`` or ``*``,
    then spaces, then text (``- tip``, ``*  tip``; not ``-tip``, ``**bold**``, nor a Markdown
    horizontal rule: ``---``, ``***``, ``- - -``, ``* * *``). Nested bullets count too; other
    lines may surround them."""
    return sum(1 for line in response.split("\n")
               if _BULLET.match(line) and not _RULE.fullmatch(line)) == n


def paragraphs_exactly(response: str, n: int) -> bool:
    """Exactly ``n`` paragraphs: non-blank pieces of the response split on blank lines."""
    return sum(1 for p in _PARAGRAPH_BREAK.split(response) if p.strip()) == n


def keywords_include(response: str, keywords: list[str]) -> bool:
    """Every keyword occurs, case-insensitively (English ones as whole words, Chinese ones as
    substrings)."""
    return all(_mentions(response, k) for k in keywords)


def words_exclude(response: str, words: list[str]) -> bool:
    """None of ``words`` occurs (same matching as :func:`keywords_include`)."""
    return not any(_mentions(response, w) for w in words)


def keyword_frequency_at_least(response: str, keyword: str, n: int) -> bool:
    """``keyword`` occurs at least ``n`` times (same matching as :func:`keywords_include`)."""
    return _mentions(response, keyword) >= n


def _json_value(response: str):
    """The JSON value of the response's body, or ``_NOT_JSON``. A degenerate output nested
    deeper than Python's parser goes (``[[[[...``, a small model looping) raises
    RecursionError, not ValueError: it fails the check instead of ending the whole run."""
    try:
        return json.loads(_json_body(response))
    except (ValueError, RecursionError):
        return _NOT_JSON


_NOT_JSON = object()


def json_valid(response: str) -> bool:
    """The response, stripped of surrounding whitespace and of one Markdown code fence that
    encloses all of it, parses as JSON whose top level is an object or an array (nested no
    deeper than Python's parser allows, about 1,000 levels)."""
    return isinstance(_json_value(response), dict | list)


def json_keys(response: str, keys: list[str]) -> bool:
    """As :func:`json_valid`, with a top-level object that has every key in ``keys``."""
    value = _json_value(response)
    return isinstance(value, dict) and all(k in value for k in keys)


def starts_with(response: str, phrase: str) -> bool:
    """The response, after leading whitespace, starts with ``phrase`` (case-insensitive,
    runs of whitespace compared as one space)."""
    return _squash(response).startswith(_squash(phrase))


def ends_with(response: str, phrase: str) -> bool:
    """The response, before trailing whitespace and closing double quotation marks (a reply
    quoted whole), ends with ``phrase`` (case-insensitive, runs of whitespace compared as one
    space); nothing else may follow it."""
    body, phrase = _squash(response), _squash(phrase)
    return body.endswith(phrase) or body.rstrip(' "”').endswith(phrase)


def lowercase(response: str) -> bool:
    """No uppercase letter, and at least one lowercase one."""
    return response == response.lower() and response != response.upper()


def uppercase(response: str) -> bool:
    """No lowercase letter, and at least one uppercase one."""
    return response == response.upper() and response != response.lower()


def no_commas(response: str) -> bool:
    """No ASCII comma ``,`` and no full-width comma ``，`` (the enumeration comma ``、`` is
    allowed)."""
    return "," not in response and "，" not in response


def quoted(response: str) -> bool:
    """The stripped response starts and ends with a double quotation mark: ``"…"`` or
    ``“…”``, with something in between."""
    body = response.strip()
    return len(body) > 2 and (body[0], body[-1]) in (('"', '"'), ("“", "”"))


def title(response: str) -> bool:
    """Holds a title in double angular brackets, ``<<like this>>``, on one line."""
    return _TITLE.search(response) is not None


def placeholders_at_least(response: str, n: int) -> bool:
    """At least ``n`` placeholders in square brackets, ``[like this]``, each on one line and
    not blank (the text part of a Markdown link ``[text](url)`` counts as one too)."""
    return len(_PLACEHOLDER.findall(response)) >= n


def language_zh(response: str) -> bool:
    """Chinese: CJK ideographs are at least :data:`ZH_MIN_CJK_SHARE` of the letters, a run of
    ASCII letters and digits counting as one (``日历App支持iCloud同步`` is Chinese)."""
    letters = [ch for ch in _letters(response) if not ch.isascii()]
    units = len(letters) + len(_ASCII_RUN.findall(response))
    return units > 0 and sum(map(_is_cjk, letters)) >= ZH_MIN_CJK_SHARE * units


def language_en(response: str) -> bool:
    """English: Latin letters (ASCII and U+00C0-U+024F, so ``café`` counts) are at least
    :data:`EN_MIN_LATIN_SHARE` of the letters."""
    letters = _letters(response)
    latin = sum(ch.isascii() or "\u00c0" <= ch <= "\u024f" for ch in letters)
    return bool(letters) and latin >= EN_MIN_LATIN_SHARE * len(letters)


def postscript(response: str, marker: str = "P.S.") -> bool:
    """A line starts (after indentation, and Markdown emphasis or a list or quote mark:
    ``**P.S.**``) with ``marker`` (case-insensitive) and has text after it, past any colon:
    ``P.S. see you``, ``**P.S.** see you`` and ``附言：明天见`` (marker ``附言``) pass, ``P.S.``
    and ``附言：`` alone do not."""
    for line in response.splitlines():
        line = line.strip().lstrip("*_>-#( \t")
        if line.casefold().startswith(marker.casefold()) and \
                line[len(marker):].strip(" \t:：*_"):
            return True
    return False


def highlights_at_least(response: str, n: int) -> bool:
    """At least ``n`` highlighted spans, ``*like this*`` or ``**like this**``, each on one line
    and not starting or ending with a space (so a ``* `` bullet is no highlight)."""
    return len(_HIGHLIGHT.findall(response)) >= n


def repeat_request(response: str, request: str) -> bool:
    """The response first repeats ``request`` word for word (case-insensitive, runs of
    whitespace compared as one space), then says something more."""
    body, head = _squash(response), _squash(request)
    return body.startswith(head) and len(body[len(head):].strip()) >= REPEAT_MIN_EXTRA_CHARS


CHECKERS: dict[str, Callable[..., bool]] = {f.__name__: f for f in (
    words_at_most, words_at_least, chars_zh_at_most, chars_zh_at_least, sentences_at_most,
    sentences_at_least, bullets_exactly, paragraphs_exactly, keywords_include, words_exclude,
    keyword_frequency_at_least, json_valid, json_keys, starts_with, ends_with, lowercase,
    uppercase, no_commas, quoted, title, placeholders_at_least, language_zh, language_en,
    postscript, highlights_at_least, repeat_request)}


def validate_instruction(instruction, where: str = "instruction") -> None:
    """Raise :class:`PocketError` unless ``instruction`` is ``{"check": id, "args": {...}}``
    naming a known checker with arguments of the right names and types (counts >= 1,
    non-empty strings and lists)."""
    if not isinstance(instruction, dict) or set(instruction) - {"check", "args"}:
        raise PocketError(f"{where}: expected {{\"check\": ..., \"args\": {{...}}}}, got "
                          f"{instruction!r}")
    name, args = instruction.get("check"), instruction.get("args", {})
    if name not in CHECKERS:
        raise PocketError(f"{where}: unknown checker {name!r}; known: {', '.join(CHECKERS)}")
    if not isinstance(args, dict):
        raise PocketError(f"{where}: {name} args must be an object, got {args!r}")
    fn = CHECKERS[name]
    try:
        inspect.signature(fn).bind("", **args)
    except TypeError as e:
        raise PocketError(f"{where}: {name} args {args!r}: {e}") from None
    hints = typing.get_type_hints(fn)
    for key, value in args.items():
        want = hints[key]
        if want is int:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        elif want is str:
            ok = isinstance(value, str) and value.strip() != ""
        else:  # list[str]
            ok = (isinstance(value, list) and value
                  and all(isinstance(v, str) and v.strip() for v in value))
        if not ok:
            raise PocketError(f"{where}: {name} argument {key}={value!r} must be a "
                              f"{'positive integer' if want is int else 'non-empty ' + str(want)}")


def run_instruction(response: str, instruction: dict) -> bool:
    """Whether ``response`` follows one instruction (an empty or blank response follows none:
    "at most N words" or "no commas" would hold for it, as IFEval also rules)."""
    if not response.strip():
        return False
    return bool(CHECKERS[instruction["check"]](response, **instruction.get("args", {})))


def loose_variants(response: str) -> list[str]:
    """The response as written, without its first line, without its last line, without both,
    and each of those with Markdown ``*`` removed (IFEval's loose setting: forgives a
    "Sure, here it is:" opener, a closing remark and emphasis marks). A variant left empty
    (a reply of one or two lines) follows no instruction (:func:`run_instruction`)."""
    lines = response.split("\n")
    cut = [response, "\n".join(lines[1:]), "\n".join(lines[:-1]), "\n".join(lines[1:-1])]
    return cut + [c.replace("*", "") for c in cut]


def check_response(output: str, example: dict) -> dict:
    """Score ``output`` against ``example["instructions"]``.

    Returns ``correct`` (every instruction passes: prompt-level strict), ``correct_loose``
    (every instruction passes on some :func:`loose_variants` of the output), ``prediction``
    (the output), ``passed`` and ``passed_loose`` (per instruction), ``instructions_passed``
    and ``instructions_total``.
    """
    instructions = example.get("instructions") if isinstance(example, dict) else None
    where = f"example {example.get('id', '?')}" if isinstance(example, dict) else "example"
    if not isinstance(instructions, list) or not instructions:
        raise PocketError(f"{where}: an instruction task example needs a non-empty "
                          "'instructions' list")
    for i, ins in enumerate(instructions):
        validate_instruction(ins, f"{where} instruction {i}")
    text = output if isinstance(output, str) else str(output)
    variants = loose_variants(text)
    passed = [run_instruction(text, ins) for ins in instructions]
    loose = [any(run_instruction(v, ins) for v in variants) for ins in instructions]
    return {"correct": all(passed), "correct_loose": all(loose), "prediction": text,
            "passed": passed, "passed_loose": loose, "instructions_passed": sum(passed),
            "instructions_total": len(passed)}


# -- prompts ------------------------------------------------------------------------------------


def _i(check: str, **args) -> dict:
    return {"check": check, "args": args}


_EN_REPEAT = "Give one tip for staying focused while working from home."
_ZH_REPEAT = "请给出一条早起的建议。"

# (prompt, instructions): the English prompts
_EN = [
    ("Summarise this message for a busy manager: \"The quarterly report is delayed because two "
     "suppliers sent invoices late. Finance expects to close the books by Friday, and the report "
     "will follow on Monday.\" Answer in at most 30 words.", [_i("words_at_most", n=30)]),
    ("Write a short note to a neighbour asking them to water your plants while you are away for "
     "a week. Use at least 60 words and end with the exact phrase \"Thank you so much!\"",
     [_i("words_at_least", n=60), _i("ends_with", phrase="Thank you so much!")]),
    ("List tips for saving battery on a phone. Give exactly 4 bullet points, each starting with "
     "\"- \".", [_i("bullets_exactly", n=4)]),
    ("Reply to this text from a friend: \"Are we still on for dinner tonight?\" Keep it to at most "
     "2 sentences and do not use any commas.",
     [_i("sentences_at_most", n=2), _i("no_commas")]),
    ("Classify the sentiment of this review as positive, negative or neutral: \"The delivery was "
     "fast but the box was damaged.\" Output JSON only, with the keys \"label\" and \"reason\".",
     [_i("json_keys", keys=["label", "reason"])]),
    ("Extract the date, time and place from: \"Team lunch moved to Thursday 12:30 at the Green "
     "Bowl on King Street.\" Output only a JSON object.", [_i("json_valid")]),
    ("Write a two-paragraph description of a reading app for an app store listing. Separate the "
     "paragraphs with a blank line and include the words \"offline\" and \"bookmarks\".",
     [_i("paragraphs_exactly", n=2), _i("keywords_include", keywords=["offline", "bookmarks"])]),
    ("Write a short product update announcing dark mode in a notes app, in at most 80 words. "
     "Your entire response must be in lowercase letters.", [_i("lowercase"), _i("words_at_most", n=80)]),
    ("Write a one-line warning that a password will expire tomorrow. Write it in all capital "
     "letters, in at most two sentences.", [_i("uppercase"), _i("sentences_at_most", n=2)]),
    ("Write a reminder to drink water during the day. Wrap your entire response in double "
     "quotation marks.", [_i("quoted")]),
    ("Write a short poem about a morning commute. Give it a title wrapped in double angular "
     "brackets, such as <<title>>, and keep it under 100 words.", [_i("title"), _i("words_at_most", n=99)]),
    ("Write a template for a meeting invitation email. Use at least 3 placeholders in square "
     "brackets, such as [name] or [date].", [_i("placeholders_at_least", n=3)]),
    ("Describe what a to-do list app does in at most three sentences. Answer in English only.",
     [_i("language_en"), _i("sentences_at_most", n=3)]),
    ("Write a thank-you message to a colleague who covered your shift. At the end, add a "
     "postscript starting with \"P.S.\"", [_i("postscript", marker="P.S.")]),
    ("Explain how to back up photos from a phone. Highlight at least 2 sections with markdown, "
     "for example *important step*.", [_i("highlights_at_least", n=2)]),
    ("First repeat the request word for word without change, then give your answer (do not say "
     "anything before repeating the request). Request: " + _EN_REPEAT,
     [_i("repeat_request", request=_EN_REPEAT)]),
    ("Write a short ad for a weekend farmers' market. Use the word \"fresh\" at least 3 times.",
     [_i("keyword_frequency_at_least", keyword="fresh", n=3)]),
    ("Describe a rainy day in a city in at least 20 words, without using the words \"rain\" "
     "or \"wet\".",
     [_i("words_exclude", words=["rain", "wet"]), _i("words_at_least", n=20)]),
    ("Start your answer with \"Good morning\". Write a greeting for the daily team chat that "
     "mentions the weekly goals.", [_i("starts_with", phrase="Good morning")]),
    ("Give three reasons to use a password manager. Use exactly 3 bullet points starting with "
     "\"- \" and keep the whole answer under 60 words.",
     [_i("bullets_exactly", n=3), _i("words_at_most", n=59)]),
    ("Summarise the benefits of walking 30 minutes a day. Answer in at least 4 sentences.",
     [_i("sentences_at_least", n=4)]),
    ("Reply to a customer who asks when their refund will arrive. Include the keywords "
     "\"refund\" and \"business days\", and end with \"Is there anything else I can help "
     "with?\"", [_i("keywords_include", keywords=["refund", "business days"]),
                 _i("ends_with", phrase="Is there anything else I can help with?")]),
    ("Turn this into a JSON object with the keys \"item\", \"quantity\" and \"unit\": "
     "\"two litres of milk\". Output nothing but the JSON.",
     [_i("json_keys", keys=["item", "quantity", "unit"])]),
    ("Write a short bio for a music app profile of a jazz pianist. Use at most 40 words and no "
     "commas.", [_i("words_at_most", n=40), _i("no_commas")]),
    ("Write exactly three paragraphs, separated by blank lines, about how to prepare for a job "
     "interview.", [_i("paragraphs_exactly", n=3)]),
    ("Write a short message telling a team that the office is closed on Monday. Answer in "
     "lowercase only and add a postscript starting with \"P.S.\"",
     [_i("lowercase"), _i("postscript", marker="P.S.")]),
    ("Give a one-sentence definition of a budget. Wrap the whole answer in double quotes.",
     [_i("quoted"), _i("sentences_at_most", n=1)]),
    ("List 5 healthy snacks for work. Use exactly 5 bullet points, each starting with \"* \".",
     [_i("bullets_exactly", n=5)]),
    ("Write a short story of at least 80 words about a lost umbrella. Give it a title in double "
     "angular brackets, like <<The Umbrella>>.", [_i("words_at_least", n=80), _i("title")]),
    ("Classify this message as spam or not spam: \"You have won a free cruise, click here!\" "
     "Answer with a JSON object with the keys \"label\" and \"confidence\".",
     [_i("json_keys", keys=["label", "confidence"])]),
    ("Write a notification text for a food delivery app telling the user the order is on its "
     "way. Use at most 20 words and include the word \"minutes\".",
     [_i("words_at_most", n=20), _i("keywords_include", keywords=["minutes"])]),
    ("Explain what a cookie is on a website to a child. Do not use the words \"data\" or "
     "\"tracking\", and answer in at most 3 sentences.",
     [_i("words_exclude", words=["data", "tracking"]), _i("sentences_at_most", n=3)]),
    ("Write a fill-in-the-blanks address label with placeholders in square brackets for the "
     "name, street, city and postcode.", [_i("placeholders_at_least", n=4)]),
    ("Write tips for a first-time visitor to a gym. Highlight at least 3 key words with "
     "asterisks, like *warm up*, and use the word \"safety\" at least twice.",
     [_i("highlights_at_least", n=3), _i("keyword_frequency_at_least", keyword="safety", n=2)]),
    ("Write a headline for a news app about a new city park. Use all capital letters and at "
     "most 12 words.", [_i("uppercase"), _i("words_at_most", n=12)]),
    ("Answer in English: what should I pack for a two-day hiking trip? Use exactly 4 bullet "
     "points starting with \"- \".", [_i("language_en"), _i("bullets_exactly", n=4)]),
    ("Write a polite reply declining a meeting invitation. Start with \"Thank you for the "
     "invitation\" and keep it to at most 50 words.",
     [_i("starts_with", phrase="Thank you for the invitation"), _i("words_at_most", n=50)]),
    ("Describe the features of a calendar app in at least 100 words.",
     [_i("words_at_least", n=100)]),
    ("Rewrite this sentence to be more formal: \"hey, can u send me the file asap?\" Wrap your "
     "answer in double quotation marks and do not use commas.", [_i("quoted"), _i("no_commas")]),
    ("Write a weekly meal plan overview in two paragraphs separated by a blank line. Include "
     "the word \"vegetables\" and end with \"Enjoy your week!\"",
     [_i("paragraphs_exactly", n=2), _i("keywords_include", keywords=["vegetables"]),
      _i("ends_with", phrase="Enjoy your week!")]),
]

# (prompt, instructions): the Chinese prompts
_ZH = [
    ("请概括下面这段话：“由于两家供应商延迟开票，季度报告将推迟发布。财务部预计周五完成结账，报告将在下周一发出。”"
     "用中文回答，不超过30个字。", [_i("chars_zh_at_most", n=30), _i("language_zh")]),
    ("帮我写一张便条，请邻居在我出差的一周里帮忙浇花。用中文写，不少于80个字。", [_i("chars_zh_at_least", n=80),
                                             _i("language_zh")]),
    ("给出手机省电的建议。用三个要点回答，每个要点以“- ”开头。", [_i("bullets_exactly", n=3)]),
    ("朋友发来消息：“今晚还一起吃饭吗？”请帮我回复，不超过两句话，并且不要使用逗号。",
     [_i("sentences_at_most", n=2), _i("no_commas")]),
    ("判断这条评论的情感是正面、负面还是中性：“快递很快，但是盒子压坏了。”只输出JSON，包含“label”和“reason”两个键。",
     [_i("json_keys", keys=["label", "reason"])]),
    ("从这句话中提取日期、时间和地点：“部门聚餐改到周四中午12点半，在人民路的绿碗餐厅。”只输出JSON。",
     [_i("json_valid")]),
    ("为一款读书App写应用商店介绍，分两段，段与段之间空一行，并且要提到“离线”和“书签”。",
     [_i("paragraphs_exactly", n=2), _i("keywords_include", keywords=["离线", "书签"])]),
    ("用中文介绍一下番茄工作法，不超过100个字。", [_i("language_zh"), _i("chars_zh_at_most", n=100)]),
    ("写一句提醒大家多喝水的话，整个回答用双引号括起来。", [_i("quoted")]),
    ("写一首关于早高峰地铁的小诗，并加一个标题，标题用双尖括号括起来，例如<<标题>>。请用中文写。",
     [_i("title"), _i("language_zh")]),
    ("写一份会议邀请邮件的模板，至少包含3个用方括号表示的占位符，比如[姓名]、[日期]。",
     [_i("placeholders_at_least", n=3)]),
    ("给帮我代班的同事写一段感谢的话，最后加一句以“附言：”开头的附言。全文用中文。",
     [_i("postscript", marker="附言"), _i("language_zh")]),
    ("说明如何备份手机里的照片，至少用星号标出两处重点，例如*重要步骤*。", [_i("highlights_at_least", n=2)]),
    ("先一字不差地重复下面的请求，再给出你的回答（重复之前不要说别的话）。请求：" + _ZH_REPEAT,
     [_i("repeat_request", request=_ZH_REPEAT)]),
    ("为周末的农贸市场写一段广告语，“新鲜”这个词至少出现3次。",
     [_i("keyword_frequency_at_least", keyword="新鲜", n=3)]),
    ("描写一下城市里的阴天，不要出现“雨”和“湿”这两个字，不少于30个字。",
     [_i("words_exclude", words=["雨", "湿"]), _i("chars_zh_at_least", n=30)]),
    ("以“大家早上好”开头，写一段团队群里的早安问候，提到本周目标。", [_i("starts_with", phrase="大家早上好")]),
    ("列出使用密码管理器的三个理由。用三个要点回答，每个要点以“- ”开头，总共不超过60个字。",
     [_i("bullets_exactly", n=3), _i("chars_zh_at_most", n=60)]),
    ("总结每天步行30分钟的好处，用中文回答，至少写4句话。", [_i("sentences_at_least", n=4), _i("language_zh")]),
    ("顾客问退款什么时候到账，请帮客服写一段回复，要包含“退款”和“工作日”，并以“还有什么可以帮您的吗？”结尾。",
     [_i("keywords_include", keywords=["退款", "工作日"]), _i("ends_with", phrase="还有什么可以帮您的吗？")]),
    ("把“两升牛奶”转换成JSON对象，包含“item”、“quantity”和“unit”三个键。只输出JSON。",
     [_i("json_keys", keys=["item", "quantity", "unit"])]),
    ("为音乐App写一段爵士钢琴家的简介，不超过50个字，不要使用逗号。",
     [_i("chars_zh_at_most", n=50), _i("no_commas")]),
    ("用中文写三段话介绍如何准备求职面试，段与段之间空一行。", [_i("paragraphs_exactly", n=3), _i("language_zh")]),
    ("用一句话解释什么是预算，整个回答用双引号括起来。", [_i("quoted"), _i("sentences_at_most", n=1)]),
    ("推荐5种适合上班吃的健康零食，用五个要点回答，每个要点以“* ”开头。", [_i("bullets_exactly", n=5)]),
    ("写一个关于丢失雨伞的小故事，不少于150个字，并用双尖括号给故事加标题，例如<<雨伞>>。",
     [_i("chars_zh_at_least", n=150), _i("title")]),
    ("判断这条短信是不是垃圾短信：“恭喜您获得免费邮轮旅行，点击链接领取！”用JSON回答，包含“label”和“confidence”两个键。",
     [_i("json_keys", keys=["label", "confidence"])]),
    ("为外卖App写一条通知，告诉用户订单正在配送中。不超过25个字，并包含“分钟”。",
     [_i("chars_zh_at_most", n=25), _i("keywords_include", keywords=["分钟"])]),
    ("给小朋友解释网站上的Cookie是什么，不要出现“数据”和“追踪”，最多三句话。",
     [_i("words_exclude", words=["数据", "追踪"]), _i("sentences_at_most", n=3)]),
    ("写一个快递地址标签模板，用方括号占位符表示收件人、电话、城市和详细地址。", [_i("placeholders_at_least", n=4)]),
    ("给第一次去健身房的人一些建议，用星号标出至少三处重点，比如*热身*，并且“安全”至少出现两次。",
     [_i("highlights_at_least", n=3), _i("keyword_frequency_at_least", keyword="安全", n=2)]),
    ("请用中文回答：两天的徒步旅行应该带些什么？用四个要点回答，每个要点以“- ”开头。",
     [_i("language_zh"), _i("bullets_exactly", n=4)]),
    ("帮我礼貌地回绝一个会议邀请，以“感谢您的邀请”开头，不超过60个字。",
     [_i("starts_with", phrase="感谢您的邀请"), _i("chars_zh_at_most", n=60)]),
    ("用中文介绍一款日历App的主要功能，不少于150个字。", [_i("chars_zh_at_least", n=150), _i("language_zh")]),
    ("把这句话改得更正式一些：“哎，那个文件你赶紧发我一下呗。”整个回答用双引号括起来。", [_i("quoted")]),
    ("分两段写一份一周饮食计划概述，段与段之间空一行，要提到“蔬菜”，并以“祝你这周吃得开心！”结尾。",
     [_i("paragraphs_exactly", n=2), _i("keywords_include", keywords=["蔬菜"]),
      _i("ends_with", phrase="祝你这周吃得开心！")]),
    ("推荐三个提高睡眠质量的方法，只用中文回答，不超过120个字。",
     [_i("language_zh"), _i("chars_zh_at_most", n=120)]),
    ("把下面的英文句子翻译成中文：“The meeting starts at nine.” 只输出译文，不超过20个字。",
     [_i("language_zh"), _i("chars_zh_at_most", n=20)]),
    ("用英文写一句欢迎新用户的话，不超过40个单词，不要出现中文。", [_i("language_en"), _i("words_at_most", n=40)]),
    ("写一段给租客的停水通知，最后加上以“P.S.”开头的补充说明，全文不超过100个字。",
     [_i("postscript", marker="P.S."), _i("chars_zh_at_most", n=100)]),
]

_EN_REPEAT_2 = "Suggest one way to make a small kitchen feel bigger."
_ZH_REPEAT_2 = "请推荐一个适合周末的家庭活动。"

# (prompt, instructions): English prompts added in version 5 (the second half)
_EN_MORE = [
    ("Summarise this update for a team chat: \"The app release is moved from Tuesday to "
     "Thursday because the payment screen failed testing. QA will retest on Wednesday.\" Use at "
     "most 25 words.", [_i("words_at_most", n=25)]),
    ("Write a welcome message for new members of a running club. Use at least 50 words and "
     "include the words \"pace\" and \"route\".",
     [_i("words_at_least", n=50), _i("keywords_include", keywords=["pace", "route"])]),
    ("Give tips for keeping houseplants alive. Use exactly 3 bullet points, each starting with "
     "\"- \".", [_i("bullets_exactly", n=3)]),
    ("Reply to a coworker who asks \"Can you review my slides before noon?\" in at most two "
     "sentences.", [_i("sentences_at_most", n=2)]),
    ("Extract the product and the price from: \"The blue backpack is on sale for 35 dollars "
     "until Sunday.\" Output JSON only, with the keys \"product\" and \"price\".",
     [_i("json_keys", keys=["product", "price"])]),
    ("List the ingredients of a simple pancake recipe as a JSON array of strings. Output nothing "
     "else.", [_i("json_valid")]),
    ("Describe a podcast app in two paragraphs separated by a blank line. Mention \"playlists\" "
     "in the first one.", [_i("paragraphs_exactly", n=2),
                           _i("keywords_include", keywords=["playlists"])]),
    ("Write a short tweet about a library's new opening hours. Use only lowercase letters and "
     "no commas.", [_i("lowercase"), _i("no_commas")]),
    ("Write a one-line alert that a storm is coming tonight, in capital letters only.",
     [_i("uppercase")]),
    ("Give a motivational quote for students before exams. Wrap the whole answer in double "
     "quotation marks and keep it to one sentence.", [_i("quoted"), _i("sentences_at_most", n=1)]),
    ("Write a limerick about a cat who loves boxes. Give it a title in double angular brackets, "
     "like <<Title>>.", [_i("title")]),
    ("Write a text message template to confirm a dentist appointment, with at least 2 "
     "placeholders in square brackets such as [time].", [_i("placeholders_at_least", n=2)]),
    ("Explain what a VPN is in English, in at least 3 sentences.",
     [_i("language_en"), _i("sentences_at_least", n=3)]),
    ("Write a note to a friend returning a borrowed book. End with a postscript starting with "
     "\"P.S.\" and keep the note under 70 words.",
     [_i("postscript", marker="P.S."), _i("words_at_most", n=69)]),
    ("Explain how to change a flat bicycle tyre. Highlight at least 3 steps with markdown, for "
     "example *remove the wheel*.", [_i("highlights_at_least", n=3)]),
    ("First repeat the request word for word without change, then give your answer (do not say "
     "anything before repeating the request). Request: " + _EN_REPEAT_2,
     [_i("repeat_request", request=_EN_REPEAT_2)]),
    ("Write a short slogan list for a recycling campaign. Use the word \"green\" at least 3 "
     "times.", [_i("keyword_frequency_at_least", keyword="green", n=3)]),
    ("Describe a summer evening at the beach without using the words \"sun\" or \"hot\". Use at "
     "least 30 words.", [_i("words_exclude", words=["sun", "hot"]), _i("words_at_least", n=30)]),
    ("Start your reply with \"Hi everyone\". Announce that the team lunch is on Friday.",
     [_i("starts_with", phrase="Hi everyone")]),
    ("End your answer with the exact sentence \"See you there!\" Invite a friend to a board "
     "game night in at most 40 words.",
     [_i("ends_with", phrase="See you there!"), _i("words_at_most", n=40)]),
    ("Give exactly 4 bullet points, each starting with \"* \", with ideas for a rainy-day "
     "activity at home. Keep the answer under 50 words.",
     [_i("bullets_exactly", n=4), _i("words_at_most", n=49)]),
    ("Write three paragraphs, separated by blank lines, about why sleep matters for teenagers.",
     [_i("paragraphs_exactly", n=3)]),
    ("Describe a smart watch for an online shop in at least 80 words, and include the words "
     "\"battery\" and \"waterproof\".",
     [_i("words_at_least", n=80), _i("keywords_include", keywords=["battery", "waterproof"])]),
    ("Answer the question \"Why is the sky blue?\" in at most 2 sentences and without commas.",
     [_i("sentences_at_most", n=2), _i("no_commas")]),
    ("Convert this to a JSON object with the keys \"city\", \"temperature\" and \"condition\": "
     "\"Paris, 18 degrees, cloudy\". Output only the JSON.",
     [_i("json_keys", keys=["city", "temperature", "condition"])]),
    ("Write a product review of a coffee maker in all lowercase letters, in at least 40 words.",
     [_i("lowercase"), _i("words_at_least", n=40)]),
    ("Write a sign for a shared office fridge reminding people to label their food. Use capital "
     "letters only and at most 15 words.", [_i("uppercase"), _i("words_at_most", n=15)]),
    ("Rewrite \"The meeting got cancelled\" as a polite announcement. Wrap your answer in double "
     "quotation marks.", [_i("quoted")]),
    ("Write a haiku about autumn leaves with a title in double angular brackets, and do not use "
     "the word \"red\".", [_i("title"), _i("words_exclude", words=["red"])]),
    ("Write a form letter for a school absence note, with placeholders in square brackets for "
     "the student's name, the date and the reason.", [_i("placeholders_at_least", n=3)]),
    ("Write a welcome message for a language learning app. Answer in English only and use at "
     "most 3 sentences.", [_i("language_en"), _i("sentences_at_most", n=3)]),
    ("Write a message thanking a teacher at the end of the year. Add a postscript starting with "
     "\"P.S.\" and use the word \"grateful\".",
     [_i("postscript", marker="P.S."), _i("keywords_include", keywords=["grateful"])]),
    ("Give advice on saving money on groceries. Highlight at least 2 key phrases with "
     "asterisks, such as *make a list*, and use at most 80 words.",
     [_i("highlights_at_least", n=2), _i("words_at_most", n=80)]),
    ("Write a short description of a bakery for a maps app. Use the word \"bread\" at least "
     "twice and keep it under 60 words.",
     [_i("keyword_frequency_at_least", keyword="bread", n=2), _i("words_at_most", n=59)]),
    ("Explain what a password is to a child without using the words \"secret\" or \"hacker\".",
     [_i("words_exclude", words=["secret", "hacker"])]),
    ("Begin with \"Dear customer\". Write a short apology for a delayed parcel in at most 60 "
     "words.", [_i("starts_with", phrase="Dear customer"), _i("words_at_most", n=60)]),
    ("Write a short story about a robot learning to cook. Use at least 100 words and end with "
     "the exact sentence \"Dinner was served.\"",
     [_i("words_at_least", n=100), _i("ends_with", phrase="Dinner was served.")]),
    ("Label the topic of this headline as sports, politics or technology: \"New phone chip "
     "doubles battery life\". Reply with a JSON object with the keys \"topic\" and \"reason\".",
     [_i("json_keys", keys=["topic", "reason"])]),
    ("Give a short answer to \"What is a good bedtime for a ten-year-old?\" in at least 2 "
     "sentences, without using any commas.",
     [_i("sentences_at_least", n=2), _i("no_commas")]),
    ("List 3 packing tips for a flight as bullet points starting with \"- \", and add a "
     "postscript starting with \"P.S.\" at the end.",
     [_i("bullets_exactly", n=3), _i("postscript", marker="P.S.")]),
]

# (prompt, instructions): Chinese prompts added in version 5
_ZH_MORE = [
    ("请概括这条通知：“因为支付页面测试没有通过，App的发布从周二改到周四，测试组周三会再测一次。”用中文回答，不超过25个字。",
     [_i("chars_zh_at_most", n=25), _i("language_zh")]),
    ("为跑步俱乐部写一段欢迎新会员的话，不少于60个字，要提到“配速”和“路线”。",
     [_i("chars_zh_at_least", n=60), _i("keywords_include", keywords=["配速", "路线"])]),
    ("给出养好绿植的建议，用三个要点回答，每个要点以“- ”开头。", [_i("bullets_exactly", n=3)]),
    ("同事问：“中午之前能帮我看一下PPT吗？”帮我回复，不超过两句话。", [_i("sentences_at_most", n=2)]),
    ("从这句话中提取商品和价格：“蓝色双肩包周日前特价35元。”只输出JSON，包含“product”和“price”两个键。",
     [_i("json_keys", keys=["product", "price"])]),
    ("把做简单煎饼需要的材料列成一个JSON字符串数组，不要输出别的内容。", [_i("json_valid")]),
    ("分两段介绍一款播客App，段与段之间空一行，要提到“播放列表”。",
     [_i("paragraphs_exactly", n=2), _i("keywords_include", keywords=["播放列表"])]),
    ("写一条关于图书馆调整开放时间的微博，不要使用逗号，不超过50个字。",
     [_i("no_commas"), _i("chars_zh_at_most", n=50)]),
    ("用中文写一条今晚有暴雨的提醒，整个回答用双引号括起来。", [_i("quoted"), _i("language_zh")]),
    ("给考前的学生写一句鼓励的话，只写一句，用中文。", [_i("sentences_at_most", n=1), _i("language_zh")]),
    ("写一首关于猫咪爱钻纸箱的小诗，用双尖括号加一个标题，例如<<标题>>。", [_i("title")]),
    ("写一条确认牙医预约的短信模板，至少包含2个用方括号表示的占位符，比如[时间]。",
     [_i("placeholders_at_least", n=2)]),
    ("用中文解释什么是VPN，至少写3句话。", [_i("language_zh"), _i("sentences_at_least", n=3)]),
    ("给朋友写一张还书的便条，最后加一句以“附言：”开头的附言，全文不超过70个字。",
     [_i("postscript", marker="附言"), _i("chars_zh_at_most", n=70)]),
    ("说明如何给自行车补胎，至少用星号标出三个步骤，例如*拆下车轮*。", [_i("highlights_at_least", n=3)]),
    ("先一字不差地重复下面的请求，再给出你的回答（重复之前不要说别的话）。请求：" + _ZH_REPEAT_2,
     [_i("repeat_request", request=_ZH_REPEAT_2)]),
    ("为垃圾分类宣传写几句口号，“环保”这个词至少出现3次。",
     [_i("keyword_frequency_at_least", keyword="环保", n=3)]),
    ("描写夏天傍晚的海边，不要出现“热”和“太阳”，不少于40个字。",
     [_i("words_exclude", words=["热", "太阳"]), _i("chars_zh_at_least", n=40)]),
    ("以“大家好”开头，通知团队周五中午一起聚餐。", [_i("starts_with", phrase="大家好")]),
    ("邀请朋友来玩桌游，最后一句必须是“不见不散！”，全文不超过40个字。",
     [_i("ends_with", phrase="不见不散！"), _i("chars_zh_at_most", n=40)]),
    ("用四个要点列出下雨天在家可以做的事，每个要点以“* ”开头，总共不超过50个字。",
     [_i("bullets_exactly", n=4), _i("chars_zh_at_most", n=50)]),
    ("用中文写三段话说明睡眠对青少年的重要性，段与段之间空一行。",
     [_i("paragraphs_exactly", n=3), _i("language_zh")]),
    ("为网店写一段智能手表的介绍，不少于100个字，要提到“续航”和“防水”。",
     [_i("chars_zh_at_least", n=100), _i("keywords_include", keywords=["续航", "防水"])]),
    ("回答“天空为什么是蓝色的？”，不超过两句话，不要使用逗号。",
     [_i("sentences_at_most", n=2), _i("no_commas")]),
    ("把“北京，18度，多云”转换成JSON对象，包含“city”、“temperature”和“condition”三个键。只输出JSON。",
     [_i("json_keys", keys=["city", "temperature", "condition"])]),
    ("写一段咖啡机的使用评价，用中文写，不少于60个字。", [_i("language_zh"), _i("chars_zh_at_least", n=60)]),
    ("为办公室公用冰箱写一张提示，提醒大家给食物贴上名字，不超过20个字。", [_i("chars_zh_at_most", n=20)]),
    ("把“会议取消了”改写成一条礼貌的通知，整个回答用双引号括起来。", [_i("quoted")]),
    ("写一首关于秋天落叶的短诗，用双尖括号加标题，不要出现“红”字。",
     [_i("title"), _i("words_exclude", words=["红"])]),
    ("写一份学生请假条模板，用方括号占位符表示学生姓名、日期和请假原因。", [_i("placeholders_at_least", n=3)]),
    ("为一款语言学习App写一段欢迎语，只用中文，最多三句话。", [_i("language_zh"), _i("sentences_at_most", n=3)]),
    ("写一段期末感谢老师的话，要出现“感激”，最后加一句以“附言：”开头的附言。",
     [_i("keywords_include", keywords=["感激"]), _i("postscript", marker="附言")]),
    ("给出买菜省钱的建议，用星号标出至少两处重点，比如*列清单*，不超过100个字。",
     [_i("highlights_at_least", n=2), _i("chars_zh_at_most", n=100)]),
    ("为地图App写一段面包店的简介，“面包”至少出现两次，不超过60个字。",
     [_i("keyword_frequency_at_least", keyword="面包", n=2), _i("chars_zh_at_most", n=60)]),
    ("给小朋友解释什么是密码，不要出现“秘密”和“黑客”。", [_i("words_exclude", words=["秘密", "黑客"])]),
    ("以“尊敬的顾客”开头，为包裹延误写一段简短的道歉，不超过60个字。",
     [_i("starts_with", phrase="尊敬的顾客"), _i("chars_zh_at_most", n=60)]),
    ("写一个机器人学做饭的小故事，不少于120个字，最后一句必须是“晚饭做好了。”",
     [_i("chars_zh_at_least", n=120), _i("ends_with", phrase="晚饭做好了。")]),
    ("判断这条新闻标题属于体育、政治还是科技：“新款手机芯片让续航翻倍”。用JSON回答，包含“topic”和“reason”两个键。",
     [_i("json_keys", keys=["topic", "reason"])]),
    ("回答“十岁孩子几点睡觉比较好？”，至少两句话，不要使用逗号。",
     [_i("sentences_at_least", n=2), _i("no_commas")]),
    ("用三个要点列出坐飞机的打包建议，每个要点以“- ”开头，最后加一句以“附言：”开头的附言。",
     [_i("bullets_exactly", n=3), _i("postscript", marker="附言")]),
]


def _examples() -> list[dict]:
    out = []
    for lang, items in (("en", _EN + _EN_MORE), ("zh", _ZH + _ZH_MORE)):
        for no, (prompt, instructions) in enumerate(items, 1):
            out.append({"id": f"{lang}-{no:03d}", "lang": lang, "prompt": prompt,
                        "instructions": instructions, "answer": "pass"})
    return out


PROMPTS: list[dict] = _examples()


def build_instructions() -> tuple[dict, list[dict]]:
    """The ``ifeval-pocket`` task: its header and a fresh copy of :data:`PROMPTS`.

    The prompts are chat turns; a reply ends at the model's end-of-turn token, so no stop
    strings are set (a blank line inside a reply is legitimate: paragraphs).
    """
    header = {
        "name": "ifeval-pocket", "type": "generation", "check": "instructions", "chat": True,
        "template": "{prompt}", "max_tokens": 320, "stop": [],
        "description": "verifiable instructions in the manner of IFEval, en + zh, written for "
                       "pocketlm",
        "source": {"package": "pocketlm", "version": INSTRUCTIONS_VERSION,
                   "license": "Apache-2.0 (this project)",
                   "note": "prompts and checkers written for pocketlm after the method of "
                           "IFEval (Zhou et al. 2023, arXiv:2311.07911); correct = every "
                           "instruction passes (prompt-level strict), correct_loose = IFEval's "
                           "loose variants"}}
    return header, copy.deepcopy(PROMPTS)
