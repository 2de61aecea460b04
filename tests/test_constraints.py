"""Instruction chats made from answers the recipe already has: every instruction added is
verified by the capability suite's checker on the final answer, the chats are deterministic,
the wording is the recipe's own, and the data stage adds them only when the recipe asks."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from pocketlm.evaluate.instructions import CHECKERS, PROMPTS
from pocketlm.recipes.constraints import _WORDING, constrained_chat, kinds_for

EN_ANSWER = ("Regular exercise improves your mood and your sleep. Walking is the easiest "
             "exercise to start with, and it needs no equipment. Try to walk for thirty minutes "
             "a day. Over a few weeks, most people notice they have more energy. Exercise with a "
             "friend if you find it hard to keep going.")
ZH_ANSWER = ("坚持运动可以改善心情和睡眠。散步是最容易开始的运动，不需要任何器材。每天散步三十分钟就很好。"
             "几周以后，很多人会觉得精力更充沛。如果难以坚持，可以约朋友一起运动。")


def _prompt(i: int, lang: str) -> dict:
    text = (f"How can I start exercising? (question {i})" if lang == "en"
            else f"怎样开始坚持运动？运动有什么好处？（第{i}题）")
    return {"id": f"{lang}{i:04d}", "lang": lang, "source": "test", "kind": "chat",
            "prompt": text, "gold": None, "checks": None}


@pytest.mark.parametrize("lang,answer", [("en", EN_ANSWER), ("zh", ZH_ANSWER)])
def test_every_added_instruction_is_verified_on_the_final_answer(lang, answer):
    kinds = Counter()
    made = 0
    for i in range(300):
        p = _prompt(i, lang)
        chat = constrained_chat(p, answer, seed=0)
        if chat is None:
            continue
        made += 1
        assert chat == constrained_chat(p, answer, seed=0)  # deterministic
        user, reply = (m["content"] for m in chat["messages"])
        assert 1 <= len(chat["checks"]) <= 3
        for c in chat["checks"]:
            kinds[c["check"]] += 1
            assert CHECKERS[c["check"]](reply, **c["args"]), (c, reply)
        if chat["checks"][0]["check"] == "repeat_request":
            assert reply.startswith(p["prompt"]) and p["prompt"] in user
        else:
            assert p["prompt"] in user and user != p["prompt"]
        if chat["checks"][0]["check"] == "json_keys":
            key = chat["checks"][0]["args"]["keys"][0]
            assert json.loads(reply)[key] == answer
        elif not any(c["check"] in ("lowercase", "uppercase", "highlights_at_least",
                                    "paragraphs_exactly") for c in chat["checks"]):
            assert answer in reply  # the teacher's words, with at most a phrase around them
    assert made >= 250
    # the kinds the student missed most are all made
    for kind in ("starts_with", "ends_with", "quoted", "json_keys", "postscript",
                 "highlights_at_least", "keyword_frequency_at_least", "keywords_include",
                 "paragraphs_exactly", "repeat_request", "words_exclude"):
        assert kinds[kind] > 0, kind
    assert set(kinds) <= set(kinds_for(lang))
    assert constrained_chat(_prompt(0, lang), answer, seed=1) != \
        constrained_chat(_prompt(0, lang), answer, seed=0)


def test_the_wording_is_not_the_capability_suites():
    """No instruction sentence of the recipe, filled in as the suite would fill it, is one of
    the suite's (short plain ones such as "use the word X at least N times" may say what a
    suite sentence says in the same words: under 40 characters, 12 in Chinese, they are not
    compared)."""
    prompts = " ".join(p["prompt"] for p in PROMPTS).casefold()
    fields = {"n": 3, "p": "Thank you so much!", "k": "fresh", "k2": "safety", "w": "rain",
              "w2": "wet", "key": "label"}
    for en, zh in _WORDING.values():
        for text in (*en, *zh):
            sentence = text.format(**fields).split("\n")[0].strip(" \"“”。.").casefold()
            if len(sentence) >= (40 if sentence.isascii() else 12):
                assert sentence not in prompts, sentence


def test_an_answer_nothing_can_be_said_of_gives_few_instructions():
    p = _prompt(1, "en")
    for seed in range(20):
        chat = constrained_chat(p, "Yes.", seed)
        if chat is not None:  # only what an edit makes true can be asked of "Yes."
            assert all(c["check"] in ("starts_with", "ends_with", "quoted", "postscript",
                                      "lowercase", "uppercase", "json_keys", "repeat_request",
                                      "no_commas", "words_exclude", "words_at_most")
                       for c in chat["checks"])


def test_the_data_stage_adds_instruction_chats_only_when_the_recipe_asks(tmp_path):
    from pocketlm.recipes.pocket_zh_en import Recipe, stage_data

    prompts = [_prompt(i, "en") for i in range(40)] + [_prompt(i, "zh") for i in range(40)]
    answers = [{"id": p["id"], "answer": EN_ANSWER if p["lang"] == "en" else ZH_ANSWER,
                "finish_reason": "stop", "tokens": 60} for p in prompts]
    plain = stage_data(tmp_path, Recipe(constraint_share=0.0), prompts, answers)
    assert plain["chats"] == 80 and plain["instructions_added"] == {}
    # runs made before the field existed are read as constraint_share 0.0
    assert "constraint_share" not in Recipe(constraint_share=0.0).to_dict()
    assert Recipe().to_dict()["constraint_share"] == 0.6

    recipe = Recipe(constraint_share=0.5)
    assert recipe.to_dict()["constraint_share"] == 0.5
    report = stage_data(tmp_path, recipe, prompts, answers)
    added = report["chats"] - 80
    assert 20 <= added <= 60
    assert report["kept"]["test/chat/instructions"] == added
    assert sum(report["instructions_added"].values()) >= added
    chats = [json.loads(x) for x in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert len(chats) == report["chats"]
    assert stage_data(tmp_path, recipe, prompts, answers) == report  # same seed, same data


def test_data_version_2_drops_answers_that_ask_for_the_input_and_adds_a_second_chat(tmp_path):
    from pocketlm.recipes.pocket_zh_en import Recipe, judge, stage_data

    asking = {"answer": "Sure, I'd be happy to help! Please provide the text you would like me "
                        "to summarize.", "finish_reason": "stop", "tokens": 20}
    zh_asking = {"answer": "好的，请提供需要总结的文章。", "finish_reason": "stop", "tokens": 12}
    assert judge(_prompt(0, "en"), asking) is None  # the recorded recipe's data is unchanged
    assert judge(_prompt(0, "en"), asking, 2) == "asks for the input instead of answering"
    assert judge(_prompt(0, "zh"), zh_asking, 2) == "asks for the input instead of answering"
    assert judge(_prompt(0, "en"), {"answer": EN_ANSWER, "finish_reason": "stop"}, 2) is None

    prompts = [_prompt(i, "en") for i in range(40)] + [_prompt(i, "zh") for i in range(40)]
    answers = [{"id": p["id"], "answer": EN_ANSWER if p["lang"] == "en" else ZH_ANSWER,
                "finish_reason": "stop", "tokens": 60} for p in prompts]
    answers[0] = {**asking, "id": prompts[0]["id"]}
    one = stage_data(tmp_path, Recipe(), prompts, answers)
    two = stage_data(tmp_path, Recipe(data_version=2), prompts, answers)
    assert "asks for the input instead of answering" not in one["dropped"]
    assert two["dropped"] == {"asks for the input instead of answering": 1}
    assert two["kept"]["test/chat"] == 79
    added_one, added_two = one["chats"] - 80, two["chats"] - 79
    assert added_two > 1.5 * added_one
    chats = [json.loads(x)["messages"] for x in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert all("Please provide" not in m[1]["content"] for m in chats)
    # the two chats of one answer never ask for the same kinds
    asked = Counter(m[0]["content"] for m in chats)
    assert max(asked.values()) == 1
    assert Recipe(data_version=2).to_dict()["data_version"] == 2
    assert "data_version" not in Recipe().to_dict()


def test_cut_answers_are_kept_to_their_last_whole_sentence_only_when_asked(tmp_path):
    from pocketlm.recipes.pocket_zh_en import (
        Recipe,
        answer_text,
        cut_at_sentence,
        judge,
        stage_data,
    )

    assert cut_at_sentence(EN_ANSWER + " Walking every") == EN_ANSWER
    assert cut_at_sentence(ZH_ANSWER + "每周三") == ZH_ANSWER
    assert cut_at_sentence('He said "go to the shop now." Then he') == \
        'He said "go to the shop now."'
    assert cut_at_sentence("Version 2.5 is out and") is None  # no sentence end: a number
    assert cut_at_sentence("One. " + "x" * 200) is None  # less than half of it kept
    # a code block left open is no answer: the whole sentences before it are kept
    assert cut_at_sentence("Use this code, which is short. It works.\n```python\nx = 1.") == \
        "Use this code, which is short. It works."
    assert cut_at_sentence("Run it.\n```\nls\n```\nThen this: ```py\nprint(1). Done") is None

    cut = {"answer": EN_ANSWER + " Walking every", "finish_reason": "length", "tokens": 256}
    prompt = _prompt(0, "en")
    assert judge(prompt, cut) == "cut at the token limit"  # the recorded recipe: dropped
    assert judge(prompt, cut, 1, keep_cut=True) is None
    assert answer_text(cut, keep_cut=True) == EN_ANSWER
    assert answer_text(cut) is None
    hopeless = {"answer": "x" * 300, "finish_reason": "length", "tokens": 256}
    assert judge(prompt, hopeless, 1, keep_cut=True) == "cut at the token limit"

    prompts = [_prompt(i, "en") for i in range(20)]
    answers = [{"id": p["id"], "answer": EN_ANSWER, "finish_reason": "stop", "tokens": 60}
               for p in prompts]
    answers[3] = {**cut, "id": prompts[3]["id"]}
    plain = stage_data(tmp_path, Recipe(constraint_share=0.0), prompts, answers)
    plain_data = (tmp_path / "sft.jsonl").read_bytes()
    assert plain["dropped"] == {"cut at the token limit": 1} and "cut_answers_kept" not in plain
    kept = stage_data(tmp_path, Recipe(constraint_share=0.0, keep_cut_answers=True), prompts,
                      answers)
    assert kept["dropped"] == {} and kept["cut_answers_kept"] == 1 and kept["chats"] == 20
    chats = [json.loads(x)["messages"] for x in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert chats[3][1]["content"] == EN_ANSWER
    assert (tmp_path / "sft.jsonl").read_bytes() != plain_data
    assert "keep_cut_answers" not in Recipe().to_dict()
    assert Recipe(keep_cut_answers=True).to_dict()["keep_cut_answers"] is True
