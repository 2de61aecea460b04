"""Recipes: registry models that pocketlm makes (data, distillation, training, quantization)
instead of downloading, since the project publishes no weights.

``pocket train --recipe NAME --out DIR`` runs a recipe in a folder of your choice;
``pocket pull NAME`` runs it in ``$POCKET_HOME/recipes/NAME`` and keeps the deploy file as the
registry model ``NAME``. Both resume where they stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from ..errors import ModelNotFoundError, PocketError

__all__ = ["RECIPE_MODULES", "build_recipe", "built_record", "not_built_message",
           "recipe_module", "recipe_state", "verify_built"]

RECIPE_MODULES = {"pocket-zh-en": "pocketlm.recipes.pocket_zh_en"}


def recipe_module(name: str):
    import importlib

    try:
        return importlib.import_module(RECIPE_MODULES[name])
    except KeyError:
        raise PocketError(f"unknown recipe {name!r}; known: {', '.join(RECIPE_MODULES)}") \
            from None


def run_folder(name: str) -> Path:
    from ..registry import pocket_home

    return pocket_home() / "recipes" / name


def _record_path(target: Path) -> Path:
    return target.with_name(target.name + ".built.json")


def _stat(target: Path) -> dict:
    # the ctime too, as the registry's records do: a file swapped in with its size and mtime
    # restored (cp -p, touch -r) has a new ctime, which no user call can set back
    st = target.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def built_record(target: Path) -> dict:
    """What was recorded when ``target`` was built or verified (sha256, size, time), or {}."""
    try:
        record = json.loads(_record_path(target).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def recipe_state(entry, target: Path) -> str:
    """``yes`` (built here and unchanged since), ``changed``, ``unverified`` (a file put
    there by other means) or ``no``."""
    try:
        stat = _stat(target)
    except OSError:
        return "no"
    try:
        record = json.loads(_record_path(target).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "unverified"
    if isinstance(record, dict) and "ctime_ns" not in record:
        del stat["ctime_ns"]  # a record written before ctimes were recorded
    if not isinstance(record, dict) or any(record.get(k) != v for k, v in stat.items()):
        return "changed"
    return "yes"


def _hash_and_record(entry, target: Path, *, quiet: bool) -> str:
    from ..data.download import atomic_file, sha256_file

    stat = _stat(target)  # as of before the hash: a change during it is seen later
    sha = sha256_file(target)
    record = {**stat, "sha256": sha, "recipe": entry.recipe,
              "matches_reference": entry.sha256 is None or sha == entry.sha256}
    # a temp file the models folder's sweep knows, written under its writer lock
    with atomic_file(_record_path(target)) as tmp:
        tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
    if entry.sha256 and sha != entry.sha256 and not quiet:
        print(f"[{entry.name}: sha256 {sha[:16]}… differs from the recorded run's "
              f"{entry.sha256[:16]}… (the teacher's answers depend on the engine's kernel "
              "level and training numerics on the CPU and torch version; the model card's "
              "measurements are of the recorded file)]", flush=True)
    return sha


def verify_built(entry, target: Path, *, quiet: bool = True) -> Path:
    if not target.is_file():
        raise ModelNotFoundError(not_built_message(entry))
    from ..formats.pocketfile import PocketFile

    pf = PocketFile(target)  # a damaged file is refused here, not at load time
    try:
        provenance = pf.json("provenance", {})
    finally:
        pf.close()
    differences = recipe_module(entry.recipe).provenance_differences(provenance)
    if differences != "":  # made by no recipe, or by another version of this one
        what = ("was not made by its recipe" if differences is None else
                f"was made by another version of its recipe ({differences})")
        raise PocketError(f"{target} {what}: `pocket pull {entry.name} --force` builds "
                          f"{entry.name}; load that file by its path instead")
    _hash_and_record(entry, target, quiet=quiet)
    return target


def not_built_message(entry) -> str:
    module = recipe_module(entry.recipe)
    return (f"{entry.name} is made by its recipe, not downloaded: `pocket pull {entry.name}` "
            f"builds it ({module.estimate(run_folder(entry.recipe))})")


def build_recipe(entry, target: Path, *, quiet: bool = False, force: bool = False) -> Path:
    """Run (or resume) ``entry``'s recipe in its run folder and install the deploy file at
    ``target``."""
    module = recipe_module(entry.recipe)
    folder = run_folder(entry.recipe)
    built = module.run(folder, progress=not quiet, force=force)
    tmp = target.with_name(target.name + ".partial")
    import shutil

    from ..data.download import writer_lock

    # under the models folder's writer lock: another pull's sweep of that folder takes a
    # .partial file no writer holds the lock for as stale, and deleted this one mid-copy
    with writer_lock(target.parent):
        try:
            shutil.copyfile(built, tmp)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
    _hash_and_record(entry, target, quiet=quiet)
    return target
