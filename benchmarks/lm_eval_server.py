"""A client nobody here wrote: EleutherAI's lm-evaluation-harness against `pocket serve`.

    python -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install "lm-eval[api]"   # its own environment
    python benchmarks/lm_eval_server.py --lm-eval /tmp/lmeval/bin/lm_eval -m smollm2-135m \\
        [--limit 100] [--out benchmarks/lm_eval_server.jsonl]

lm-eval's ``local-completions`` model talks to the server's ``/v1/completions`` with
``echo`` + ``logprobs`` (log-likelihood tasks) and plain generation (generation tasks), and
tokenizes through the server's ``/tokenize`` (``tokenizer_backend=remote``). The items are
pocket eval's own: the first ``--limit`` items of ``idioms-zh`` (multiple choice, scored by
log-likelihood) and ``gsm8k`` (generation until a blank line), written as lm-eval task files
(a local JSON dataset; the prompt text exactly as pocket eval builds it). pocket eval scores
the same items in this process with the same model; the line written says both accuracies,
and, item by item, whether the two agree on the choice picked (multiple choice) and on the
generated text (generation). lm-eval is not a dependency of pocketlm: it runs in its own
environment (it pulls in datasets, pandas, scikit-learn and more).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from structured import emit  # noqa: E402 - the JSON-line writer the benchmarks share


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pocket_items(model, name: str, limit: int) -> tuple[object, list[dict], list[dict]]:
    """(task, items to score, pocket eval's result per item)."""
    from pocketlm.evaluate.recipes import recipe_path
    from pocketlm.evaluate.tasks import PocketEngine, load_task, score_example, split_shots

    task = load_task(recipe_path(name))
    shots, todo = split_shots(task)
    todo = todo[:limit]
    engine = PocketEngine(model)
    return task, todo, [score_example(engine, task, ex, shots) for ex in todo]


def write_tasks(folder: Path, mc, gen) -> None:
    """lm-eval task files: the prompts as pocket eval builds them, the choices with the text
    pocket eval puts before each (its trailing spaces and choice prefix)."""
    from pocketlm.evaluate.tasks import build_prompt, candidates, target

    task, items, _ = mc
    rows = []
    for ex in items:
        prompt = build_prompt(task, ex, [])
        stripped = prompt.rstrip(" \t")
        lead = prompt[len(stripped):] + task.choice_prefix
        cands = candidates(task, ex)
        rows.append({"query": stripped, "choices": [lead + c for c in cands],
                     "gold": cands.index(target(task, ex))})
    (folder / "mc.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                             for r in rows), encoding="utf-8")
    (folder / "pocket_mc.yaml").write_text(f"""task: pocket_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""", encoding="utf-8")
    task, items, _ = gen
    rows = [{"query": build_prompt(task, ex, []), "answer": str(ex["answer"])} for ex in items]
    (folder / "gen.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                              for r in rows), encoding="utf-8")
    stops = json.dumps(task.stop if task.stop is not None else ["\n\n"])
    (folder / "pocket_gen.yaml").write_text(f"""task: pocket_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{query}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: {stops}
  max_gen_toks: {task.max_tokens}
  do_sample: false
  temperature: 0
filter_list:
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]
""", encoding="utf-8")


def start_server(name: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "pocketlm.cli", "serve", "-m", name,
                             "--port", str(port), "--max-batch", "8"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        line = proc.stderr.readline()
        if "OpenAI" in line:
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("the server did not start")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lm-eval", required=True, help="the lm_eval command of its environment")
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import pocketlm
    from pocketlm.bench import machine_info
    from pocketlm.evaluate.tasks import make_extractor, normalize

    model = pocketlm.load(args.model)
    t0 = time.time()
    mc = pocket_items(model, "idioms-zh", args.limit)
    gen = pocket_items(model, "gsm8k", args.limit)
    pocket_s = time.time() - t0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_tasks(folder, mc, gen)
        port = free_port()
        server = start_server(args.model, port)
        try:
            model_args = (f"model={args.model},base_url=http://127.0.0.1:{port}/v1/completions,"
                          "tokenizer_backend=remote,tokenized_requests=True,num_concurrent=4,"
                          "max_retries=1,timeout=600")
            if model.tokenizer.add_bos:  # lm-eval's remote tokenizer asks for no BOS
                print("note: lm-eval scores this model's items without the BOS that pocket "
                      "eval puts first (its remote tokenizer ignores add_bos_token)",
                      file=sys.stderr)
            cmd = [args.lm_eval, "--model", "local-completions", "--model_args", model_args,
                   "--tasks", "pocket_mc,pocket_gen", "--include_path", str(folder),
                   "--output_path", str(folder / "out"), "--log_samples", "--batch_size", "1"]
            t0 = time.time()
            run = subprocess.run(cmd, capture_output=True, text=True,
                                 env={**os.environ, "HF_DATASETS_OFFLINE": "1",
                                      "HF_HUB_OFFLINE": "1"})
            lm_s = time.time() - t0
            if run.returncode != 0:
                print(run.stdout[-3000:], run.stderr[-6000:], file=sys.stderr)
                return 1
        finally:
            server.terminate()
            server.wait(30)
        results = json.loads(next((folder / "out").rglob("results_*.json")).read_text())
        samples = {}
        for f in (folder / "out").rglob("samples_*.jsonl"):
            task = re.search(r"samples_(pocket_\w+?)_\d", f.name).group(1)
            samples[task] = sorted((json.loads(x) for x in f.read_text().splitlines()),
                                   key=lambda s: s["doc_id"])
    # multiple choice: lm-eval's pick per item (its log-likelihoods) against pocket eval's
    # (the logged samples hold each choice's [log-likelihood, is-greedy] as text)
    lm_ll = [[float(r[0]) for r in s["filtered_resps"]] for s in samples["pocket_mc"]]
    lm_mc = [max(range(len(row)), key=row.__getitem__) for row in lm_ll]
    task, items, pocket = mc
    from pocketlm.evaluate.tasks import candidates

    pocket_mc = [candidates(task, ex).index(r["prediction"]) for ex, r in zip(items, pocket,
                                                                             strict=True)]
    max_ll_diff = max(abs(a - b) for row, r in zip(lm_ll, pocket, strict=True)
                      for a, b in zip(row, r["logprobs"], strict=True))
    # generation: lm-eval's raw text against pocket eval's output, and both scored alike
    task_g, items_g, pocket_g = gen
    lm_gen = [s["resps"][0][0] for s in samples["pocket_gen"]
              if s.get("filter") == "flexible-extract"]
    extract = make_extractor(task_g.extract)

    def correct(text: str, ex: dict) -> bool:
        got, want = extract(text), extract(str(ex["answer"]))
        want = str(ex["answer"]) if want is None else want
        return got is not None and normalize(got) == normalize(want)

    row = {
        "bench": "lm-eval-vs-pocket-eval", "model": args.model, "limit": args.limit,
        "lm_eval": {"version": subprocess.run(
            [str(Path(args.lm_eval).with_name("python")), "-c",
             "import lm_eval; print(lm_eval.__version__)"], capture_output=True,
            text=True).stdout.strip() or "?",
            "model": "local-completions (tokenizer_backend=remote)"},
        "idioms-zh": {"n": len(items),
                      "lm_eval_acc": results["results"]["pocket_mc"]["acc,none"],
                      "pocket_eval_acc": sum(r["correct"] for r in pocket) / len(pocket),
                      "same_pick": sum(a == b for a, b in zip(lm_mc, pocket_mc, strict=True)),
                      "max_loglikelihood_diff": round(max_ll_diff, 6)},
        "gsm8k": {"n": len(items_g),
                  "lm_eval_exact_match": results["results"]["pocket_gen"][
                      "exact_match,flexible-extract"],
                  "lm_eval_acc_by_pocket_extractor": sum(
                      correct(t, ex) for t, ex in zip(lm_gen, items_g, strict=True))
                  / len(items_g),
                  "pocket_eval_acc": sum(r["correct"] for r in pocket_g) / len(pocket_g),
                  "same_text": sum(a == r["output"] for a, r in zip(lm_gen, pocket_g,
                                                                    strict=True))},
        "seconds": {"pocket_eval": round(pocket_s, 1), "lm_eval": round(lm_s, 1)},
        "command": " ".join(sys.argv), "machine": machine_info(),
    }
    emit(row, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
