"""The layers import downwards only (docs: the layout in docs/architecture.md).

Read from the source with ``ast``, so that an import inside a function counts too: the runtime
layers (and ``pocketlm/data``, which training and evaluation share, and ``pocketlm/export``,
which writes deploy files for other engines) never import torch, nothing below the CLI imports
the CLI, and none of them imports the training package: what they need of it (opening a
training run as a model source) is registered as an entry point.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pocketlm"
RUNTIME_LAYERS = ("runtime", "formats", "server", "evaluate", "bench", "data", "export")
RUNTIME_MODULES = ("api.py", "generate.py", "sampling.py", "tokenizer.py", "config.py",
                   "quant.py", "pack.py", "packcache.py", "registry.py", "chat.py")
# (module, what it imports from pocketlm.train): none
TRAIN_IMPORTS: set[tuple[str, str]] = set()


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
    if path.parent.name in ("server", "export") or path.parent == PACKAGE:
        assert "pocketlm.cli" not in found, f"{path} imports the CLI"


def is_training(module: str) -> bool:
    return module == "pocketlm.train" or module.startswith("pocketlm.train.")


def test_every_layer_is_read():
    files = set(runtime_files())
    for layer in RUNTIME_LAYERS:
        assert PACKAGE / layer / "__init__.py" in files, layer
    assert {PACKAGE / "export" / n for n in ("gguf.py", "gguf_vocab.py", "hf.py")} <= files


def test_runtime_layers_do_not_import_training():
    found = {(str(p.relative_to(PACKAGE)), m) for p in runtime_files() for m in imports(p)
             if is_training(m)}
    assert found == TRAIN_IMPORTS


def test_the_import_reader_sees_relative_imports():
    assert "pocketlm.data.corpora" in imports(PACKAGE / "evaluate" / "recipes.py")
    assert "pocketlm.errors" in imports(PACKAGE / "server" / "app.py")
    assert "pocketlm.export.atomic_file" in imports(PACKAGE / "export" / "gguf.py")
    assert "pocketlm.export.gguf_vocab" in imports(PACKAGE / "export" / "gguf.py")
    assert "pocketlm.formats.gguf_vocab" in imports(PACKAGE / "export" / "gguf_vocab.py")
    assert is_training("pocketlm.train.export") and is_training("pocketlm.train")
    assert not is_training("pocketlm.trainer")


def test_the_training_run_reader_is_registered_not_imported():
    """formats opens a training run through the ``pocketlm.sources`` entry point of
    pyproject.toml; its fallback table (for an install whose metadata predates the entry point)
    says the same, and the opener it finds is the training package's."""
    tomllib = pytest.importorskip("tomllib")
    from pocketlm import formats

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))
    declared = project["project"]["entry-points"][formats.SOURCE_GROUP]
    assert declared == formats.DEFAULT_OPENERS
    module, _, name = declared["run"].partition(":")
    assert is_training(module)
    installed = importlib.metadata.entry_points(group=formats.SOURCE_GROUP).select(name="run")
    assert all(p.value == declared["run"] for p in installed)
    if importlib.util.find_spec("torch") is not None:
        assert formats.source_opener("run") is getattr(importlib.import_module(module), name)


TORCH_FREE_TESTS = ("test_api", "test_api_misuse", "test_cli", "test_pocketfile", "test_quant",
                    "test_tokenizer", "test_registry", "test_fuzz_readers",
                    "test_serve_reliability", "test_reliability_files", "test_evaluate",
                    "test_export_common")


def test_the_runtime_tests_collect_without_torch():
    """Their fixtures (tiny_gguf, tiny_hf, tiny_models) are numpy only, so the runtime's tests
    run on a machine without the train extra."""
    code = ("import importlib, sys; sys.modules['torch'] = None; "
            f"[importlib.import_module(m) for m in {TORCH_FREE_TESTS!r}]")
    path = os.pathsep.join(filter(None, [str(PACKAGE.parent), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent,
                          env={**os.environ, "PYTHONPATH": path},  # this tree's pocketlm
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
