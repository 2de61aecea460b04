"""Hugging Face folders from deploy files: ``pocket export SRC --to hf -o DIR``.

The folder is what ``transformers`` (``AutoModelForCausalLM.from_pretrained(DIR)``), vLLM and
the converters built on them read, and what ``pocket pack DIR`` imports back
(:mod:`pocketlm.formats.hf` is this writer's inverse):

=========================  ====================================================================
file                       contents
=========================  ====================================================================
model.safetensors          every weight, dequantized to bfloat16 (default) or float32
config.json                architecture, model_type and every hyper-parameter the loader needs
generation_config.json     BOS / EOS / padding ids and the model's own generation defaults
tokenizer.json             the tokenizer the deploy file runs (a trimmed vocabulary stays trimmed)
tokenizer_config.json      chat template, BOS / EOS / padding / unknown tokens, whether BOS is added
special_tokens_map.json    the special tokens by role
README.md                  provenance: source file and sha256, quantization, calibration, licence
=========================  ====================================================================

Architectures. Each pocketlm family is written as the Hugging Face model that computes the
same function (:data:`ARCHITECTURES`); a config whose switches that model cannot express is
refused, never approximated:

=========  ===================  ==============================================================
family     written as           notes
=========  ===================  ==============================================================
llama      LlamaForCausalLM     with q/k/v biases: Qwen2ForCausalLM (Llama's bias is on o too)
qwen2      Qwen2ForCausalLM     without biases: LlamaForCausalLM
qwen3      Qwen3ForCausalLM
pocket     Qwen3ForCausalLM     llama + QK-norm + tied head is Qwen3's computation
gemma3     Gemma3ForCausalLM    model_type ``gemma3_text``; norms stored as ``weight - 1``
=========  ===================  ==============================================================

Weights. Quantized tensors are dequantized a block of rows at a time and written as they come,
so memory holds one block's float copy, never a whole model's. bfloat16 is float32 rounded to
nearest, ties to even (:func:`bfloat16_bits`); a deploy file's INT4 weight (a float16 scale and
minimum per group) is not exact in bfloat16, so ``--dtype float32`` is the lossless choice. The
safetensors container is written here (8-byte little-endian header length, JSON header, raw
data), one tensor after another.

Tokenizer. A byte-level BPE (or any Hugging Face tokenizer the file carries) is written as it
is; a SentencePiece vocabulary becomes a Hugging Face BPE whose merges are every split of every
normal piece, ranked by the piece's score (:mod:`pocketlm.formats.gguf_vocab` explains why this
is SentencePiece's BPE), with byte fallback. The tokenizer adds the BOS token itself (its
post-processor) when the model's does.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..config import GenerationDefaults, ModelConfig
from ..errors import FormatError, PocketError, UnsupportedError
from ..formats.hf import GLOBAL_NAMES, LAYER_NAMES_GEMMA, LAYER_NAMES_STD
from ..formats.pocketfile import PocketFile
from ..head_patch import PatchedHead, patched_head_for_export
from ..progress import track
from ..quant import QuantTensor
from ..tokenizer import DROPPED_BYTE, SpmTokenizer, Tokenizer
from . import atomic_folder, refuse_adapters

__all__ = ["ARCHITECTURES", "DTYPES", "HFExportReport", "bfloat16_bits", "export_hf",
           "hf_config", "hf_generation_config", "hf_target", "hf_tensor_names", "hf_tokenizer",
           "special_tokens", "write_safetensors"]

# --dtype -> safetensors dtype name
DTYPES = {"bfloat16": "BF16", "float32": "F32"}
WEIGHTS_FILE = "model.safetensors"
CHUNK_VALUES = 1 << 22  # float values dequantized at once (16 MB): bounds the resident set

# Hugging Face model -> (architecture class, model_type, the runtime switches it computes with)
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "llama",
              {"qkv_bias": False, "qk_norm": False, "sandwich_norms": False,
               "activation": "silu"}),
    "qwen2": ("Qwen2ForCausalLM", "qwen2",
              {"qkv_bias": True, "qk_norm": False, "sandwich_norms": False,
               "activation": "silu"}),
    "qwen3": ("Qwen3ForCausalLM", "qwen3",
              {"qkv_bias": False, "qk_norm": True, "sandwich_norms": False,
               "activation": "silu"}),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text",
               {"qkv_bias": False, "qk_norm": True, "sandwich_norms": True,
                "activation": "gelu_tanh"}),
}
# pocketlm family -> the Hugging Face model written for it
FAMILY_TARGET = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "pocket": "qwen3",
                 "gemma3": "gemma3"}
# tokens a padding id is taken from, in order of preference (else the first EOS token)
PAD_TEXTS = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")


@dataclass
class HFExportReport:
    """What :func:`export_hf` wrote, how long it took and the memory it needed."""

    path: Path
    architecture: str
    dtype: str
    n_params: int
    files: dict[str, int] = field(default_factory=dict)  # file name -> bytes
    seconds: float = 0.0
    peak_rss: int | None = None  # bytes: the process's peak resident set (getrusage)

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())

    def summary(self) -> str:
        peak = f", peak memory {self.peak_rss / 1e6:.0f} MB" if self.peak_rss else ""
        lines = [f"wrote {self.path} ({self.architecture}, {self.dtype}, "
                 f"{self.n_params / 1e6:.1f} M parameters): {len(self.files)} files, "
                 f"{self.nbytes / 1e6:.1f} MB in {self.seconds:.1f} s{peak}"]
        lines.append("  " + ", ".join(f"{name} {_size(n)}" for name, n in self.files.items()))
        return "\n".join(lines)


def export_hf(source: str | Path, out: str | Path, *, dtype: str = "bfloat16",
              progress: bool = True) -> HFExportReport:
    """Write the deploy file ``source`` as the Hugging Face folder ``out`` (see the module
    docstring); the folder appears under its name only once complete. ``out`` is replaced if
    it exists: callers check first (:func:`pocketlm.export.check_output`)."""
    from ..api import file_config_and_tokenizer
    from ..chat import FAMILY_TEMPLATES
    from ..formats import sha256_file

    start = time.perf_counter()
    if dtype not in DTYPES:
        raise PocketError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    source, out = Path(source), Path(out)
    pf = PocketFile(source)
    refuse_adapters(pf, source)
    config, tokenizer = file_config_and_tokenizer(pf)
    weights = pf.weights()
    # the head patch's rows written over the head's (what the runtime computes)
    config = patched_head_for_export(weights, config)
    config_json = hf_config(config, tokenizer, dtype=dtype)  # refuses before anything is written
    names = hf_tensor_names(config)
    extra = sorted(set(weights) - set(names))
    if extra:
        raise FormatError(f"{source}: tensors the config does not call for: {extra[:5]}; the "
                          "file is corrupt or its config was edited: repack the model")
    tok_json = hf_tokenizer(tokenizer)
    template = pf.text("chat_template") or FAMILY_TEMPLATES.get(config.arch)
    try:
        generation = GenerationDefaults.from_dict(pf.json_object("generation", {}))
    except PocketError as exc:
        if str(source) in str(exc):
            raise
        raise type(exc)(f"{source}: metadata field 'generation': {exc}") from None
    tokens = special_tokens(tokenizer, tok_json)
    provenance = {
        "file": source.name, "sha256": sha256_file(source),
        "provenance": pf.json_object("provenance", {}), "quant": pf.json_object("quant", {}),
        "vocab": pf.json_object("vocab", {}) or None,
    }

    files: dict[str, int] = {}
    with atomic_folder(out) as tmp:
        files[WEIGHTS_FILE] = write_safetensors(
            tmp / WEIGHTS_FILE, _tensors(config, weights, names, pf), DTYPES[dtype],
            progress=progress)
        texts = {
            "config.json": _dumps(config_json),
            "generation_config.json": _dumps(hf_generation_config(generation, tokenizer)),
            "tokenizer.json": json.dumps(tok_json, ensure_ascii=False),
            "tokenizer_config.json": _dumps(_tokenizer_config(tokens, tokenizer, template,
                                                              config)),
            "special_tokens_map.json": _dumps({k: v for k, v in tokens.items() if v}),
            "README.md": _readme(out.name, config_json, dtype, provenance, config),
        }
        for name, text in texts.items():
            data = text.encode("utf-8")
            (tmp / name).write_bytes(data)
            files[name] = len(data)
    return HFExportReport(path=out, architecture=config_json["architectures"][0], dtype=dtype,
                          n_params=config.n_params(), files=files,
                          seconds=time.perf_counter() - start, peak_rss=peak_rss())


# -- config ----------------------------------------------------------------------------------
def hf_target(config: ModelConfig) -> str:
    """The key of :data:`ARCHITECTURES` that computes what ``config`` computes, or an
    UnsupportedError naming the switch no Hugging Face model of the family has."""
    target = FAMILY_TARGET[config.arch]
    if target == "llama" and config.qkv_bias:
        target = "qwen2"  # Llama's attention_bias also puts a bias on the output projection
    elif target == "qwen2" and not config.qkv_bias:
        target = "llama"
    arch, _, switches = ARCHITECTURES[target]
    wrong = [f"{k}={getattr(config, k)!r} (it computes {k}={v!r})"
             for k, v in switches.items() if getattr(config, k) != v]
    if target == "gemma3":
        if not math.isclose(config.embed_scale, math.sqrt(config.d_model), rel_tol=1e-6):
            wrong.append(f"embed_scale={config.embed_scale:g} (it scales embeddings by "
                         f"sqrt(d_model) = {math.sqrt(config.d_model):g})")
    else:
        if config.embed_scale != 1.0:
            wrong.append(f"embed_scale={config.embed_scale:g} (it does not scale embeddings)")
        if config.attn_scale is not None and not math.isclose(
                config.attn_scale, 1 / math.sqrt(config.head_dim), rel_tol=1e-6):
            wrong.append(f"attn_scale={config.attn_scale:g} (it uses 1/sqrt(head_dim))")
        if "sliding" in config.layer_types:
            wrong.append("sliding-window layers (written for gemma3 only)")
    if wrong:
        from .gguf import gguf_architecture

        try:  # name the other target only where it takes the model
            gguf_architecture(config)
            other = "export it with --to gguf or keep the .pocket file"
        except UnsupportedError:
            other = "keep the .pocket file (--to gguf cannot write it either)"
        raise UnsupportedError(f"cannot write this {config.arch} model as {arch}: "
                               f"{'; '.join(wrong)}; {other}")
    return target


def hf_config(config: ModelConfig, tokenizer: Tokenizer | None = None, *,
              dtype: str = "bfloat16") -> dict[str, Any]:
    """``config.json`` for ``config`` (the inverse of
    :func:`pocketlm.formats.hf.config_from_hf`)."""
    target = hf_target(config)
    arch, model_type, _ = ARCHITECTURES[target]
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_context,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if target == "gemma3":
        types = ["sliding_attention" if t == "sliding" else "full_attention"
                 for t in config.layer_types]
        scalar = config.scale ** -2  # the model scales scores by query_pre_attn_scalar ** -0.5
        out.update({
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6
            else scalar,
            "sliding_window": config.sliding_window,
            "layer_types": types,
            "rope_local_base_freq": (config.rope_theta_local if config.rope_theta_local
                                     is not None else config.rope_theta),
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        })
        pattern = _sliding_pattern(types)
        if pattern is not None:
            out["sliding_window_pattern"] = pattern  # what loaders before layer_types read
    else:
        out.update({"hidden_act": "silu", "mlp_bias": False})
        if target in ("qwen2", "qwen3"):
            out.update({"use_sliding_window": False, "sliding_window": None,
                        "max_window_layers": config.n_layers,
                        "layer_types": ["full_attention"] * config.n_layers})
        else:
            out["pretraining_tp"] = 1
    if tokenizer is not None:
        out.update(_token_ids(tokenizer))
    return out


def _sliding_pattern(types: list[str]) -> int | None:
    """N when every N-th layer is global and the others sliding (Gemma 3's 6), else None."""
    if "full_attention" not in types:
        return None
    n = types.index("full_attention") + 1
    expect = ["full_attention" if (i + 1) % n == 0 else "sliding_attention"
              for i in range(len(types))]
    return n if expect == types else None


def hf_tensor_names(config: ModelConfig) -> dict[str, str]:
    """pocketlm tensor name -> Hugging Face name, for every tensor ``config`` calls for (the
    inverse of the importer's tables)."""
    layer_names = {v: k for k, v in (LAYER_NAMES_GEMMA if config.arch == "gemma3"
                                     else LAYER_NAMES_STD).items()}
    global_names = {v: k for k, v in GLOBAL_NAMES.items()}
    out = {}
    for name in config.tensor_shapes():
        if name in global_names:
            out[name] = global_names[name]
            continue
        _, i, rest = name.split(".", 2)
        out[name] = f"model.layers.{i}.{layer_names[rest]}"
    return out


def _token_ids(tokenizer: Tokenizer) -> dict[str, Any]:
    eos = list(tokenizer.eos_ids)
    return {"bos_token_id": tokenizer.bos_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "pad_token_id": _pad_id(tokenizer)}


def _pad_id(tokenizer: Tokenizer) -> int | None:
    for text in PAD_TEXTS:
        i = tokenizer.token_to_id(text)
        if i is not None and 0 <= i < tokenizer.vocab_size:
            return i
    return tokenizer.eos_ids[0] if tokenizer.eos_ids else None


def hf_generation_config(gen: GenerationDefaults, tokenizer: Tokenizer) -> dict[str, Any]:
    """``generation_config.json``: token ids and the model's generation defaults, written so
    that :func:`pocketlm.formats.hf.generation_from_hf` reads the same defaults back (greedy
    is ``do_sample: false``; a top_k of 0 is written, not left to transformers' 50)."""
    out: dict[str, Any] = _token_ids(tokenizer)
    if gen.temperature > 0:
        out.update({"do_sample": True, "temperature": gen.temperature, "top_k": gen.top_k,
                    "top_p": gen.top_p, "min_p": gen.min_p})
    else:
        out["do_sample"] = False
    if gen.repetition_penalty != 1.0:
        out["repetition_penalty"] = gen.repetition_penalty
    if gen.max_tokens is not None:
        out["max_new_tokens"] = gen.max_tokens
    return out


# -- tokenizer -------------------------------------------------------------------------------
def hf_tokenizer(tok: Tokenizer) -> dict[str, Any]:
    """The ``tokenizer.json`` (as a dict) that gives ``tok``'s ids, BOS included when ``tok``
    adds one (its post-processor)."""
    if isinstance(tok, SpmTokenizer):
        spec = _spm_tokenizer_json(tok)
    else:
        spec = json.loads(tok.hf.to_str())
        spec["truncation"] = spec["padding"] = None
        model = spec.get("model") or {}
        vocab = model.get("vocab")
        if isinstance(vocab, dict) and DROPPED_BYTE in vocab:
            # the placeholder pocketlm removes after encoding has no row in the model: without
            # it, a byte the vocabulary lacks is dropped (its neighbours may then merge)
            del vocab[DROPPED_BYTE]
            if model.get("unk_token") == DROPPED_BYTE:
                model["unk_token"] = None
            spec["added_tokens"] = [t for t in spec.get("added_tokens") or []
                                    if t.get("content") != DROPPED_BYTE]
    spec["post_processor"] = _post_processor(spec.get("post_processor"), tok)
    return spec


def _post_processor(existing: Any, tok: Tokenizer) -> dict | None:
    """The source's ByteLevel offset step (if any), then BOS in front when ``tok`` adds it:
    nothing else (pocketlm never adds other tokens when encoding)."""
    steps = existing.get("processors", [existing]) if isinstance(existing, dict) else []
    steps = [s for s in steps if isinstance(s, dict) and s.get("type") == "ByteLevel"]
    if tok.add_bos and tok.bos_id is not None:
        bos = tok.id_to_token(tok.bos_id)
        steps.append({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [tok.bos_id], "tokens": [bos]}},
        })
    if not steps:
        return None
    return steps[0] if len(steps) == 1 else {"type": "Sequence", "processors": steps}


def _spm_tokenizer_json(tok: SpmTokenizer) -> dict[str, Any]:
    """A SentencePiece vocabulary as a Hugging Face BPE that splits text the same way.

    SentencePiece's BPE merges, at each step, the adjacent pair whose concatenation is the
    best-scoring normal piece; control, unknown, byte and unused pieces never come out of a
    merge. So the merges are every split of every normal piece into two normal pieces, best
    result first. Control and user-defined pieces are added tokens (matched in the text before
    anything else, as :class:`~pocketlm.tokenizer.SpmTokenizer` cuts them out); spaces become
    ``▁``, with one in front of each stretch of text when the model asks for a space prefix."""
    from ..formats.gguf_vocab import spm_bpe_spec, spm_merges

    sp = tok.sp
    n = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]
    normal = [i for i in range(n) if not (sp.is_control(i) or sp.is_unknown(i)
                                          or sp.is_unused(i) or sp.is_byte(i))]
    user = set(tok.user_defined.values())
    normal = [i for i in normal if i not in user]
    normal_pieces = [pieces[i] for i in normal]
    scores = np.array([sp.get_score(i) for i in normal], dtype=np.float64)
    merges = spm_merges(normal_pieces, scores, {p: k for k, p in enumerate(normal_pieces)})
    unknown = next((i for i in range(n) if sp.is_unknown(i)), None)
    added = sorted({**{i: True for i in tok.special_tokens.values()},
                    **{i: False for i in user}}.items())
    return spm_bpe_spec(
        {p: i for i, p in enumerate(pieces)}, merges,
        None if unknown is None else pieces[unknown], tok.add_space_prefix,
        added_tokens=[{"id": i, "content": pieces[i], "single_word": False, "lstrip": False,
                       "rstrip": False, "normalized": False, "special": special}
                      for i, special in added])


def special_tokens(tok: Tokenizer, spec: dict[str, Any]) -> dict[str, str | None]:
    """The texts of the BOS, EOS (the first), padding and unknown tokens (None if none) of
    ``tok``, whose ``tokenizer.json`` is ``spec``."""
    def text(i: int | None) -> str | None:
        return None if i is None else tok.id_to_token(i)

    unk = (spec.get("model") or {}).get("unk_token")
    return {"bos_token": text(tok.bos_id),
            "eos_token": text(tok.eos_ids[0]) if tok.eos_ids else None,
            "pad_token": text(_pad_id(tok)), "unk_token": unk if isinstance(unk, str) else None}


def _tokenizer_config(tokens: dict[str, str | None], tok: Tokenizer, template: str | None,
                      config: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(tok.add_bos and tok.bos_id is not None),
        "add_eos_token": False,
        **{k: v for k, v in tokens.items() if v is not None},
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_context,
    }
    if template:
        out["chat_template"] = template
    return out


# -- weights ---------------------------------------------------------------------------------
def _tensors(config: ModelConfig, weights: dict[str, Any], names: dict[str, str],
             pf: PocketFile) -> list[tuple[str, tuple[int, ...], Any]]:
    """``(hf_name, shape, chunks)`` for every tensor; ``chunks()`` yields its float32 values
    a block of rows at a time (Gemma's norms as the ``weight - 1`` its loader expects), then
    gives the mapped pages it read back to the page cache."""
    out = []
    for name, hf_name in names.items():
        w = weights[name]
        offset = 1.0 if config.arch == "gemma3" and name.endswith("norm.weight") else 0.0
        suffixes = ("", ".scales", ".mins", *getattr(w, "stored", ()))  # a source encoding's
        stored = [pf.infos[n] for n in dict.fromkeys(name + s for s in suffixes)
                  if n in pf.infos]
        out.append((hf_name, tuple(w.shape), _chunks_of(w, offset, pf, stored)))
    return out


def _chunks_of(w: np.ndarray | QuantTensor, offset: float, pf: PocketFile, stored: list):
    def chunks() -> Iterator[np.ndarray]:
        rows = w.shape[0]
        step = max(1, CHUNK_VALUES // max(1, math.prod(w.shape[1:])))
        for r in range(0, rows, step):
            if isinstance(w, QuantTensor):
                block = w.dequantize(slice(r, r + step))
            elif isinstance(w, PatchedHead):
                block = w[r:r + step]
            else:
                block = np.array(w[r:r + step], dtype=np.float32)
            if offset:
                block -= np.float32(offset)
            yield block
        for info in stored:  # read once: the resident set need not keep them
            pf.drop_resident(info.start, info.end)
        if hasattr(w, "release"):  # a source encoding decoded to dequantize: not all at once
            w.release()
    return chunks


def bfloat16_bits(a: np.ndarray) -> np.ndarray:
    """The bfloat16 nearest to each float32 of ``a`` (ties to even), as uint16 bit patterns;
    NaN stays a (quiet) NaN, values beyond bfloat16's range become infinities."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))))
               >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():  # the rounding carry would turn some NaN patterns into infinities
        rounded[nan] = (u[nan] >> np.uint32(16)).astype(np.uint16) | np.uint16(0x0040)
    return rounded


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], Any]],
                      dtype: str, *, progress: bool = False) -> int:
    """Write ``tensors`` (``(name, shape, chunks)``, see :func:`_tensors`) as one safetensors
    file of ``dtype`` ("BF16" or "F32"), one block at a time. Returns the file size."""
    itemsize = {"BF16": 2, "F32": 4}[dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in tensors:
        n = math.prod(shape) * itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset,
                                                                                offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, chunks in track(tensors, "exporting", "tensor", enabled=progress):
            written = 0
            for block in chunks():
                data = bfloat16_bits(block) if dtype == "BF16" else block.astype("<f4",
                                                                                  copy=False)
                f.write(memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)))
                written += data.size
            if written != math.prod(shape):
                raise FormatError(f"tensor {name}: wrote {written} values, expected "
                                  f"{math.prod(shape)}")
        size = f.tell()
    return size


# -- README ----------------------------------------------------------------------------------
def _readme(name: str, config_json: dict, dtype: str, prov: dict, config: ModelConfig) -> str:
    """A model card stub: what the folder is, where it comes from, how it was packed."""
    from ..pack import vocab_summary

    src = prov["provenance"]
    quant = prov["quant"]
    licence = src.get("source_license")
    lines = ["---", "library_name: transformers"]
    if licence:
        lines.append(f"license: {licence}")
    lines += ["---", "", f"# {name}", "",
              f"A {config_json['architectures'][0]} model ({config.n_params() / 1e6:.1f} M "
              f"parameters, {dtype} weights) exported by `pocket export --to hf` from a pocketlm "
              "deploy file.", "", "## Provenance", "",
              f"- deploy file: `{prov['file']}` (sha256 `{prov['sha256']}`)"]
    if src.get("source_file"):
        origin = f"- packed from: `{src['source_file']}`"
        if src.get("source_format"):
            origin += f" ({src['source_format']}"
            origin += f", sha256 `{src['source_sha256']}`)" if src.get("source_sha256") else ")"
        if src.get("source_name"):
            origin += f", model name \"{src['source_name']}\""
        lines.append(origin)
    if src.get("packed_at") or src.get("pocketlm_version"):
        lines.append(f"- packed: {src.get('packed_at', '?')} with pocketlm "
                     f"{src.get('pocketlm_version', '?')}")
    if quant:
        kinds: dict[str, int] = {}
        for layout in (quant.get("tensors") or {}).values():
            if isinstance(layout, dict):
                key = f"{layout.get('kind')} g{layout.get('group_size')}"
                kinds[key] = kinds.get(key, 0) + 1
        options = ", ".join(f"{k} {quant[k]}" for k in ("scheme", "group_size", "embed_bits",
                                                          "keep_precision") if k in quant)
        lines.append(f"- pack options: {options or 'not recorded'}")
        if kinds:
            lines.append("- quantized layouts: " + ", ".join(
                f"{n} tensors {k}" for k, n in sorted(kinds.items())))
        cal = quant.get("calibration")
        if isinstance(cal, dict):
            cset = cal.get("set") or {}
            lines.append(f"- calibration: {cal.get('method', '?')} on "
                         f"{cset.get('sequences', '?')} sequences of {cset.get('seq_len', '?')} "
                         f"tokens ({cset.get('source', '?')}, sha256 "
                         f"`{str(cset.get('sha256', '?'))[:12]}`)"
                         + (f", bit budget {cal['bits_per_weight']}"
                            if cal.get("bits_per_weight") else ""))
    if prov["vocab"]:
        try:
            lines.append("- " + vocab_summary(prov["vocab"]))
        except (KeyError, TypeError):
            lines.append("- vocabulary: trimmed (details in the deploy file's metadata)")
        lines.append("  The tokenizer here is the trimmed one: its ids are not the source "
                     "model's.")
    lines += ["", "The weights are the deploy file's, dequantized: they compute what the "
              "deploy file computes, quantization error included, not the source model's "
              "original weights.", "",
              "## Licence", "",
              (f"The weights keep the licence of the model they come from ({licence}); "
               if licence else "The weights keep the licence of the model they come from; ")
              + "read its terms before you redistribute them.", "",
              "## Use", "", "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "",
              f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
              f'model = AutoModelForCausalLM.from_pretrained("{name}")',
              "```", ""]
    return "\n".join(lines)


# -- helpers ---------------------------------------------------------------------------------
def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def peak_rss() -> int | None:
    """This process's peak resident set in bytes (None where the platform does not say)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
