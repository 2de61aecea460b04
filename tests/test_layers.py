"""The layers import downwards only (docs: the layout in docs/architecture.md).

Read from the source with ``ast``, so that an import inside a function counts too: the runtime
layers never import torch, nothing below the CLI imports the CLI, and the runtime layers
import the training package only where listed in ``TRAIN_IMPORTS`` (a ratchet: the list may
shrink, never grow).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pocketlm"
RUNTIME_LAYERS = ("runtime", "formats", "server", "evaluate", "bench")
RUNTIME_MODULES = ("api.py", "generate.py", "sampling.py", "tokenizer.py", "config.py",
                   "quant.py", "pack.py", "registry.py", "chat.py")
# (module, what it imports from pocketlm.train): the two that remain to be moved out
TRAIN_IMPORTS = {
    ("formats/__init__.py", "pocketlm.train.export"),
    ("evaluate/recipes.py", "pocketlm.train.corpora"),
}


def runtime_files() -> list[Path]:
    files = [PACKAGE / name for name in RUNTIME_MODULES]
    for layer in RUNTIME_LAYERS:
        files += sorted((PACKAGE / layer).rglob("*.py"))
    return files


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved to ``pocketlm.…``."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    package = list(rel.parts[:-1])  # the package a module (or __init__) is in
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("path", runtime_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_runtime_layers_import_no_torch_and_not_the_cli(path):
    found = imports(path)
    assert not {m for m in found if m == "torch" or m.startswith("torch.")}, path
    if path.parent.name == "server" or path.parent == PACKAGE:
        assert "pocketlm.cli" not in found, f"{path} imports the CLI"


def test_runtime_layers_import_training_only_where_listed():
    found = {(str(p.relative_to(PACKAGE)), m) for p in runtime_files() for m in imports(p)
             if m.startswith("pocketlm.train.") and m.count(".") == 2}
    assert found == TRAIN_IMPORTS


def test_the_import_reader_sees_relative_imports():
    assert "pocketlm.train.corpora" in imports(PACKAGE / "evaluate" / "recipes.py")
    assert "pocketlm.errors" in imports(PACKAGE / "server" / "app.py")


TORCH_FREE_TESTS = ("test_api", "test_api_misuse", "test_cli", "test_pocketfile", "test_quant",
                    "test_tokenizer", "test_registry", "test_fuzz_readers",
                    "test_serve_reliability", "test_reliability_files", "test_evaluate")


def test_the_runtime_tests_collect_without_torch():
    """Their fixtures (tiny_gguf, tiny_hf, tiny_models) are numpy only, so the runtime's tests
    run on a machine without the train extra."""
    code = ("import importlib, sys; sys.modules['torch'] = None; "
            f"[importlib.import_module(m) for m in {TORCH_FREE_TESTS!r}]")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
