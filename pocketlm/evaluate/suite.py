"""Capability suites: a fixed, versioned set of tasks, one table of abilities.

``pocket eval -m MODEL --suite pocket`` runs every task of :data:`SUITES` ``["pocket"]`` on one
loaded model and prints one row per ability (the report's five, plus the app's own task):
accuracy, items, a 95 % Wilson interval and the tokens per second the model ran at, then one
row per task. An ability's accuracy pools the items of its headline tasks (MMLU 0-shot is
shown but not pooled: it asks the same questions as the 5-shot row).

Each task scores a fixed subset: its first ``limit`` examples, after ordering them by a hash of
their content where ``order="hash"`` (so a subset is spread over the whole set and never
changes); ``--limit N`` takes N instead, ``--limit 0`` the whole set. The subsets and prompts
are part of the suite's version: :data:`SUITE_VERSION` changes whenever they do, and every
result records it.

A run can write each scored example to a predictions file (``--predictions FILE``; one JSON
line each, after a first line that describes the run). Running the same command again with the
same file resumes: examples already there are counted, not scored again. A file written by
another run (another model, precision, engine, context or suite version) is refused.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import PocketError
from .tasks import Engine, Task, evaluate_task, split_shots, wilson_interval

# 2: ifeval-pocket's bullets_exactly counts no horizontal rule (INSTRUCTIONS_VERSION 2), and
# exact matches (gsm8k-cot) compare numbers by their exact decimal value (tasks.normalize);
# 3: an empty reply or loose variant follows no ifeval-pocket instruction (INSTRUCTIONS_VERSION 3)
# 4: ifeval-pocket judges as IFEval's reference checkers where its rules were stricter by
# accident (INSTRUCTIONS_VERSION 4: abbreviations, emphasised postscripts, quoted endings,
# one-line JSON fences, names in Chinese replies, "under N words");
# 5: ifeval-pocket has 160 prompts, not 80 (INSTRUCTIONS_VERSION 5)
SUITE_VERSION = 5


@dataclass(frozen=True)
class SuiteTask:
    """One task of a suite: a recipe, how it is run and which items it scores."""

    key: str  # the task's name in the suite's tables and predictions
    ability: str
    recipe: str
    limit: int  # items scored by default (0: all)
    shots: int | None = None  # None: the recipe's
    order: str = "file"  # "hash": order the examples by a hash of their content first
    fewshot_group: str | None = None  # shots drawn per example from its group (see Task)
    headline: bool = True  # pooled into its ability's row
    chat: bool | None = None  # None: the recipe's


ABILITIES = ("English knowledge", "Chinese understanding", "Mathematics", "Code",
             "Instruction following", "App task")

SUITES: dict[str, tuple[SuiteTask, ...]] = {
    "pocket": (
        SuiteTask("mmlu-5shot", "English knowledge", "mmlu", 0, shots=5,
                  fewshot_group="subject"),
        SuiteTask("mmlu-0shot", "English knowledge", "mmlu", 0, shots=0, headline=False),
        SuiteTask("idioms-zh", "Chinese understanding", "idioms-zh", 300),
        SuiteTask("cloze-zh", "Chinese understanding", "cloze-zh", 300),
        SuiteTask("gsm8k-cot", "Mathematics", "gsm8k-cot", 100),
        SuiteTask("humaneval", "Code", "humaneval", 82, order="hash"),
        SuiteTask("ifeval-pocket", "Instruction following", "ifeval-pocket", 0),
        SuiteTask("sentiment-zh", "App task", "sentiment-zh", 300),
    ),
    # the formulations of the models' own reports, so that a score can be set against theirs
    # where the prompts match (docs/capability.md, "Published scores"); not the ability table
    "published": (
        SuiteTask("mmlu-cloze", "English knowledge", "mmlu-cloze", 0, shots=0),
        SuiteTask("humaneval-chat", "Code", "humaneval-chat", 0, order="hash"),
    ),
}


def suite_tasks(name: str, only: list[str] | None = None) -> tuple[SuiteTask, ...]:
    """The tasks of suite ``name`` (``only``: just these task keys, in suite order)."""
    if name not in SUITES:
        raise PocketError(f"no suite named {name!r}; known: {', '.join(SUITES)}")
    tasks = SUITES[name]
    if only:
        keys = [t.key for t in tasks]
        unknown = [k for k in only if k not in keys]
        if unknown:
            raise PocketError(f"suite {name} has no task {unknown[0]!r}; its tasks: "
                              f"{', '.join(keys)}")
        tasks = tuple(t for t in tasks if t.key in only)
    return tasks


def example_key(ex: dict) -> str:
    """A stable hash of an example's content (its identity in predictions files)."""
    text = json.dumps(ex, ensure_ascii=False, sort_keys=True)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


def prepared_task(st: SuiteTask, load: Callable[[str], Task]) -> Task:
    """The recipe's task as suite task ``st`` runs it (order, shots grouping, chat)."""
    task = load(st.recipe)
    task.name = st.key
    if st.order == "hash":
        task.examples = sorted(task.examples, key=example_key)
    if st.fewshot_group is not None:
        task.fewshot_group = st.fewshot_group
    if st.chat is not None:
        task.chat = st.chat
    return task


# -- predictions files -------------------------------------------------------------------------


class Predictions:
    """A predictions file: a run header, then one line per scored example. Opening an existing
    file for the same run reads what it holds (to resume); a torn last line (the process was
    killed while writing) is dropped, and one that lacks only its newline is kept and ended."""

    def __init__(self, path: str | Path, run: dict):
        self.path = Path(path)
        self.done: dict[str, dict[int, dict]] = {}
        self._keys: dict[str, dict[int, str]] = {}
        good = 0  # bytes of whole lines
        if self.path.exists():
            try:
                data = self.path.read_bytes()
            except OSError as e:
                raise PocketError(f"{self.path}: cannot read ({e.strerror or e})") from None
            if data.strip() and not data.lstrip().startswith(b'{"run"'):
                # a first line that is not JSON (a text file named by mistake) read as "no
                # header yet", and the file was truncated; a torn header still starts so
                raise PocketError(f"{self.path}: not a predictions file of pocket eval "
                                  "--suite; name another file")
            lines = data.split(b"\n")
            try:
                head = json.loads(lines[0]) if lines[0].strip() else None
            except ValueError:
                head = None
            if head is not None and not (isinstance(head, dict) and "run" in head):
                raise PocketError(f"{self.path}: not a predictions file of pocket eval "
                                  "--suite; name another file")
            if head is not None:
                if head["run"] != run:
                    diff = [k for k in sorted(set(run) | set(head["run"]))
                            if run.get(k) != head["run"].get(k)]
                    raise PocketError(f"{self.path}: holds predictions of another run "
                                      f"(its {', '.join(diff)} differ); name another file or "
                                      "delete it")
                good = len(lines[0]) + 1
                for raw in lines[1:]:
                    try:
                        rec = json.loads(raw)
                        self.done.setdefault(rec["task"], {})[int(rec["index"])] = rec["result"]
                        self._keys.setdefault(rec["task"], {})[int(rec["index"])] = rec["key"]
                    except (ValueError, KeyError, TypeError):
                        break  # a torn last line: everything after it is rewritten
                    good += len(raw) + 1
                good = min(good, len(data))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")  # noqa: SIM115 - kept open for the whole run
            self._file.truncate(good)
            self._file.seek(good)
            if good == 0:
                self._write({"run": run})
            elif not data[:good].endswith(b"\n"):  # whole, but killed before its newline
                self._file.write(b"\n")
        except OSError as e:
            raise PocketError(f"{self.path}: cannot write ({e.strerror or e})") from None

    def resumed(self, key: str, task: Task, todo: list[dict]) -> dict[int, dict]:
        """The results already held for task ``key`` whose example is still the same."""
        held = self.done.get(key, {})
        keys = self._keys.get(key, {})
        return {i: r for i, r in held.items()
                if i < len(todo) and keys.get(i) == example_key(todo[i])}

    def _write(self, record: dict) -> None:
        self._file.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        self._file.flush()

    def add(self, key: str, index: int, example: dict, result: dict) -> None:
        self._write({"task": key, "index": index, "key": example_key(example),
                     "example": example, "result": result})

    def close(self) -> None:
        self._file.close()


# -- running -----------------------------------------------------------------------------------


def run_suite(engine: Engine, name: str = "pocket", *, limit: int | None = None,
              only: list[str] | None = None, predictions: Predictions | None = None,
              load: Callable[[str], Task] | None = None, progress: bool = True,
              on_task: Callable[[dict], None] | None = None) -> dict:
    """Run suite ``name`` on ``engine``. ``limit`` overrides every task's item count (0: the
    whole set). Returns ``{"suite", "suite_version", "tasks": [...], "abilities": [...],
    "seconds"}``; ``on_task(result)`` sees each task's result as it finishes."""
    from .recipes import load_recipe

    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 0):
        raise PocketError(f"--limit must be a non-negative integer (0: all), got {limit!r}")
    load = load or load_recipe
    t0 = time.perf_counter()
    results = []
    for st in suite_tasks(name, only):
        task = prepared_task(st, load)
        n = st.limit if limit is None else limit
        shots = task.shots if st.shots is None else st.shots
        task.shots = shots
        todo = split_shots(task, shots)[1]  # what evaluate_task scores, in its order
        todo = todo[:n] if n else todo
        done = predictions.resumed(st.key, task, todo) if predictions else None
        record = None if predictions is None else (
            lambda i, ex, r, key=st.key: predictions.add(key, i, ex, r))
        r = evaluate_task(engine, task, limit=n, shots=shots, progress=progress,
                          on_example=record, done=done)
        r = {"task": st.key, "ability": st.ability, "recipe": st.recipe,
             "headline": st.headline, "chat": task.chat, **{k: v for k, v in r.items()
                                                            if k != "task"}}
        results.append(r)
        if on_task is not None:
            on_task(r)
    return {"suite": name, "suite_version": SUITE_VERSION, "tasks": results,
            "abilities": abilities(results), "seconds": time.perf_counter() - t0}


def abilities(results: list[dict]) -> list[dict]:
    """One row per ability: the items of its headline tasks pooled."""
    rows = []
    for ability in ABILITIES:
        mine = [r for r in results if r["ability"] == ability and r["headline"]]
        if not mine:
            continue
        n = sum(r["n"] for r in mine)
        correct = sum(r["correct"] for r in mine)
        seconds = sum(r["seconds"] for r in mine)
        tokens = sum(r["tokens"] for r in mine)
        low, high = wilson_interval(correct, n)
        rows.append({"ability": ability, "tasks": [r["task"] for r in mine], "n": n,
                     "correct": correct, "accuracy": correct / n if n else 0.0,
                     "ci95": [low, high], "seconds": seconds,
                     "tokens_per_s": tokens / seconds if seconds > 0 else None})
    return rows


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}"


def format_table(result: dict) -> str:
    """The suite's result as a plain-text table: abilities, then tasks."""
    lines = [f"{'ability':<24}{'acc %':>7}{'95% CI':>15}{'items':>7}{'tok/s':>8}  tasks"]
    for a in result["abilities"]:
        lo, hi = a["ci95"]
        tps = f"{a['tokens_per_s']:.0f}" if a["tokens_per_s"] else "-"
        lines.append(f"{a['ability']:<24}{_pct(a['accuracy']):>7}"
                     f"{_pct(lo) + ' -' + _pct(hi):>15}{a['n']:>7}{tps:>8}  "
                     f"{', '.join(a['tasks'])}")
    lines.append("")
    lines.append(f"{'task':<24}{'acc %':>7}{'95% CI':>15}{'items':>7}{'tok/s':>8}  shots, "
                 "seconds")
    for r in result["tasks"]:
        lo, hi = r["ci95"]
        tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-"
        extra = f"{r['shots']}-shot{', chat' if r['chat'] else ''}, {r['seconds']:.0f} s"
        if r.get("acc_norm") is not None:  # multiple choice: the best per character
            extra += f", acc_norm {_pct(r['acc_norm'])}"
        if r.get("resumed"):
            extra += f", {r['resumed']} resumed"
        lines.append(f"{r['task']:<24}{_pct(r['accuracy']):>7}{_pct(lo) + ' -' + _pct(hi):>15}"
                     f"{r['n']:>7}{tps:>8}  {extra}")
    return "\n".join(lines)


def run_header(model: str, precision: str, name: str, engine: str,
               n_ctx: int | None = None) -> dict[str, Any]:
    """What a predictions file's first line records: a resumed run must match it. The limit
    and the tasks may differ (each line names its task, index and example's hash), so one
    file can collect a suite run task by task, or grow from a small limit to a larger one."""
    return {"suite": name, "suite_version": SUITE_VERSION, "model": model,
            "precision": precision, "engine": engine, "n_ctx": n_ctx}
