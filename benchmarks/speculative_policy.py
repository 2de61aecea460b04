"""Prompt-lookup drafting policies compared without timing noise: each policy is replayed on
the model's own greedy answers and priced with the verification costs measured on this machine.

    python benchmarks/speculative_policy.py -m smollm2-135m --out benchmarks/speculative_policy.jsonl
    python benchmarks/speculative_policy.py -m my-app.pocket --prompts app_prompts.jsonl

``--prompts`` replays an app's own requests instead of the benchmark's tasks (JSON lines, each
``{"prompt": TEXT}`` or ``{"messages": [...]}``, optionally ``"kind"``; default kind "app"): the
drafting options that suit the text an app really sends (``speculative={"max_ngram": N,
"max_draft": K}`` in the API, ``--draft-max`` on the command line).

Greedy speculative decoding takes exactly the tokens plain decoding takes, so the drafts a
policy proposes and how many of them are accepted follow from the plain answer alone: the replay
runs pocketlm's own :class:`~pocketlm.speculative.PromptLookup` and
:class:`~pocketlm.speculative.DraftLength` over the prompt and the answer and counts, per
task, the verification steps and the drafted rows. Wall-clock benchmarks of the same policies
(``benchmarks/speculative.py``) move by 10-20 % from run to run on a shared 2-core machine, more
than the policies differ; this replay does not.

Time is measured, not assumed: after the task's prompt and half its answer are in the cache,
``Runtime.verify`` is timed with 1 to 17 rows (median of ``--reps``, the sizes alternating). A
step with k drafts costs what k + 1 rows took, plain decoding what one row took a token;
``x_model`` is plain time over speculative time for the tokens after the first (the rate
``benchmarks/speculative.py`` reports). The draft lengths see these step times, as they see
measured ones when decoding.

One JSON line per policy and task (steps, drafted, accepted, x_model, the timings), and one
summary per policy: the median and mean of x_model over the grounded tasks and over the free ones.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# (max_ngram, max_draft, prior acceptance) replayed; the first is what pocketlm used before this
# replay chose its defaults (pocketlm.speculative: LOOKUP_MAX_NGRAM, DEFAULT_MAX_DRAFT, the prior)
GRID = [(3, 8, 1 / 2)] + [p for p in itertools.product((3, 4, 6, 8), (8, 12, 16), (1 / 2, 2 / 3))
                          if p != (3, 8, 1 / 2)]


def greedy(model, ids: list[int], max_tokens: int) -> list[int]:
    return list(model.stream_ids(ids, max_tokens=max_tokens, temperature=0.0,
                                 repetition_penalty=1.0))


def step_costs(model, ids: list[int], reps: int) -> list[float]:
    """Seconds of a verification of 1 to MAX_DRAFT + 1 rows after ``ids`` (index: rows - 1),
    medians of ``reps`` timings, the sizes alternating so that drift hits all of them."""
    import numpy as np

    from pocketlm.speculative import MAX_DRAFT

    rt = model.runtime
    cache = rt.new_cache(len(ids) + MAX_DRAFT + 1)
    rt.forward(ids, cache)
    base = cache.length
    times: list[list[float]] = [[] for _ in range(MAX_DRAFT + 1)]
    rng = np.random.default_rng(0)
    for _ in range(reps):
        for k in range(1, MAX_DRAFT + 2):
            draft = [int(t) for t in rng.integers(0, min(model.config.vocab_size, 20000), k)]
            t0 = time.perf_counter()
            rt.verify(draft, cache)
            times[k - 1].append(time.perf_counter() - t0)
            cache.truncate(base)
    return [statistics.median(t) for t in times]


def replay(prompt: list[int], answer: list[int], policy: tuple, cost: list[float]) -> dict:
    """Steps, drafts and acceptance of a policy on ``answer``, and its modelled speed-up."""
    from pocketlm.speculative import DraftLength, PromptLookup

    max_ngram, max_draft, prior = policy
    drafter = PromptLookup(max_ngram=max_ngram)
    lengths = DraftLength(max_draft=max_draft, prior=prior)
    drafter.reset(prompt)
    drafter.extend(answer[:1])
    pos, steps, drafted, accepted, spent = 1, 0, 0, 0, 0.0
    while pos < len(answer):
        k = min(lengths.next(), len(answer) - pos)
        drafts = drafter.propose(k) if k > 0 else []
        ok = 0
        while ok < len(drafts) and drafts[ok] == answer[pos + ok]:
            ok += 1
        seconds = cost[len(drafts)]
        lengths.update(len(drafts), ok, seconds)
        take = min(ok + 1, len(answer) - pos)
        drafter.extend(answer[pos:pos + take])
        pos += take
        steps, drafted, accepted, spent = steps + 1, drafted + len(drafts), accepted + ok, \
            spent + seconds
    plain = (len(answer) - 1) * cost[0]
    return {"steps": steps, "drafted": drafted, "accepted": accepted,
            "x_model": round(plain / spent, 3) if spent else 1.0}


def app_tasks(path: Path) -> list[dict]:
    """The requests of ``path`` as tasks; exits with a one-line error on a bad file."""
    from pocketlm.errors import PocketError
    from pocketlm.evaluate.tasks import read_jsonl
    from pocketlm.textfile import read_text_file

    try:
        records, _ = read_jsonl(path, read_text_file(path, what="JSONL file"), strict=True)
    except PocketError as e:
        sys.exit(f"error: {e}")
    out = []
    for no, rec in records:
        if isinstance(rec.get("messages"), list) and rec["messages"]:
            messages = rec["messages"]
        elif isinstance(rec.get("prompt"), str) and rec["prompt"]:
            messages = [{"role": "user", "content": rec["prompt"]}]
        else:
            sys.exit(f"error: {path}:{no}: neither a non-empty 'prompt' nor 'messages'")
        out.append({"name": f"line {no}", "kind": str(rec.get("kind", "app")),
                    "messages": messages})
    if not out:
        sys.exit(f"error: {path}: no requests in it")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7, help="timings per verification size")
    ap.add_argument("--prompts", type=Path, default=None, metavar="FILE.jsonl",
                    help="an app's requests to replay instead of the benchmark's tasks")
    ap.add_argument("--out", type=Path, default=None, help="append JSON lines here too")
    args = ap.parse_args()

    import pocketlm
    from pocketlm.bench import machine_info

    the_tasks = app_tasks(args.prompts) if args.prompts else None
    if the_tasks is None:
        from speculative import tasks

        the_tasks = [dict(t, messages=[{"role": "user", "content": t["prompt"]}])
                     for t in tasks()]
    model = pocketlm.load(args.model)
    machine, today = machine_info(), time.strftime("%Y-%m-%d")
    rows = []
    for task in the_tasks:
        ids = model.chat_ids(task["messages"])
        answer = greedy(model, ids, args.max_tokens)
        cost = step_costs(model, ids + answer[:len(answer) // 2], args.reps)
        for policy in GRID:
            r = replay(ids, answer, policy, cost)
            rows.append(dict(r, task=task["name"], kind=task["kind"], policy=policy))
            print(json.dumps({"bench": "speculative-policy", "model": args.model,
                              "task": task["name"], "kind": task["kind"],
                              "max_ngram": policy[0], "max_draft": policy[1],
                              "prior": round(policy[2], 3), **r, "generated": len(answer),
                              "verify_ms": [round(c * 1e3, 2) for c in cost]}),
                  file=sys.stderr)
    out = [sys.stdout] + ([args.out.open("a")] if args.out else [])
    for policy in GRID:
        line = {"bench": "speculative-policy-summary", "model": args.model,
                "max_ngram": policy[0], "max_draft": policy[1], "prior": round(policy[2], 3)}
        for kind in dict.fromkeys(t["kind"] for t in the_tasks):
            xs = [r["x_model"] for r in rows if r["policy"] == policy and r["kind"] == kind]
            line[f"{kind}_median"] = round(statistics.median(xs), 3)
            line[f"{kind}_mean"] = round(statistics.mean(xs), 3)
        line.update(machine=machine, date=today, command=" ".join(sys.argv))
        for f in out:
            f.write(json.dumps(line) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
