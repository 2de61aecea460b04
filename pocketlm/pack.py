"""Turn a source model (GGUF, Hugging Face folder, or a :class:`SourceModel`) into a deploy file.

The scheme: linear weights in group-wise INT4; the token embedding and an untied output head in
INT8 or INT4 (``embed_bits``); norms and biases in float32. ``keep_precision`` says what happens
to a linear weight that the source already holds quantized above 4 bits:

* ``None`` (the default, ``source``): it keeps its precision. GGUF Q5_0/Q5_1 weights are stored
  in INT5 and the wider quantized types (Q5_K, Q6_K, Q8_0) in INT8, so a GGUF runs as its
  publisher quantized it (small models such as Gemma 3 270M lose 12-25 % of perplexity when
  their 5-bit tensors are forced to 4 bits by plain rounding); float weights (a Hugging Face
  folder, an F16 GGUF) are quantized to INT4.
* ``False`` (``pocket pack --all-int4``): every linear weight in INT4, the smallest file.
* ``True`` (``pocket pack --keep-precision``): float weights too are kept above 4 bits, in INT8.

A source block whose grid the target layout can hold (GGUF Q4_0/Q4_1/Q4_K for INT4, Q5_0/Q5_1
for INT5 and Q8_0 for INT8, at group size 32) is imported without requantizing; everything else
is requantized from its float values.

The file is written to a temp file beside ``out`` and renamed into place (see
:mod:`pocketlm.formats.pocketfile`), while the folder's writer lock is held; temp files that a
killed pack to the same output name left there are removed first (see
:func:`pocketlm.registry.sweep_stale_temps` for the rule).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__
from .errors import PocketError, UnsupportedError
from .formats import SourceModel, open_source
from .formats.pocketfile import (
    TOKENIZER_ZLIB_TENSOR,
    check_writable,
    compress_tokenizer,
    write_pocket,
)
from .head_patch import PATCH, PATCH_IDS
from .progress import track
from .quant import (
    GROUP_SIZES,
    EncodedQuantTensor,
    QuantTensor,
    check_finite,
    check_quantizable,
    encode_as_source,
    find_zero_point,
    may_encode,
    quantize,
    relative_error,
)
from .registry import sweep_stale_temps, write_error_message, writer_lock

QUANT_SUFFIXES = ("attn.w_q.weight", "attn.w_k.weight", "attn.w_v.weight", "attn.w_o.weight",
                  "mlp.w_gate.weight", "mlp.w_up.weight", "mlp.w_down.weight")
EMBED_NAMES = ("embed.weight", "lm_head.weight")


@dataclass
class TensorReport:
    name: str
    source_dtype: str
    stored: str  # "int4" | "int5" | "int8" | "f32"
    how: str  # "lossless" | "requantized" | "calibrated" | "float" | "adapter"
    rel_error: float
    n_params: int
    group_size: int = 0
    nbytes: int = 0
    out_error: float | None = None  # relative output error on the calibration inputs
    zero_point: int | None = None  # stored without minimums (see pocketlm.quant)
    encoding: str | None = None  # stored in its source's own blocks (see pocketlm.quant)


@dataclass
class PackReport:
    path: Path
    file_bytes: int
    n_params: int
    quant_bits_per_weight: float  # over the quantized matrices, scales and minimums included
    file_bits_per_weight: float  # the whole file over all parameters
    seconds: float
    tensors: list[TensorReport] = field(default_factory=list)
    calibration: dict | None = None  # what calibrate.plan did: set, method, budget, seconds
    vocab: dict | None = None  # how the vocabulary was trimmed (pocketlm.vocab)
    # the default pack of a GGUF whose exact import came out larger than the GGUF: that
    # import's bytes and the GGUF's (the file is then the "source" budget's)
    larger_exact_import: tuple[int, int] | None = None

    def worst(self, n: int = 5) -> list[TensorReport]:
        quantized = [t for t in self.tensors if t.stored != "f32"]
        return sorted(quantized, key=lambda t: t.rel_error, reverse=True)[:n]

    def summary(self) -> str:
        lossless = sum(t.how == "lossless" for t in self.tensors)
        requant = sum(t.how in ("requantized", "calibrated") for t in self.tensors)
        adapters = [t for t in self.tensors if t.how in ("adapter", "head patch")]
        lines = [
            f"wrote {self.path} ({self.file_bytes / 1e6:.1f} MB, {self.n_params / 1e6:.1f} M "
            f"parameters) in {self.seconds:.1f} s",
            f"bits per weight: {self.quant_bits_per_weight:.2f} in quantized matrices, "
            f"{self.file_bits_per_weight:.2f} for the whole file",
            f"tensors: {lossless} imported losslessly, {requant} requantized, "
            f"{len(self.tensors) - lossless - requant - len(adapters)} kept in float",
        ]
        if self.larger_exact_import:
            exact, gguf = self.larger_exact_import
            lines.append(f"the exact import ({exact:,} bytes) is larger than the source "
                         f"GGUF ({gguf:,} bytes), so this default pack is the bit budget of "
                         "the source's size (--bits-per-weight source)")
        # a source's own blocks kept (q4_k, q6_k), and INT4 with coded scales (int4_c8), which
        # the pack rounds itself
        encoded = [t for t in self.tensors if t.encoding and t.encoding != "int4_c8"]
        if encoded:
            kinds = sorted({t.encoding for t in encoded})
            lines.append(f"{len(encoded)} tensors kept in their source's {' / '.join(kinds)} "
                         f"blocks ({sum(t.nbytes for t in encoded) / 1e6:.1f} MB), decoded at "
                         "load")
        coded = [t for t in self.tensors if t.encoding == "int4_c8"]
        if coded:
            lines.append(f"{len(coded)} tensors in INT4 with 8-bit coded scales (int4_c8, "
                         f"{sum(t.nbytes for t in coded) / 1e6:.1f} MB)")
        adapters = [t for t in adapters if t.how == "adapter"]
        if adapters:
            lines.append(f"LoRA adapters: {len(adapters) // 2} weights keep theirs beside them "
                         f"(float16, {sum(t.n_params for t in adapters) * 2 / 1e6:.1f} MB), "
                         "added at run time")
        if self.vocab:
            lines.append(vocab_summary(self.vocab))
        cal = self.calibration
        if cal:
            lines.append(
                f"calibration: {cal['method']} on {cal['set']['sequences']} sequences of "
                f"{cal['set']['seq_len']} tokens ({cal['set']['source']}, sha256 "
                f"{cal['set']['sha256'][:12]}), {cal['seconds']:.0f} s"
                + (f"; bit budget {cal['bits_per_weight']}" if cal.get('bits_per_weight')
                   else ""))
            cs = cal.get("channel_scaling")
            if cs:
                lines.append(f"channel scaling: {cs['scaled']} of {cs['sites']} sites scaled "
                             f"(mean alpha {cs['mean_alpha']}), estimated output error "
                             f"-{100 * cs['error_removed']:.1f} % before rounding")
            head = cal.get("head")
            patch = (head or {}).get("patch")
            if patch:
                lines.append(f"output head patch: {patch['rows']} rows in INT8 "
                             f"({patch['bytes'] / 1e6:.2f} MB, in the bit budget), top-1 "
                             f"agreement with the float head on a held-back quarter of the "
                             f"calibration set {100 * patch['top1_calibration']:.1f} %")
            if head and "top1_vs_float" in head:
                agree = ", ".join(f"{k} {100 * v:.1f} %" for k, v in
                                  head["top1_vs_float"].items())
                lines.append(f"output head {head['layout']}"
                             f"{' + patch' if patch else ''}: top-1 agreement with the float "
                             f"head on held-out text {agree}")
            elif head:
                lines.append(f"output head {head['layout']}: top-1 agreement with the float "
                             f"head not measured (no held-out text: {head['not_measured']})")
        lines.append("largest relative errors (||W_q - W|| / ||W||):")
        for t in self.worst():
            lines.append(f"  {t.rel_error:8.5f}  {t.name}  ({t.source_dtype} -> {t.stored}, "
                         f"{t.how})")
        return "\n".join(lines)

    def choices(self) -> str:
        """One line per quantized tensor: its layout, bits per weight, how it was made, its
        weight error and (calibrated) relative output error."""
        lines = ["tensor  source -> layout  bits/weight  how  weight-error  output-error"]
        for t in self.tensors:
            if t.stored == "f32":
                continue
            bpw = 8.0 * t.nbytes / max(t.n_params, 1)
            out = "" if t.out_error is None else f"  {t.out_error:.2e}"
            sym = "" if t.zero_point is None else f" zp{t.zero_point}"
            sym += "" if t.encoding is None else f" as {t.encoding}"
            lines.append(f"{t.name}  {t.source_dtype} -> {t.stored} g{t.group_size}{sym}  "
                         f"{bpw:.2f}  {t.how}  {t.rel_error:.5f}{out}")
        return "\n".join(lines)


# Bits per weight of GGUF source types, as far as the keep-precision policy cares.
_LOW_BIT_TYPES = {"Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS",
                  "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"}


_KIND_BITS = {"int4": 4, "int5": 5, "int8": 8}
# 4-bit GGUF types that import into pocketlm's INT4 layout without requantizing.
_INT4_IMPORTABLE = {"Q4_0", "Q4_1", "Q4_K"}
# 5-bit GGUF types that import into the INT5 layout without requantizing (keep_precision).
_INT5_IMPORTABLE = {"Q5_0", "Q5_1"}
# Unquantized source types: INT4 by default, INT8 only with keep_precision=True.
_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


def check_pack_options(group_size, embed_bits, keep_precision) -> None:
    """The packing options, checked before any work (and before they name a cache entry)."""
    # integers only: 4.0 equals 4 but names another cache entry (a second pack of one model)
    if not _integer(group_size) or group_size not in GROUP_SIZES:
        raise UnsupportedError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}, "
                               f"got {group_size!r}")
    if not _integer(embed_bits) or embed_bits not in (4, 8):
        raise UnsupportedError(f"embed_bits (--embed-bits) must be 4 or 8, got {embed_bits!r}")
    if keep_precision is not None and not isinstance(keep_precision, bool):
        raise UnsupportedError(f"keep_precision must be None, False or True, got "
                               f"{keep_precision!r}")


def _integer(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def precision_record(keep_precision: bool | None) -> bool | str:
    """``keep_precision`` as deploy files and benchmark rows record it ("source" for None)."""
    return "source" if keep_precision is None else keep_precision


def choose_bits(name: str, embed_bits: int, source_dtype: str = "F32",
                keep_precision: bool | None = None) -> int | None:
    """Bits to store a tensor with (None: keep it in float32). The embedding and output head
    take ``embed_bits``, except that a source holding them in a 4-bit type that imports
    losslessly stays in 4 bits (widening it to 8 would only requantize the same values and
    double their memory), and one holding them in Q5_0/Q5_1 stays in 5 (INT5, exact) unless
    ``keep_precision`` is False. Linear weights take 4 bits, unless ``keep_precision`` (module
    docstring) keeps the source's: 5 for Q5_0/Q5_1 (a lossless import), 8 for the rest."""
    if name in EMBED_NAMES:
        if source_dtype in _INT4_IMPORTABLE:
            return 4
        if embed_bits == 8 and keep_precision is not False and source_dtype in _INT5_IMPORTABLE:
            return 5  # imported exactly, in 6 bits a weight instead of INT8's 8.5
        return embed_bits
    if name.endswith(QUANT_SUFFIXES):
        if keep_precision is False or source_dtype in _LOW_BIT_TYPES:
            return 4
        if keep_precision is None and source_dtype in _FLOAT_TYPES:
            return 4
        return 5 if source_dtype in _INT5_IMPORTABLE else 8
    return None


def pack(source: str | Path | SourceModel, out: str | Path, *, group_size: int = 32,
         embed_bits: int = 8, keep_precision: bool | None = None, measure_error: bool = True,
         progress: bool = True, int4_search: bool = True, calib: str | Path | None = None,
         bits_per_weight: float | None = None, quant_method: str | None = None,
         awq: bool = False, vocab=None, reproducible: bool = False,
         head_patch: str | int | None = None) -> PackReport:
    """Quantize ``source`` and write the deploy file ``out``; returns a report.
    ``keep_precision``: None (keep the source's quantized types above 4 bits), False (all
    INT4) or True (also float weights in INT8), as in the module docstring.
    ``int4_search=False`` rounds requantized INT4 (and INT5) groups to their min-max grid (for
    weights trained against that grid, see :func:`pocketlm.train.lora.fake_quant_int4`).
    ``reproducible``: leave the packing time out of the provenance, so that the same source
    packs to the same bytes (a recipe's deploy file, whose sha256 the registry records).

    Calibration (:mod:`pocketlm.calibrate`): ``calib`` (``"default"``: the zh + en + code set
    of :mod:`pocketlm.calibdata`; or a UTF-8 text file) gathers activation statistics and
    quantizes every requantized tensor by ``quant_method`` (default ``"gptq"``);
    ``bits_per_weight`` (4.25-8, implies ``calib="default"`` when no ``calib`` is given)
    chooses each tensor's layout (INT4 / INT5 / INT8, group 32-128, or the source's own grid)
    to meet that average over all quantized tensors, scales included. ``awq``: activation-aware
    channel scaling before rounding (:mod:`pocketlm.awq`; implies ``calib="default"`` too).
    ``head_patch`` (with ``bits_per_weight``): ``"off"`` (None, the default), ``"auto"`` or a
    number of rows for an INT4 head's patch (:mod:`pocketlm.head_patch`,
    :func:`pocketlm.calibrate.plan`).

    ``vocab`` (a :class:`pocketlm.vocab.VocabSpec`) trims the vocabulary to an app's languages
    before anything else (:mod:`pocketlm.vocab`: the kept pieces tokenize exactly as before)."""
    check_pack_options(group_size, embed_bits, keep_precision)
    if vocab is not None:
        from .vocab import VocabSpec

        if not isinstance(vocab, VocabSpec):
            raise PocketError(f"vocab must be a VocabSpec, got {type(vocab).__name__}")
    if not isinstance(awq, bool):
        raise PocketError(f"awq must be True or False, got {awq!r}")
    if awq and calib is None:
        calib = "default"
    if bits_per_weight is not None:
        from .calibrate import check_bits_per_weight

        bits_per_weight = check_bits_per_weight(bits_per_weight)
        calib = "default" if calib is None else calib
        by_hand = [flag for flag, given in (
            ("--group-size", group_size != 32), ("--embed-bits", embed_bits != 8),
            ("--keep-precision" if keep_precision else "--all-int4", keep_precision is not None))
            if given]
        if by_hand:  # they were ignored, and recorded in the file as if they were applied
            raise UnsupportedError(f"{', '.join(by_hand)} choose layouts by hand; "
                                   "--bits-per-weight chooses each tensor's layout itself "
                                   "(group size and embedding bits included): give one or the "
                                   "other")
    if head_patch is not None:
        from .calibrate import check_head_patch_option

        head_patch = check_head_patch_option(head_patch)
        if head_patch != 0 and bits_per_weight is None:
            raise UnsupportedError("--head-patch needs --bits-per-weight: a patch is part of a "
                                   "bit budget's INT4 head")
    if quant_method is not None:
        from .calibrate import METHODS

        if quant_method not in METHODS:
            raise UnsupportedError(f"quantization method {quant_method!r} is not supported; "
                                   f"choose one of {', '.join(METHODS)}")
        if calib is None:
            raise UnsupportedError("a quantization method needs calibration: pass --calib "
                                   "(or --bits-per-weight)")
    if calib is not None and calib != "default":
        if not isinstance(calib, (str, os.PathLike)):  # Path(5): a bare TypeError
            raise PocketError(f"calib must be 'default' or a text file's path, got "
                              f"{type(calib).__name__}")
        calib = Path(calib)
        if not calib.is_file():
            what = "is a folder, expected a text file" if calib.is_dir() else "no such file"
            raise PocketError(f"--calib {calib}: {what}")
    out = Path(out)
    made = [folder for folder in out.parents if not folder.exists()]  # nearest first
    try:
        return _pack_to(source, out, calib=calib, bits_per_weight=bits_per_weight,
                        group_size=group_size, embed_bits=embed_bits,
                        keep_precision=keep_precision, measure_error=measure_error,
                        progress=progress, int4_search=int4_search,
                        quant_method=quant_method, awq=awq, vocab=vocab,
                        reproducible=reproducible, head_patch=head_patch)
    except BaseException:  # a failed pack leaves no folders it made either
        for folder in made:
            with contextlib.suppress(OSError):  # one that holds something stays
                folder.rmdir()
        raise


def _pack_to(source, out: Path, *, calib, bits_per_weight, group_size, embed_bits,
             keep_precision, measure_error, progress, int4_search, quant_method, awq,
             vocab, reproducible, head_patch) -> PackReport:
    """:func:`pack` once its options are checked: the exact import, or a budget's pack."""
    check_writable(out)  # before the quantization, not after it
    sweep_stale_temps(out.parent, out.name)  # what a killed pack to the same file left
    options = dict(group_size=group_size, embed_bits=embed_bits,
                   keep_precision=keep_precision, measure_error=measure_error,
                   progress=progress, int4_search=int4_search, quant_method=quant_method,
                   awq=awq, vocab=vocab, reproducible=reproducible, head_patch=head_patch)
    # the default is the exact import, no larger than the source GGUF; where that import is
    # larger (Q5_K and an untied Q6_K embedding in INT8, Q3_K / Q2_K in INT4), the bit budget
    # of the source's own size is the default instead. A few kilobytes of header over the
    # GGUF (EXACT_SLACK) are not worth requantizing exact tensors for.
    gguf_bytes = (_gguf_bytes(source) if calib is None and keep_precision is None
                  and (group_size, embed_bits) == (32, 8) and vocab is None and int4_search
                  else None)
    with writer_lock(out.parent):
        if gguf_bytes is None:
            return _pack(source, out, calib=calib, bits_per_weight=bits_per_weight, **options)
        # the exact import stays in its temporary file: it becomes OUT only if it is kept, so
        # that a pack stopped while packing again leaves no OUT behind
        held: list[Path] = []
        try:
            report = _pack(source, out, calib=calib, bits_per_weight=bits_per_weight,
                           hold=held, **options)
            if report.file_bytes > gguf_bytes * (1 + EXACT_SLACK):
                if progress:
                    print(f"[the exact import is {report.file_bytes:,} bytes, larger than "
                          f"the source GGUF's {gguf_bytes:,}: packing again with the bit "
                          "budget of the source's size (--bits-per-weight source), "
                          "calibrated]", file=sys.stderr, flush=True)
                try:
                    budgeted = _pack(source, out, calib="default", bits_per_weight="source",
                                     **options)
                except UnsupportedError as e:  # below the smallest layouts: a model too
                    # small for the deploy file's fixed overhead (the exact import is kept)
                    if progress:
                        print(f"[no smaller pack: {e}; the exact import is kept]",
                              file=sys.stderr, flush=True)
                else:
                    budgeted.larger_exact_import = (report.file_bytes, gguf_bytes)
                    return budgeted
            os.replace(held[0], out)
            return report
        finally:
            for tmp in held:
                tmp.unlink(missing_ok=True)


EXACT_SLACK = 0.01  # how far (a share of the GGUF) an exact import may exceed it


def _gguf_bytes(source) -> int | None:
    """The size of the GGUF file ``source`` is (a path, or a model opened from one), else
    None."""
    if isinstance(source, SourceModel):
        prov = source.provenance or {}
        size = prov.get("source_size")
        return size if prov.get("source_format") == "gguf" and isinstance(size, int) else None
    from .formats import sniff

    path = Path(source)
    try:
        return path.stat().st_size if path.is_file() and sniff(path) == "gguf" else None
    except (OSError, PocketError):
        return None


def _pack(source: str | Path | SourceModel, out: Path, *, group_size: int, embed_bits: int,
          keep_precision: bool | None, measure_error: bool, progress: bool,
          int4_search: bool, calib=None, bits_per_weight=None,
          quant_method=None, awq: bool = False, vocab=None,
          reproducible: bool = False, head_patch=None, hold: list[Path] | None = None
          ) -> PackReport:
    t0 = time.time()
    model = source if isinstance(source, SourceModel) else open_source(source)
    if vocab is not None:
        from .vocab import trim_source

        model = trim_source(model, vocab, progress=progress)
    if awq and model.adapters:
        # the scales are folded into the weights and norms; LoRA adapters kept beside the
        # weights would still read the unscaled input (A x, not A (x / s)): another model
        raise UnsupportedError("channel scaling (--awq) cannot be combined with LoRA adapters "
                               "kept beside the weights (--keep-lora): drop one of them")
    planned: dict[str, tuple[QuantTensor, str, float | None, float | None]] = {}
    scaled: dict[str, np.ndarray] = {}  # float tensors that channel scaling changed
    calibration = None
    if calib is not None:
        from .calibrate import DEFAULT_METHOD, plan

        # weights beyond float16's range overflow a layout's steps: each planned tensor's
        # steps are checked below (_check_steps), which names it, instead of numpy's warnings
        with np.errstate(over="ignore", invalid="ignore"):
            planned, calibration, scaled = plan(
                model, calib=calib, method=quant_method or DEFAULT_METHOD,
                bits_per_weight=bits_per_weight,
                default_bits=lambda name, st: choose_bits(name, embed_bits, st.dtype,
                                                          keep_precision),
                group_size=group_size, progress=progress, awq=awq,
                head_patch=0 if head_patch is None else head_patch)
    arrays: list[tuple[str, np.ndarray]] = []
    layouts: dict[str, Any] = {}
    reports: list[TensorReport] = []
    n_params = 0
    q_bytes = q_params = 0

    stored_embed_bits = None  # what the embedding / head are stored in (see choose_bits)
    linear_kinds = {"int4"}  # what the linear weights are stored in (for the scheme's name)
    names = list(model.tensors)
    bar = track(names, "packing", "tensor", enabled=progress)
    for name in bar:
        st = model.tensors[name]
        count = int(np.prod(st.shape))
        n_params += count
        bits = choose_bits(name, embed_bits, st.dtype, keep_precision)
        if bits is None:
            values = scaled.pop(name) if name in scaled else st.to_float()
            check_finite(name, values)
            arrays.append((name, np.ascontiguousarray(values, dtype=np.float32)))
            reports.append(TensorReport(name, st.dtype, "f32", "float", 0.0, count))
            continue
        ref = None
        out_err = weight_err = None
        if name in planned:
            qt, how, out_err, weight_err = planned.pop(name)
        else:
            qt = st.to_quant(bits, group_size)
            how = "lossless"
        if qt is None:
            check_quantizable(tuple(st.shape), group_size, name)  # names the tensor on error
            ref = st.to_float()
            check_finite(name, ref)
            with np.errstate(over="ignore", invalid="ignore"):  # refused by name just below
                qt = quantize(ref, bits, group_size, search=int4_search)
            how = "requantized"
        _check_steps(name, qt, how)
        err = 0.0
        if weight_err is not None:  # channel scaling changed it: measured against what was
            err = weight_err        # rounded, not against the unscaled source
        elif measure_error:
            ref = st.to_float() if ref is None else ref
            err = _chunked_rel_error(ref, qt)
        del ref
        if name in EMBED_NAMES:
            stored_embed_bits = max(stored_embed_bits or 0, _KIND_BITS[qt.kind])
        # the source's own K-quant blocks, where they are smaller and decode to these bits (a
        # calibrated tensor may come encoded already: INT4 with coded scales)
        if isinstance(qt, EncodedQuantTensor):
            enc = qt
        else:
            enc = encode_as_source(qt, st.dtype, st.raw()) if st.raw is not None and \
                may_encode(name, model.config.tie_embeddings) else None
        zp = None if enc is not None else find_zero_point(qt)  # minimums -zp * scale: implicit
        if zp is not None:
            qt.zero_point = zp
        if enc is not None:
            qt = enc
            arrays.extend((name + suffix, a) for suffix, a in enc.stored.items())
        else:
            arrays.append((name, qt.qweight))
            arrays.append((name + ".scales", qt.scales))
            if qt.mins is not None and zp is None:
                arrays.append((name + ".mins", qt.mins))
        layouts[name] = {"kind": qt.kind, "shape": list(qt.shape), "group_size": qt.group_size,
                         **({"zero_point": zp} if zp is not None else {}),
                         **({"encoding": enc.encoding} if enc is not None else {})}
        if name.endswith(QUANT_SUFFIXES):
            linear_kinds.add(qt.kind)
        q_bytes += qt.nbytes
        q_params += count
        reports.append(TensorReport(name, st.dtype, qt.kind, how, err, count,
                                    qt.group_size, qt.nbytes, out_err, zp,
                                    qt.encoding if isinstance(qt, EncodedQuantTensor) else None))

    if PATCH in planned:  # the INT4 head's patch (pocketlm.head_patch): INT8 rows, their ids
        qt = planned.pop(PATCH)[0]
        ids = np.ascontiguousarray(planned.pop(PATCH_IDS)[0], np.int32)
        arrays += [(PATCH, qt.qweight), (PATCH + ".scales", qt.scales), (PATCH_IDS, ids)]
        layouts[PATCH] = {"kind": qt.kind, "shape": list(qt.shape),
                          "group_size": qt.group_size}
        q_bytes += qt.nbytes + ids.nbytes  # in the budget: bytes over the head's weights
        head = "lm_head.weight" if "lm_head.weight" in model.tensors else "embed.weight"
        reports.append(TensorReport(PATCH, model.tensors[head].dtype, qt.kind, "head patch", 0.0,
                                    qt.shape[0] * qt.shape[1], qt.group_size,
                                    qt.nbytes + ids.nbytes))
    for stem, (a, b) in sorted((model.adapters or {}).items()):  # LoRA kept beside: float16
        for suffix, t in ((".lora_a", a), (".lora_b", b)):
            t16 = np.asarray(t, np.float32).astype(np.float16)
            if not np.isfinite(t16).all():
                raise PocketError(f"adapter {stem}{suffix} does not fit float16 (values beyond "
                                  "65504)")
            arrays.append((stem + suffix, t16))
            reports.append(TensorReport(stem + suffix, "F32", "f16", "adapter", 0.0,
                                        int(t16.size)))
            n_params += int(t16.size)
    # compressed: a vocabulary's JSON shrinks to ~30 % (qwen2.5's 6.3 MB to 1.9)
    arrays.append((TOKENIZER_ZLIB_TENSOR, compress_tokenizer(model.tokenizer.to_json())))
    if model.vocab_source_ids is not None:
        from .vocab import SOURCE_IDS_TENSOR

        arrays.append((SOURCE_IDS_TENSOR, np.asarray(model.vocab_source_ids, dtype=np.int32)))
    metadata = {
        "config": model.config.to_dict(),
        "generation": model.generation.to_dict(),
        "chat_template": model.chat_template or "",
        "quant": {"scheme": ("budget" if bits_per_weight else f"int4-g{group_size}") + "".join(
                      f"+{k}" for k in ("int5", "int8") if k in linear_kinds),
                  "group_size": group_size, "embed_bits": stored_embed_bits or embed_bits,
                  "keep_precision": precision_record(keep_precision),
                  "tensors": layouts,
                  # a reproducible file leaves out the seconds calibrating took, as it
                  # leaves out the packing time (the report still states them)
                  **({"calibration": {k: v for k, v in calibration.items()
                                      if not (reproducible and k == "seconds")}}
                     if calibration else {})},
        **({"vocab": model.vocab} if model.vocab is not None else {}),
        **({"adapter": model.adapter} if model.adapters else {}),
        "provenance": {**model.provenance, "pocketlm_version": __version__,
                       **({} if reproducible else {
                           "packed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})},
    }
    try:
        size = write_pocket(out, arrays, metadata, hold=hold)
    except OSError as exc:  # a full disk, an I/O error: name the file being written
        raise PocketError(write_error_message(
            out, exc, f"free some space in {out.parent.resolve()} or write to another folder")) from None
    return PackReport(
        path=out, file_bytes=size, n_params=n_params,
        quant_bits_per_weight=8.0 * q_bytes / max(q_params, 1),
        file_bits_per_weight=8.0 * size / max(n_params, 1),
        seconds=time.time() - t0, tensors=reports, calibration=calibration,
        vocab=model.vocab,
    )


def vocab_summary(v: dict) -> str:
    """One line on a trimmed vocabulary (pack report, ``pocket inspect``)."""
    langs = ",".join(v.get("languages") or []) or "-"
    line = (f"vocabulary: {v['kept']:,} of {v['source_vocab']:,} pieces kept "
            f"({100 * v['kept'] / max(v['source_vocab'], 1):.1f} %; {v['rule']} rule, "
            f"languages {langs}")
    if v.get("backfilled"):
        line += (f", {v['backfilled']:,} of them backfilled by the source's ranks "
                 f"(--vocab-backfill {v.get('backfill')})")
    if v.get("size"):
        line += f", capped at {v['size']:,}"
    if v.get("corpus"):
        line += f", app text {v['corpus']}"
    line += ")"
    costs = v.get("reference_cost")
    if costs:
        line += ("; a reference multilingual text: "
                 f"{100 * costs['lines_costlier']:.0f} % of lines cost more tokens "
                 f"(+{100 * costs['extra_tokens']:.1f} % tokens)")
    return line


def _check_steps(name: str, qt: QuantTensor, how: str) -> None:
    """Refuse a tensor whose float16 scales or minimums are not finite (the engine would
    compute NaN with them): weights beyond float16's range (a minimum is a weight, a scale
    a fifteenth of a group's range), or a source's blocks that hold them."""
    steps = [qt.scales] + ([] if qt.mins is None else [qt.mins])
    if all(np.isfinite(a).all() for a in steps):
        return
    if how == "lossless":
        raise PocketError(f"{name}: the source's quantized blocks hold NaN or infinite scales "
                          "(a corrupt file); nothing was written")
    raise UnsupportedError(f"{name}: its weights exceed what {qt.kind.upper()}'s float16 group "
                           "scales and minimums can hold (65504); nothing was written")


def _chunked_rel_error(ref: np.ndarray, qt: QuantTensor, rows: int = 8192) -> float:
    num = den = 0.0
    for r0 in range(0, qt.shape[0], rows):
        sel = slice(r0, r0 + rows)
        a = ref[sel].astype(np.float64)
        num += float(((qt.dequantize(sel) - a) ** 2).sum())
        den += float((a * a).sum())
    return float(np.sqrt(num / den)) if den > 0 else float(np.sqrt(num))


__all__ = ["pack", "PackReport", "TensorReport", "choose_bits", "relative_error"]
