"""Evaluation: perplexity and task accuracy of any model, without torch.

    import pocketlm
    from pocketlm.evaluate import perplexity, load_task, evaluate_task, load_recipe

    m = pocketlm.load("smollm2-135m")
    perplexity(m, open("text.txt").read())          # {"ppl", "ppl_char", "bits_per_char", ...}
    evaluate_task(m, load_recipe("sentiment-zh"), limit=200)   # {"accuracy", "n", ...}
    run_suite(PocketEngine(m), "pocket")          # {"abilities": [...], "tasks": [...]}

See ``docs/eval.md`` for the task file format and the bundled recipes, ``docs/capability.md``
for the capability suite.
"""

from .recipes import RECIPES, load_recipe, resolve_task, sentiment_split
from .suite import SUITES, format_table, run_suite
from .tasks import (
    Engine,
    LlamaCppEngine,
    PocketEngine,
    Task,
    as_engine,
    evaluate_task,
    last_number,
    load_task,
    make_extractor,
    normalize,
    perplexity,
    wilson_interval,
)

__all__ = [
    "RECIPES", "Engine", "LlamaCppEngine", "PocketEngine", "Task", "as_engine", "evaluate_task",
    "last_number", "load_recipe", "load_task", "make_extractor", "normalize", "perplexity",
    "resolve_task", "sentiment_split", "SUITES", "run_suite", "format_table", "wilson_interval",
]
