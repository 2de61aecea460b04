"""GGUF import: config, tensors and tokenizer from a GGUF file (read with the ``gguf`` library).

Tensor data stays memory-mapped until asked for. Float values come from ``gguf.quants``
(the numpy implementation of every ggml type, tested upstream against the C library); 4-, 5-
and 8-bit blocks whose grid pocketlm's layouts can hold are imported without requantizing.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig, short_repr
from ..errors import FormatError, ModelNotFoundError, PocketError, UnsupportedError
from ..quant import int4_from_gguf_blocks, int5_from_gguf_blocks, int8_from_gguf_blocks
from . import SourceModel, SourceTensor, sha256_file
from .pocketfile import open_regular

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

# GGUF tensor name (after "blk.{i}.") -> pocketlm name (after "layers.{i}.")
LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_q.weight": "attn.w_q.weight",
    "attn_k.weight": "attn.w_k.weight",
    "attn_v.weight": "attn.w_v.weight",
    "attn_q.bias": "attn.w_q.bias",
    "attn_k.bias": "attn.w_k.bias",
    "attn_v.bias": "attn.w_v.bias",
    "attn_output.weight": "attn.w_o.weight",
    "attn_q_norm.weight": "attn.q_norm.weight",
    "attn_k_norm.weight": "attn.k_norm.weight",
    "post_attention_norm.weight": "post_attn_norm.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    "ffn_gate.weight": "mlp.w_gate.weight",
    "ffn_up.weight": "mlp.w_up.weight",
    "ffn_down.weight": "mlp.w_down.weight",
    "post_ffw_norm.weight": "post_mlp_norm.weight",
}
GLOBAL_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")

# GGUF sampling key (llama.cpp's converter writes them from generation_config.json) ->
# pocketlm generation default
SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}

# Gemma 3 (as llama.cpp reads it): every 6th layer is global, the others use a sliding window
# with RoPE base 10000.
GEMMA3_SWA_PATTERN = 6
GEMMA3_ROPE_LOCAL = 10000.0
GEMMA3_27B_LAYERS = 62  # how llama.cpp tells the 27B model (its own attention scale)


def map_name(gguf_name: str) -> str | None:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in LAYER_NAMES:
        return f"layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"
    return None


def read_fields(reader, origin: str = "GGUF file") -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if not hasattr(f, "contents"):  # the library, not the file: gguf before 0.16
            from importlib.metadata import PackageNotFoundError, version

            try:
                installed = version("gguf")
            except PackageNotFoundError:  # a gguf-py folder on the path
                installed = "unknown version"
            raise FormatError(f"the installed gguf library ({installed}) is too old to read "
                              "GGUF fields; pocketlm needs gguf>=0.16 (pip install -U gguf)")
        try:
            fields[key] = f.contents()
        except Exception as exc:  # a field the library cannot decode is a corrupt file
            raise FormatError(f"{origin}: GGUF field {short_repr(key)} cannot be read "
                              f"({type(exc).__name__}: {exc}); the file is corrupt") from None
    return fields


def config_from_fields(fields: dict[str, Any], tensor_names: set[str], origin: str) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedError(
            f"{origin}: architecture {arch!r} is not supported; supported GGUF architectures: "
            f"{', '.join(SUPPORTED_ARCHS)}"
        )

    def get(key: str, default: Any = None, required: bool = True) -> Any:
        full = f"{arch}.{key}"
        if full in fields:
            return fields[full]
        if required and default is None:
            raise FormatError(f"{origin}: GGUF metadata lacks {full!r}")
        return default

    def number(key: str, value: Any, kind: type) -> Any:
        """A metadata value that must be an integer (kind int) or a real number (float)."""
        ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(
            value, bool)
        if not ok:
            raise FormatError(f"{origin}: GGUF field {arch}.{key} must be "
                              f"{'an integer' if kind is int else 'a number'}, got "
                              f"{short_repr(value)}")
        return kind(value)

    def get_int(key: str, default: Any = None, required: bool = True) -> int:
        return number(key, get(key, default, required), int)

    def get_float(key: str, default: float) -> float:
        return number(key, get(key, default, required=False), float)

    d_model = get_int("embedding_length")
    n_heads = get_int("attention.head_count")
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer head counts
        if len(set(map(repr, n_kv))) != 1:
            raise UnsupportedError(f"{origin}: per-layer KV head counts are not supported")
        n_kv = n_kv[0]
    n_kv = number("attention.head_count_kv", n_kv, int)
    head_dim = get_int("attention.key_length", d_model // n_heads if n_heads > 0 else 0)
    if get_int("attention.value_length", head_dim) != head_dim:
        raise UnsupportedError(f"{origin}: key and value head sizes differ")
    rope_dim = get_int("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise UnsupportedError(f"{origin}: partial rotary embeddings ({rope_dim} of {head_dim} "
                               "dimensions) are not supported")
    scaling = get("rope.scaling.type", None, required=False)
    if scaling not in ("none", None):
        raise UnsupportedError(f"{origin}: RoPE scaling {short_repr(scaling)} is not supported yet")
    # llama.cpp reads a scaling type left out as "linear" and scales positions by the factor
    # (rope.scaling.factor, or the older rope.scale_linear; 0 or 1: none), so a factor without
    # a type stretches the positions too
    key = "rope.scaling.factor" if f"{arch}.rope.scaling.factor" in fields else \
        "rope.scale_linear"
    factor = number(key, get(key, 0.0, required=False), float)
    if scaling is None and factor not in (0.0, 1.0):
        raise UnsupportedError(f"{origin}: RoPE scaling (linear, {arch}.{key} = {factor:g}) is "
                               "not supported yet")
    tokens = fields.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, list) else 0
    vocab = get_int("vocab_size", n_tokens, required=False)
    if not vocab:
        raise FormatError(f"{origin}: cannot tell the vocabulary size (no tokenizer.ggml.tokens)")
    cfg: dict[str, Any] = dict(
        arch=arch,
        vocab_size=vocab,
        d_model=d_model,
        n_layers=get_int("block_count"),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        d_ff=get_int("feed_forward_length"),
        norm_eps=get_float("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=get_float("rope.freq_base", 10000.0),
        max_context=get_int("context_length", 2048, required=False),
        tie_embeddings="output.weight" not in tensor_names,
        # the families whose llama.cpp graph requires them: a file without them is missing
        # tensors (check_tensors says which), not a model that runs without them
        qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        qk_norm=arch in ("qwen3", "gemma3") or "blk.0.attn_q_norm.weight" in tensor_names,
    )
    try:
        # the sizes are validated before anything (Gemma's layer list) is built from them
        config = ModelConfig(**cfg)
        if arch == "gemma3":
            config = dataclasses.replace(
                config,
                sandwich_norms=True,
                activation="gelu_tanh",
                embed_scale=math.sqrt(config.d_model),
                attn_scale=1.0 / math.sqrt(_gemma3_query_scalar(config)),
                # required, as llama.cpp requires it: no default fits every Gemma 3
                sliding_window=get_int("attention.sliding_window"),
                rope_theta_local=GEMMA3_ROPE_LOCAL,
                layer_types=[
                    "global" if (i % GEMMA3_SWA_PATTERN) == GEMMA3_SWA_PATTERN - 1 else "sliding"
                    for i in range(config.n_layers)
                ],
            )
    except PocketError as exc:
        raise type(exc)(f"{origin}: {exc}") from None
    return config


def _gemma3_query_scalar(config: ModelConfig) -> int:
    """What a Gemma 3 GGUF scales attention scores by (1 / sqrt of it), as llama.cpp does: the
    head size, except for the 27B model (62 layers), whose query_pre_attn_scalar is
    d_model / n_heads (168, its head size 128): the file does not record it."""
    if config.n_layers == GEMMA3_27B_LAYERS:
        return config.d_model // config.n_heads
    return config.head_dim


def generation_from_fields(fields: dict[str, Any], origin: str):
    """The model's generation defaults from its ``general.sampling.*`` keys (the built-in
    values for those it lacks). Floats are stored as float32: each is read back as the
    shortest decimal that rounds to it (0.7, not 0.699999988)."""
    from ..config import GenerationDefaults

    values = {}
    for key, name in SAMPLING_KEYS.items():
        if key not in fields:
            continue
        value = fields[key]
        if isinstance(value, float) and math.isfinite(value):
            value = float(str(np.float32(value)))
        try:
            GenerationDefaults(**{name: value})
        except FormatError:
            raise FormatError(f"{origin}: GGUF field {key} is not a valid {name}: "
                              f"{short_repr(value)}") from None
        values[name] = value
    return GenerationDefaults(**values)


def unpermute_rows(a: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the q/k row permutation of llama GGUF conversion.

    The converter regroups each head's rows from halves ``[x0..x(d/2-1) | y0..y(d/2-1)]`` to
    interleaved pairs ``[x0 y0 x1 y1 ...]`` so that ggml can rotate adjacent pairs; pocketlm
    rotates halves, so the rows go back. Rows are whole (quantized blocks run along a row),
    so this is lossless for any tensor type.
    """
    rows = a.shape[0]
    head = rows // n_heads
    return a.reshape(n_heads, head // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def read_gguf(path: str | Path) -> SourceModel:
    import gguf
    from gguf.quants import dequantize

    from .gguf_vocab import tokenizer_from_gguf_fields

    path = Path(path)
    origin = str(path)
    with open_regular(path, missing=ModelNotFoundError) as f:  # a FIFO, no permission: say so
        file_size = os.fstat(f.fileno()).st_size
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:
        raise FormatError(f"{origin}: not a readable GGUF file (truncated or corrupt?): "
                          f"{type(exc).__name__}: {exc}") from None
    fields = read_fields(reader, origin)
    by_name = {t.name: t for t in reader.tensors}
    # A truncated file can still parse its header; every tensor must lie inside the file.
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > file_size:
            raise FormatError(f"{origin}: truncated: tensor {t.name} runs past the end of the file")
    # ... and no two may share bytes: each is its own data (ggml lays them one after another),
    # and a table pointing two at the same bytes packed one tensor's values as another's
    spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name)
                   for t in reader.tensors if int(t.n_bytes))
    for (_, end, before), (start, _, after) in zip(spans, spans[1:]):
        if start < end:
            raise FormatError(f"{origin}: corrupt tensor table: tensors {before} and {after} "
                              "share bytes")
    config = config_from_fields(fields, set(by_name), origin)

    tensors: dict[str, SourceTensor] = {}
    unmapped = []
    for t in reader.tensors:
        name = map_name(t.name)
        if name is None:
            unmapped.append(t.name)
            continue
        type_name = t.tensor_type.name
        shape = tuple(int(s) for s in reversed(list(t.shape)))  # ggml lists dims innermost first
        permute_heads = None
        if config.arch == "llama" and name.endswith(("attn.w_q.weight", "attn.w_q.bias")):
            permute_heads = config.n_heads
        elif config.arch == "llama" and name.endswith(("attn.w_k.weight", "attn.w_k.bias")):
            permute_heads = config.n_kv_heads
        tensors[name] = _source_tensor(name, t, type_name, shape, permute_heads, dequantize)
    if unmapped:
        raise UnsupportedError(f"{origin}: tensors pocketlm does not map: {unmapped[:5]}"
                               f"{' ...' if len(unmapped) > 5 else ''}")
    if "lm_head.weight" in tensors and config.tie_embeddings:
        raise FormatError(f"{origin}: inconsistent output head")
    template = fields.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise FormatError(f"{origin}: GGUF field tokenizer.chat_template must be a string, got "
                          f"{short_repr(template)}")
    try:
        tokenizer = tokenizer_from_gguf_fields(fields)
    except PocketError as exc:
        raise type(exc)(f"{origin}: {exc}") from None
    except (TypeError, ValueError, OverflowError) as exc:  # a value of the wrong GGUF type
        raise FormatError(f"{origin}: the tokenizer metadata (tokenizer.ggml.*) is malformed "
                          f"({type(exc).__name__}: {exc}); the file is corrupt") from None
    source_model = SourceModel(
        config=config,
        tokenizer=tokenizer,
        chat_template=template,
        tensors=tensors,
        generation=generation_from_fields(fields, origin),
        provenance={
            "source_format": "gguf",
            "source_file": path.name,
            "source_sha256": sha256_file(path),
            "source_size": file_size,
            "source_name": fields.get("general.name"),
            "source_license": fields.get("general.license"),
            "source_file_type": fields.get("general.file_type"),
        },
    )
    source_model.check_tensors(origin)
    return source_model


def _source_tensor(name, t, type_name, shape, permute_heads, dequantize) -> SourceTensor:
    def raw() -> np.ndarray:
        data = t.data
        if permute_heads is not None:
            data = unpermute_rows(np.asarray(data), permute_heads)
        return data

    def to_float() -> np.ndarray:
        try:
            values = dequantize(np.asarray(raw()), t.tensor_type)
        except NotImplementedError:
            raise UnsupportedError(
                f"tensor {t.name}: GGUF type {type_name} cannot be dequantized by the installed "
                "gguf library; supported here: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
                "Q2_K-Q6_K and the IQ types gguf implements (try `pip install -U gguf`)"
            ) from None
        return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)

    def to_quant(bits: int, group_size: int):
        if len(shape) != 2 or group_size != 32:
            return None
        if bits == 4:
            return int4_from_gguf_blocks(raw(), type_name, shape)
        if bits == 5:
            return int5_from_gguf_blocks(raw(), type_name, shape)
        if bits == 8:
            return int8_from_gguf_blocks(raw(), type_name, shape)
        return None

    return SourceTensor(name=name, shape=shape, dtype=type_name, to_float=to_float,
                        to_quant=to_quant, raw=raw)
