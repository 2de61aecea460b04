"""The packed-file cache: the deploy file that :func:`pocketlm.load` runs for a source model.

A ``.pocket`` file runs as it is. A GGUF file, Hugging Face folder or training run is packed
(:func:`pocketlm.pack.pack`) into ``$POCKET_HOME/packed`` on first use, one entry per source
and packing options, and packed again only when the source changes or :data:`PACK_REVISION`
says that packing now writes something better; the entry a new one replaces is removed.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from pathlib import Path

from . import pack
from .errors import PocketError
from .formats import sniff
from .registry import default_pack_bits, make_home_dir, pocket_home

# Bumped when packing writes something better for the same source (a leaner tokenizer, a new
# layout), so that cached deploy files are rebuilt once instead of being used forever.
# 4-5: the default keeps a GGUF's 5-8-bit tensors (a Q5_0 embedding in INT5); 6: format version 2
# (the header checksum), so that cached packs get a protected header once; 7: the generation
# defaults a GGUF's general.sampling.* keys or a Hugging Face folder's generation_config.json
# carry; 8: INT4 / INT5 tensors whose minimums are -8 / -16 times the scale (GGUF Q4_0, Q5_0)
# are stored without them; 9: format version 4, GGUF Q4_K / Q6_K tensors kept in their own
# blocks and the tokenizer compressed (qwen2.5-0.5b's default pack: 507.8 MB -> 487.4); 10: a
# GGUF whose exact import is over 1 % larger than itself (Q5_K / Q3_K / Q2_K tensors, an
# untied Q6_K embedding) is packed to the bit budget of its own size
PACK_REVISION = 10


def _source_state(src: Path) -> str:
    """The size and modification time of a source file; of a folder, those of every file at
    its top level, where the readers find everything they read (a folder's own time changes
    only when entries are added, removed or renamed: a config.json edited in place kept the
    old pack). What lies deeper (logs, checkpoints of a run, a hub cache) is not the model."""
    if not src.is_dir():
        st = src.stat()
        return f"{st.st_size}|{st.st_mtime_ns}"
    parts = []
    with os.scandir(src) as entries:
        for entry in entries:
            try:
                if entry.is_file():
                    st = entry.stat()
                    parts.append(f"{entry.name}|{st.st_size}|{st.st_mtime_ns}")
            except OSError:  # gone since it was listed, or a broken link
                continue
    return hashlib.sha256("\n".join(sorted(parts)).encode()).hexdigest()


def packed_cache_path(src: Path, group_size: int, embed_bits: int,
                      keep_precision: bool | None = None, *, name: str | None = None,
                      bits_per_weight: str | None = None) -> Path:
    """Where ``load`` caches the deploy file packed from ``src`` with these options.

    The name is ``{name}-{options}-{source}-{state}.pocket``: ``source`` digests the source's
    path and the options, ``state`` also its size, modification time and PACK_REVISION, so a
    source that changes (a training run saved again, a file replaced) gets a new entry, and
    :func:`ensure_packed` removes the entries it replaces (same ``source``, another ``state``).
    """
    # keep-precision packs store Q5_0/Q5_1 weights in INT5 (older ones: INT8): a new tag, so
    # that those older caches are not reused
    tag = f"g{group_size}-e{embed_bits}" + {None: "", True: "-keep5", False: "-int4"}[
        keep_precision] + (f"-b{bits_per_weight}" if bits_per_weight else "")
    source = hashlib.sha256(f"{src.resolve()}|{tag}".encode()).hexdigest()[:8]
    state = hashlib.sha256(
        f"{source}|{_source_state(src)}|r{PACK_REVISION}".encode()).hexdigest()[:12]
    return pocket_home() / "packed" / f"{name or src.stem}-{tag}-{source}-{state}.pocket"


def ensure_packed(path: str | Path, *, group_size: int = 32, embed_bits: int = 8,
                  keep_precision: bool | None = None, quiet: bool = True) -> Path:
    """The deploy file for the local model at ``path``: a ``.pocket`` file as it is; a GGUF
    file, Hugging Face folder or training run packed with these options into the cache on
    first use (progress shown unless ``quiet``). A registry model packed with the default
    options takes its registry bit budget (:func:`pocketlm.registry.default_pack_bits`: a
    calibrated pack, minutes the first time)."""
    pack.check_pack_options(group_size, embed_bits, keep_precision)
    path = Path(path)
    kind = sniff(path)
    if kind == "pocket":
        if (group_size, embed_bits, keep_precision) != (32, 8, None):
            # a deploy file is run as it was packed: the options were silently ignored
            raise PocketError(f"{path} is a deploy file, packed already: group_size, "
                              "embed_bits and keep_precision apply when a GGUF or Hugging "
                              "Face source is packed (pack its source with them)")
        return path
    key = path
    if kind == "run":
        from .formats import run_checkpoint

        key = run_checkpoint(key)
    bits = None
    if (group_size, embed_bits, keep_precision) == (32, 8, None) and kind in ("gguf", "trimmed"):
        bits = default_pack_bits(path)
    cached = packed_cache_path(key, group_size, embed_bits, keep_precision,
                               name=path.name if kind == "run" else None, bits_per_weight=bits)
    if not cached.is_file():
        make_home_dir(cached.parent)
        pack.pack(path, cached, group_size=group_size, embed_bits=embed_bits,
                  keep_precision=keep_precision, progress=not quiet, bits_per_weight=bits)
        _drop_replaced_packs(cached)
    return cached


def _drop_replaced_packs(cached: Path) -> None:
    """Remove the cache entries that ``cached`` replaces: the same source and options packed
    from an earlier state of the source (a process still reading one keeps its mapping)."""
    prefix = cached.name.rsplit("-", 1)[0]
    pattern = re.compile(re.escape(prefix) + r"-[0-9a-f]{12}\.pocket")
    for old in cached.parent.glob(glob.escape(prefix) + "-*.pocket"):
        if old.name != cached.name and pattern.fullmatch(old.name):
            try:
                old.unlink()
            except OSError:
                pass


__all__ = ["PACK_REVISION", "ensure_packed", "packed_cache_path"]
