"""The instruction-following task: every checker on a passing and a failing response (English
and Chinese where the language matters), the prompts' structure and instructions, and
check_response's strict and loose scores on hand-written replies."""

from __future__ import annotations

import json

import pytest

from pocketlm.errors import PocketError
from pocketlm.evaluate import instructions as ins
from pocketlm.evaluate.instructions import (
    CHECKERS,
    INSTRUCTIONS_VERSION,
    PROMPTS,
    build_instructions,
    check_response,
    count_sentences,
    count_words,
    count_zh_chars,
    loose_variants,
    validate_instruction,
)

# checker id -> (args, passing responses, failing responses)
CASES = {
    "words_at_most": ({"n": 5}, ["Fast delivery, broken box.", "don't well-known 2024 ok"],
                      ["one two three four five six", "a b c d e f g"]),
    "words_at_least": ({"n": 3}, ["one two three", "It's a well-known app."],
                       ["one two", "three-in-one, ok"]),
    "chars_zh_at_most": ({"n": 6}, ["用App记账2次", "你好，世界！"], ["今天天气非常好啊", "用App记账2次了"]),
    "chars_zh_at_least": ({"n": 5}, ["今天天气好", "用App记账了"], ["你好世界", "好 ok！"]),
    "sentences_at_most": ({"n": 2}, ["Hi there. See you soon!", "好的。明天见！",
                                     # no end at an abbreviation, an initial, or an ellipsis
                                     # before a lowercase word (as IFEval's splitter reads)
                                     "Yes we are! See you at 7 p.m. tonight.",
                                     "Mr. Cookie is a note. It helps J. Smith.",
                                     "Yes... see you tonight. Can't wait!"],
                          ["One. Two. Three.", "好的。明天见！再见。", "", "..."]),
    "sentences_at_least": ({"n": 3}, ["One. Two. Three", "好的。明天见！再见。",
                                      "Wait... What? Yes."],
                           ["One. Two.", "你好。再见", "Dr. Who. Fine."]),
    "bullets_exactly": ({"n": 2}, ["Tips:\n- charge less\n- dim the screen",
                                   "* 少用蓝牙\n  *  降低亮度\n---",
                                   # horizontal rules are no bullets
                                   "- one\n* * *\n- two\n- - -\n***\n  _ _ _  \n",
                                   "* one\n\n *  *  * \r\n* two"],
                        ["- one\n- two\n- three", "-one\n-two", "1. one\n2. two", "**a**\n**b**",
                         "* * *\n- one", "- one\n- - -", "- - -\n* * *\n- - - -"]),
    "paragraphs_exactly": ({"n": 2}, ["First part.\n\nSecond part.", "第一段。\n \n第二段。\n"],
                           ["One paragraph\nstill one.", "a\n\nb\n\nc"]),
    "keywords_include": ({"keywords": ["offline", "书签"]},
                         ["Works OFFLINE, with 书签.", "书签 and offline"],
                         ["Works offline.", "offlines 书签"]),
    "words_exclude": ({"words": ["rain", "湿"]}, ["Grey skies and training.", "天很阴。"],
                      ["Heavy Rain today.", "地面很湿。"]),
    "keyword_frequency_at_least": ({"keyword": "fresh", "n": 2},
                                   ["Fresh bread, fresh fruit.", "FRESH and fresh"],
                                   ["Fresh bread, refreshing fruit.", "freshly fresh"]),
    "json_valid": ({}, ['{"a": 1}', '```json\n[1, 2]\n```', '  ```\n{"a": 1}```  ',
                        '```json {"a": 1} ```', '```json\r\n{"a": 1}\r\n```'],
                   ['Here: {"a": 1}', '42', '```json\n{"a": 1}\n```\nDone.', "{a: 1}"]),
    "json_keys": ({"keys": ["label", "reason"]},
                  ['{"label": "neg", "reason": "box", "x": 1}',
                   '```JSON\n{"label": "负面", "reason": "盒子坏了"}\n```'],
                  ['{"label": "neg"}', '[{"label": 1, "reason": 2}]', "label: neg"]),
    "starts_with": ({"phrase": "Good morning"}, ["  good  morning, team!", "Good morning"],
                    ["Hello. Good morning", "Good"]),
    "ends_with": ({"phrase": "Thank you so much!"}, ["See you.\nThank you so much!  \n",
                                                     '"See you. Thank you so much!"'],
                  ["Thank you so much! Bye.", "Thank you so much"]),
    "lowercase": ({}, ["dark mode is here.", "版本 2 now ready"], ["Dark mode is here.", "123 版本"]),
    "uppercase": ({}, ["PASSWORD EXPIRES TOMORROW!", "注意 WARNING"], ["Password expires", "123"]),
    "no_commas": ({}, ["Yes see you at 7.", "好的、明天见。"], ["Yes, see you.", "好的，明天见。"]),
    "quoted": ({}, ['"Drink water."', ' “多喝水。” \n'], ['Drink "water".', '"', '"Drink water.']),
    "title": ({}, ["<<Morning Train>>\nGrey light...", "<<早高峰>>"],
                  ["Morning Train", "<< >>", "<<a\nb>>"]),
    "placeholders_at_least": ({"n": 2}, ["Dear [name], on [date].", "[姓名]于[日期]"],
                              ["Dear [name],", "Dear [ ] and []"]),
    "language_zh": ({}, ["你好，我用App记账。", "多喝水",
                         "日历App支持iCloud、Google和Outlook同步。",
                         "番茄工作法（Pomodoro Technique）由Francesco Cirillo提出。"],
                    ["Hello there my friend, 你好", "123", "Drink water", "Apple Google Microsoft 很好"]),
    "language_en": ({}, ["Welcome to the app!", "Café time"], ["欢迎使用", "Привет мир", "Welcome 欢迎", "!!!"]),
    "postscript": ({"marker": "P.S."}, ["Thanks!\n\np.s. lunch is on me", "Hi\n  P.S. bye",
                                        "Thanks!\n\n**P.S.** Coffee is on me", "Hi\n- P.S. bye"],
                   ["Thanks! P.S. lunch", "Thanks!\nP.S.", "Thanks!\nPS lunch",
                    "Thanks!\n**P.S.**"]),
    "postscript_zh": ({"marker": "附言"}, ["谢谢！\n附言：午饭我请。", "谢谢\n附言:明天见"], ["谢谢！附言：午饭", "谢谢\n附言："]),
    "highlights_at_least": ({"n": 2}, ["*Open* settings, then **Backup**.", "先*打开*再*备份*"],
                            ["* Open settings\n* Backup", "*Open* only", "** **"]),
    "repeat_request": ({"request": "Give one tip."}, ["Give one tip.\nDrink water.",
                                                       "give  one tip. Sleep early."],
                       ["Give one tip.", "Sure! Give one tip. Sleep."]),
}


def test_every_checker_has_cases():
    assert {name.removesuffix("_zh") if name == "postscript_zh" else name
            for name in CASES} == set(CHECKERS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_checker_pass_and_fail(name):
    args, good, bad = CASES[name]
    check = "postscript" if name == "postscript_zh" else name
    validate_instruction({"check": check, "args": args})
    for response in good:
        assert CHECKERS[check](response, **args) is True, (name, response)
    for response in bad:
        assert CHECKERS[check](response, **args) is False, (name, response)


def test_checkers_have_docstrings():
    for name, fn in CHECKERS.items():
        assert fn.__doc__ and fn.__doc__.strip(), name


def test_counting_rules():
    assert count_words("Don't over-think it: 3 apps, 2024!") == 6
    assert count_words("你好 world") == 1
    assert count_zh_chars("用App记账2次。") == 6
    assert count_zh_chars("Hello world") == 2
    assert count_sentences("It costs 3.5 dollars. Really?") == 2
    assert count_sentences("他说：“好的。”然后走了。") == 2
    # abbreviations as written: "no." and "fig." are words that end sentences too
    assert count_sentences("The short answer is no. Eat something small. It helps.") == 3
    assert count_sentences("I ate a fig. It was sweet.") == 2
    assert count_sentences("Dr. Who. Ph.D. holder. Fine.") == 3
    assert ins.ZH_MIN_CJK_SHARE == 0.5 and ins.EN_MIN_LATIN_SHARE == 0.95


def test_language_thresholds():
    # 8 ideographs against one run of ASCII letters
    assert ins.language_zh("请用JSON格式输出结果")
    # 2 ideographs against 3 runs of ASCII letters
    assert not ins.language_zh("JSON格式 output here")
    assert not ins.language_en("This is fine 好")  # 10 ASCII, 1 CJK: 0.909 < 0.95


@pytest.mark.parametrize("bad", [
    {"check": "nope", "args": {}},
    {"check": "words_at_most", "args": {}},
    {"check": "words_at_most", "args": {"n": 0}},
    {"check": "words_at_most", "args": {"n": True}},
    {"check": "words_at_most", "args": {"n": "5"}},
    {"check": "words_at_most", "args": {"n": 5, "extra": 1}},
    {"check": "keywords_include", "args": {"keywords": []}},
    {"check": "keywords_include", "args": {"keywords": "offline"}},
    {"check": "starts_with", "args": {"phrase": " "}},
    {"check": "lowercase", "args": [], },
    {"check": "lowercase", "args": {}, "why": "x"},
    "lowercase",
])
def test_validate_instruction_refuses(bad):
    with pytest.raises(PocketError):
        validate_instruction(bad)


def test_prompts_structure():
    ids = [p["id"] for p in PROMPTS]
    assert len(ids) == len(set(ids)) == 160
    assert sum(p["lang"] == "en" for p in PROMPTS) == 80
    assert sum(p["lang"] == "zh" for p in PROMPTS) == 80
    for p in PROMPTS:
        assert set(p) == {"id", "lang", "prompt", "instructions", "answer"}, p["id"]
        assert p["id"].startswith(p["lang"] + "-") and p["answer"] == "pass"
        assert 1 <= len(p["instructions"]) <= 3, p["id"]
        names = [i["check"] for i in p["instructions"]]
        assert len(names) == len(set(names)), p["id"]
        for i in p["instructions"]:
            validate_instruction(i, p["id"])
            if i["check"] == "repeat_request":
                assert i["args"]["request"] in p["prompt"], p["id"]
        cjk = ins.count_zh_chars(p["prompt"]) - ins.count_words(p["prompt"])
        assert (cjk > 10) == (p["lang"] == "zh"), p["id"]  # zh prompts are written in Chinese
        assert ("chars_zh_at_most" in names or "chars_zh_at_least" in names) <= (p["lang"] == "zh")
        english = p["lang"] == "en" or "language_en" in names  # a zh prompt may ask for English
        assert ("words_at_most" in names or "words_at_least" in names) <= english


def test_build_instructions():
    header, examples = build_instructions()
    assert header["name"] == "ifeval-pocket" and header["type"] == "generation"
    assert header["check"] == "instructions" and header["chat"] is True
    assert header["template"] == "{prompt}" and header["stop"] == []
    assert header["source"]["version"] == INSTRUCTIONS_VERSION
    assert header["source"]["license"].startswith("Apache-2.0")
    assert examples == PROMPTS and examples is not PROMPTS
    examples[0]["instructions"].clear()
    assert PROMPTS[0]["instructions"]  # a fresh copy
    json.dumps([header, examples], ensure_ascii=False)


def _prompt(pid):
    return next(p for p in PROMPTS if p["id"] == pid)


def test_check_response_en_bullets():
    ex = _prompt("en-020")  # 3 bullets, under 60 words
    good = "- It remembers strong passwords.\n- It fills forms.\n- It warns about leaks."
    r = check_response(good, ex)
    assert r["correct"] and r["correct_loose"]
    assert r["passed"] == [True, True] and r["instructions_passed"] == 2
    assert r["instructions_total"] == 2 and r["prediction"] == good
    bad = "Here you go:\n- Strong passwords.\n- Autofill."
    r = check_response(bad, ex)
    assert not r["correct"] and not r["correct_loose"] and r["passed"] == [False, True]
    json.dumps(r)
    ruled = "- Strong passwords.\n- Autofill.\n\n* * *\n\nStay safe."  # two bullets, a rule
    assert check_response(ruled, ex)["passed"] == [False, True]
    assert check_response(good.replace("\n- It fills", "\n- - -\n- It fills"), ex)["correct"]


def test_the_instructions_version_is_the_recipes_and_names_its_built_file(tmp_path,
                                                                         monkeypatch):
    """A change of a prompt or a checker bumps INSTRUCTIONS_VERSION: the recipe shows it
    (--list-tasks), the built task file records it and is built again under the new version
    (not read from the old version's file)."""
    from pocketlm.evaluate.recipes import RECIPES, load_recipe, recipe_path

    monkeypatch.setenv("POCKET_HOME", str(tmp_path))
    assert RECIPES["ifeval-pocket"].source.version == f"instructions-{INSTRUCTIONS_VERSION}"
    path = recipe_path("ifeval-pocket")
    assert path.name.endswith(f"-instructions-{INSTRUCTIONS_VERSION}.jsonl")
    head = json.loads(path.read_text(encoding="utf-8").partition("\n")[0])
    assert head["task"]["source"]["version"] == INSTRUCTIONS_VERSION
    assert load_recipe("ifeval-pocket").source["version"] == INSTRUCTIONS_VERSION


def test_check_response_zh_json_and_loose():
    ex = _prompt("zh-005")  # JSON with label and reason
    good = '```json\n{"label": "中性", "reason": "快递快但包装坏了"}\n```'
    assert check_response(good, ex)["correct"]
    chatty = '好的，结果如下：\n{"label": "中性", "reason": "有好有坏"}'
    r = check_response(chatty, ex)
    assert not r["correct"] and r["correct_loose"]  # the opener line is forgiven when loose
    assert not check_response("中性", ex)["correct_loose"]


def test_check_response_zh_length_and_language():
    ex = _prompt("zh-001")  # at most 30 字, in Chinese
    assert check_response("报告因供应商延迟开票推迟，预计下周一发出。", ex)["correct"]
    r = check_response("The report is delayed and will come out on Monday.", ex)
    assert r["passed"] == [True, False] and not r["correct"]


def test_check_response_en_lowercase_postscript_loose():
    ex = _prompt("en-026")  # lowercase + P.S.
    good = "hi all, the office is closed on monday.\n\np.s. enjoy the long weekend!"
    assert check_response(good, ex)["correct"]
    bad = "Sure!\nhi all, the office is closed on monday.\np.s. rest well"
    r = check_response(bad, ex)
    assert r["passed"] == [False, True] and r["correct_loose"]


def test_json_checks_fail_a_degenerate_deep_nesting_instead_of_crashing():
    # a small model looping on "[" wrote JSON nested past Python's parser: json.loads raised
    # RecursionError, which the checks did not catch, and the whole run ended in a traceback
    deep = "[" * 5000
    assert not ins.json_valid(deep) and not ins.json_keys("{\"a\": " * 5000, ["a"])
    r = check_response(deep, _prompt("zh-005"))
    assert not r["correct"] and not r["correct_loose"]
    assert ins.json_valid("[" * 50 + "]" * 50)  # ordinary nesting still parses


def test_an_empty_reply_or_loose_variant_follows_no_instruction():
    """IFEval skips empty text: "at most 30 words" and "no commas" held for it, so a reply of
    one or two lines passed them loosely whatever it said (its variant without a first or
    last line is empty), and an empty reply passed them strictly."""
    ex = {"id": "t", "instructions": [{"check": "words_at_most", "args": {"n": 30}}]}
    long_line = " ".join(["word"] * 200)
    r = check_response(long_line, ex)
    assert not r["correct"] and not r["correct_loose"]
    r = check_response(long_line + "\n" + long_line, ex)
    assert not r["correct_loose"]
    for empty in ("", "  \n "):
        r = check_response(empty, {"id": "t", "instructions": [
            {"check": "no_commas", "args": {}}, {"check": "words_at_most", "args": {"n": 5}}]})
        assert r["passed"] == [False, False] and not r["correct_loose"]
    # a real opener is still forgiven
    r = check_response("Sure, here:\nshort and sweet", ex | {"instructions": [
        {"check": "no_commas", "args": {}}]})
    assert not r["correct"] and r["correct_loose"]


def test_loose_variants():
    v = loose_variants("Sure:\n*one*\nBye")
    assert v[0] == "Sure:\n*one*\nBye" and "*one*\nBye" in v and "one" in v and len(v) == 8


def test_check_response_refuses_examples_without_instructions():
    with pytest.raises(PocketError, match="instructions"):
        check_response("x", {"id": "en-999", "prompt": "x"})
    with pytest.raises(PocketError, match="unknown checker"):
        check_response("x", {"instructions": [{"check": "rhymes", "args": {}}]})
