"""Hugging Face folder import: ``config.json``, ``*.safetensors``, ``tokenizer.json`` and the
chat template from ``tokenizer_config.json`` (or ``chat_template.jinja``)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig, short_repr
from ..errors import FormatError, PocketError, UnsupportedError
from . import SourceModel, SourceTensor
from .pocketfile import map_file, open_regular, os_error, read_header, tensor_view

# model_type -> pocketlm family
FAMILY_OF = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
             "gemma3": "gemma3", "pocket": "pocket"}

GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.w_q.weight",
    "self_attn.k_proj.weight": "attn.w_k.weight",
    "self_attn.v_proj.weight": "attn.w_v.weight",
    "self_attn.q_proj.bias": "attn.w_q.bias",
    "self_attn.k_proj.bias": "attn.w_k.bias",
    "self_attn.v_proj.bias": "attn.w_v.bias",
    "self_attn.o_proj.weight": "attn.w_o.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.gate_proj.weight": "mlp.w_gate.weight",
    "mlp.up_proj.weight": "mlp.w_up.weight",
    "mlp.down_proj.weight": "mlp.w_down.weight",
}
# Gemma 3 has four norms per layer; in llama-style models post_attention_layernorm is the MLP's
# input norm.
LAYER_NAMES_STD = {**LAYER_NAMES, "post_attention_layernorm.weight": "mlp_norm.weight"}
LAYER_NAMES_GEMMA = {
    **LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attn_norm.weight",
    "pre_feedforward_layernorm.weight": "mlp_norm.weight",
    "post_feedforward_layernorm.weight": "post_mlp_norm.weight",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def config_from_hf(hf: dict[str, Any], origin: str) -> ModelConfig:
    if not isinstance(hf, dict):
        raise FormatError(f"{origin}: config.json must hold a JSON object, got {short_repr(hf)}")
    if isinstance(hf.get("text_config"), dict) and hf.get("model_type") == "gemma3":
        hf = {**hf["text_config"], "model_type": "gemma3_text"}
    model_type = hf.get("model_type")
    family = FAMILY_OF.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UnsupportedError(f"{origin}: model_type {short_repr(model_type)} is not supported; "
                               f"supported: {', '.join(sorted(FAMILY_OF))}")

    def req(key: str) -> Any:
        if key not in hf:
            raise FormatError(f"{origin}: config.json lacks {key!r}")
        return hf[key]

    def number(key: str, value: Any, kind: type) -> Any:
        """A config.json value that must be an integer (kind int) or a real number (float)."""
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float
                                                     else int):
            raise FormatError(f"{origin}: config.json {key} must be "
                              f"{'an integer' if kind is int else 'a number'}, got "
                              f"{short_repr(value)}")
        return kind(value)

    def opt(key: str, default: Any, kind: type) -> Any:
        value = hf.get(key)
        return default if value is None else number(key, value, kind)

    def flag(key: str, default: bool) -> bool:
        """A switch: JSON true or false (null: ``default``). Its truthiness is not enough:
        ``"false"`` is a true string, and a tied head read from it drops the file's own."""
        value = hf.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise FormatError(f"{origin}: config.json {key} must be true or false, got "
                              f"{short_repr(value)}")
        return value

    hf = _with_rope_bases(hf, origin)
    scaling = hf.get("rope_scaling")
    if isinstance(scaling, dict) and set(scaling) <= {"type", "rope_type"} and all(
            v == "default" for v in scaling.values()):
        scaling = None  # the plain RoPE, written the old way
    if scaling not in (None, {}):
        raise UnsupportedError(f"{origin}: rope_scaling {short_repr(hf['rope_scaling'])} is not "
                               "supported yet")
    if flag("mlp_bias", False):
        raise UnsupportedError(f"{origin}: MLP biases are not supported")
    if flag("use_bidirectional_attention", False):  # transformers: attention not causal
        raise UnsupportedError(f"{origin}: bidirectional attention "
                               "(use_bidirectional_attention) is not supported")
    d_model = number("hidden_size", req("hidden_size"), int)
    n_heads = number("num_attention_heads", req("num_attention_heads"), int)
    head_dim = opt("head_dim", 0, int) or (d_model // n_heads if n_heads > 0 else 0)
    cfg: dict[str, Any] = dict(
        arch=family,
        vocab_size=number("vocab_size", req("vocab_size"), int),
        d_model=d_model,
        n_layers=number("num_hidden_layers", req("num_hidden_layers"), int),
        n_heads=n_heads,
        n_kv_heads=opt("num_key_value_heads", 0, int) or n_heads,
        head_dim=head_dim,
        d_ff=number("intermediate_size", req("intermediate_size"), int),
        norm_eps=opt("rms_norm_eps", 1e-6, float),
        rope_theta=opt("rope_theta", 10000.0, float),
        max_context=opt("max_position_embeddings", 2048, int),
        tie_embeddings=flag("tie_word_embeddings", family == "gemma3"),
        qkv_bias=family == "qwen2" or flag("attention_bias", False),
        qk_norm=family in ("qwen3", "gemma3", "pocket"),
    )
    # the key the family's transformers model reads first: Gemma's MLP takes
    # hidden_activation (its configs may also carry another hidden_act), the others hidden_act
    keys = ("hidden_activation", "hidden_act") if family == "gemma3" else \
        ("hidden_act", "hidden_activation")
    # (left out: the family's transformers default)
    act = hf.get(keys[0]) or hf.get(keys[1]) or (
        "gelu_pytorch_tanh" if family == "gemma3" else "silu")
    if family == "gemma3":
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedError(f"{origin}: activation {short_repr(act)} is not supported "
                                   "for gemma3")
        if hf.get("final_logit_softcapping") or hf.get("attn_logit_softcapping"):
            raise UnsupportedError(f"{origin}: logit soft-capping is not supported")
    elif act != "silu":
        raise UnsupportedError(f"{origin}: activation {short_repr(act)} is not supported for "
                               f"{family}")
    elif flag("use_sliding_window", False) and hf.get("sliding_window"):
        raise UnsupportedError(f"{origin}: sliding-window attention is only supported for gemma3")
    try:
        # the sizes are validated before anything (Gemma's layer list) is built from them
        config = ModelConfig(**cfg)
        if family == "gemma3":
            config = _gemma3(config, hf, number, opt, origin)
    except PocketError as exc:
        if str(exc).startswith(f"{origin}: "):  # number() and opt() name the folder already
            raise
        raise type(exc)(f"{origin}: {exc}") from None
    return config


def _with_rope_bases(hf: dict[str, Any], origin: str) -> dict[str, Any]:
    """``hf`` with ``rope_theta`` / ``rope_local_base_freq`` taken from ``rope_parameters``
    where only that is given (transformers 5 writes the RoPE bases there: one dict, or one per
    attention kind for Gemma 3); a RoPE other than the plain one is refused."""
    params = hf.get("rope_parameters")
    if params is None:
        return hf
    if not isinstance(params, dict):
        raise FormatError(f"{origin}: config.json rope_parameters must be an object, got "
                          f"{short_repr(params)}")
    kinds = ("full_attention", "sliding_attention")
    if any(isinstance(params.get(k), dict) for k in kinds):
        full, sliding = (params.get(k) if isinstance(params.get(k), dict) else {} for k in kinds)
    else:
        full, sliding = params, {}
    for p in (full, sliding):
        if p.get("rope_type") not in (None, "default"):
            raise UnsupportedError(f"{origin}: rope_parameters {short_repr(p)} is not supported "
                                   "yet (only the plain RoPE)")
    out = dict(hf)
    # transformers 5 reads the base from rope_parameters, the top-level key only where that
    # has none: two that differ are refused rather than one of them guessed
    for key, p in (("rope_theta", full), ("rope_local_base_freq", sliding)):
        inner = p.get("rope_theta")
        if inner is None:
            continue
        if out.get(key) is not None and out[key] != inner:
            raise FormatError(f"{origin}: config.json gives two RoPE bases, {key} "
                              f"{short_repr(out[key])} and rope_parameters' rope_theta "
                              f"{short_repr(inner)}")
        out[key] = inner
    return out


def _gemma3(config: ModelConfig, hf: dict[str, Any], number, opt, origin: str) -> ModelConfig:
    """Gemma 3's switches on a validated base config."""
    types = hf.get("layer_types")
    if types:
        # each entry one of the two kinds transformers knows: anything else is not a full
        # attention layer (read as one, a sliding layer would attend past its window)
        if not isinstance(types, list) or len(types) != config.n_layers or not all(
                t in ("sliding_attention", "full_attention") for t in types):
            raise FormatError(f"config.json layer_types must list 'sliding_attention' or "
                              f"'full_attention' for each of the {config.n_layers} layers, got "
                              f"{short_repr(types)}")
    else:
        pattern = opt("sliding_window_pattern", 6, int)
        if pattern < 1:
            raise FormatError(f"config.json sliding_window_pattern must be a positive integer, "
                              f"got {pattern}")
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(config.n_layers)]
    # a key the file leaves out takes transformers' Gemma3TextConfig default, as transformers
    # itself would read the file (the real files write them all)
    query_scalar = opt("query_pre_attn_scalar", 256, float)
    if not query_scalar > 0:
        raise FormatError(f"config.json query_pre_attn_scalar must be positive, got "
                          f"{query_scalar}")
    return dataclasses.replace(
        config,
        sandwich_norms=True,
        activation="gelu_tanh",
        embed_scale=math.sqrt(config.d_model),
        attn_scale=query_scalar ** -0.5,
        rope_theta=opt("rope_theta", 1_000_000.0, float),
        sliding_window=opt("sliding_window", 4096, int),
        rope_theta_local=opt("rope_local_base_freq", 10000.0, float),
        layer_types=["sliding" if t == "sliding_attention" else "global" for t in types],
    )


def read_hf(path: str | Path) -> SourceModel:
    from ..tokenizer import Tokenizer

    root = Path(path)
    origin = str(root)
    hf_config = _read_json(root / "config.json")
    config = config_from_hf(hf_config, origin)
    gemma = config.arch == "gemma3"
    layer_names = LAYER_NAMES_GEMMA if gemma else LAYER_NAMES_STD

    files = _weight_files(root)
    if not files:
        raise FormatError(f"{origin}: no *.safetensors files (pytorch .bin checkpoints are not "
                          "supported: convert them to safetensors)")
    tensors: dict[str, SourceTensor] = {}
    stored: dict[str, tuple] = {}  # name -> (mapped file, header entry): the head check's views
    unmapped: list[str] = []
    for file in files:
        buf = map_file(file)
        _, infos = read_header(file, buf)
        for hf_name, info in infos.items():
            name = _map(hf_name, layer_names)
            if name is None:
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue  # derived from the config
                unmapped.append(hf_name)
                continue
            if name in tensors:  # in two files: which one is meant is not ours to guess
                raise FormatError(f"{origin}: tensor {hf_name} is stored twice (again in "
                                  f"{file.name})")
            norm_offset = 1.0 if gemma and name.endswith("norm.weight") else 0.0
            stored[name] = (buf, info)
            try:
                tensors[name] = _source_tensor(name, buf, info, norm_offset)
            except PocketError as exc:
                raise type(exc)(f"{file}: {exc}") from None
    multimodal = [n for n in unmapped if n.startswith((
        "language_model.", "model.language_model.", "vision_tower.", "model.vision_tower."))]
    if multimodal:
        raise UnsupportedError(f"{origin}: a multimodal checkpoint ({multimodal[0]}: a "
                               "language model beside a vision tower) is not supported: use "
                               "its text-only model")
    if unmapped:
        raise UnsupportedError(f"{origin}: tensors pocketlm does not map: {unmapped[:5]}"
                               f"{' ...' if len(unmapped) > 5 else ''}")
    if config.tie_embeddings and "lm_head.weight" in tensors:
        # tied checkpoints may still store the head: the same values, dropped; a head of its
        # own is the one transformers 5 uses (it unties them), and so is it here
        if _same_values(stored["lm_head.weight"], stored.get("embed.weight")):
            del tensors["lm_head.weight"]
        else:
            config = dataclasses.replace(config, tie_embeddings=False)

    tok_file = root / "tokenizer.json"
    if not tok_file.is_file():
        raise FormatError(f"{origin}: no tokenizer.json (pocketlm needs the fast-tokenizer file)")
    tok_config: dict[str, Any] = {}
    if (root / "tokenizer_config.json").is_file():
        tok_config = _read_json(root / "tokenizer_config.json")
        if not isinstance(tok_config, dict):
            raise FormatError(f"{root / 'tokenizer_config.json'}: must hold a JSON object, got "
                              f"{short_repr(tok_config)}")
    tokenizer = Tokenizer.from_hf_file(tok_file, tok_config)
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t.get("template") for t in template
                         if isinstance(t, dict) and t.get("name") == "default"), None)
    if (root / "chat_template.jinja").is_file():
        template = _read_text(root / "chat_template.jinja")
    if template is not None and not isinstance(template, str):
        raise FormatError(f"{root / 'tokenizer_config.json'}: chat_template must be a string, "
                          f"got {short_repr(template)}")
    gen_file = root / "generation_config.json"
    gen = _read_json(gen_file) if gen_file.is_file() else {}
    model = SourceModel(config=config, tokenizer=tokenizer, chat_template=template,
                        tensors=tensors, generation=generation_from_hf(gen, str(gen_file)),
                        provenance={"source_format": "hf", "source_file": root.name,
                                    "source_files": [f.name for f in files]})
    model.check_tensors(origin)
    return model


# generation_config.json key -> pocketlm generation default
GENERATION_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                   "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                   "max_new_tokens": "max_tokens"}
# what transformers samples with when do_sample is true and a key is left out
HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50}


def generation_from_hf(gen: Any, origin: str):
    """The model's generation defaults from ``generation_config.json`` as transformers reads
    it: without ``do_sample: true`` decoding is greedy (temperature 0); with it, a temperature
    or top_k left out is transformers' own (1.0, 50). A null is a key left out;
    ``max_length`` (which counts the prompt) is not used."""
    from ..config import GenerationDefaults

    if not isinstance(gen, dict):
        raise FormatError(f"{origin}: must hold a JSON object, got {short_repr(gen)}")
    do_sample = gen.get("do_sample", False)
    if not isinstance(do_sample, bool):
        raise FormatError(f"{origin}: do_sample must be true or false, got "
                          f"{short_repr(do_sample)}")
    values = {name: gen[key] for key, name in GENERATION_KEYS.items()
              if gen.get(key) is not None}
    if do_sample:
        values = {**HF_SAMPLING_DEFAULTS, **values}
    else:
        values["temperature"] = 0.0
    for name, value in values.items():
        try:
            GenerationDefaults(**{name: value})
        except FormatError:
            key = next(k for k, n in GENERATION_KEYS.items() if n == name)
            raise FormatError(f"{origin}: {key} is not a valid {name}: "
                              f"{short_repr(value)}") from None
    return GenerationDefaults(**values)


def _read_text(path: Path) -> str:
    with open_regular(path) as f:
        try:
            return f.read().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(f"{path}: not UTF-8 text (byte {exc.start})") from None
        except OSError as e:
            raise os_error(path, e) from None


def _weight_files(root: Path) -> list[Path]:
    """The safetensors files that hold the weights: those the sharded checkpoint's index
    (``model.safetensors.index.json``) names, as transformers reads it (a stale consolidated
    file beside the shards is not read), else every ``*.safetensors`` file."""
    index = root / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(root.glob("*.safetensors"))
    weight_map = _read_json(index)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(f, str) and f and "/" not in f and "\\" not in f and f not in (".", "..")
            for f in weight_map.values()):
        raise FormatError(f"{index}: weight_map must map tensor names to files in the folder")
    files = [root / f for f in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FormatError(f"{index}: names {missing[0]}, which is not in the folder")
    return files


def _read_json(path: Path) -> Any:
    try:
        return json.loads(_read_text(path))
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{path}: not valid JSON ({exc})") from None


def _map(hf_name: str, layer_names: dict[str, str]) -> str | None:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    m = _LAYER_RE.match(hf_name)
    if m and m.group(2) in layer_names:
        return f"layers.{m.group(1)}.{layer_names[m.group(2)]}"
    return None


def _same_values(a: tuple, b: tuple | None) -> bool:
    """Whether two stored tensors (mapped file, header entry) hold the same values, compared
    in their own type a slice of rows at a time (two vocabulary-sized float32 copies would be
    a gigabyte)."""
    if b is None or a[1].shape != b[1].shape:
        return False
    x, y = tensor_view(*a), tensor_view(*b)
    if a[1].dtype != b[1].dtype:
        x, y = x.astype(np.float32), y.astype(np.float32)  # not seen in practice
    rows = max(1, (1 << 22) // max(1, x[0].size if x.ndim > 1 else 1))
    return all(np.array_equal(x[i:i + rows], y[i:i + rows]) for i in range(0, len(x), rows))


def _source_tensor(name, buf, info, norm_offset: float) -> SourceTensor:
    if info.dtype not in ("F32", "F16", "BF16"):
        raise UnsupportedError(f"tensor {name}: dtype {info.dtype} is not supported in "
                               "Hugging Face folders (F32, F16, BF16)")

    def to_float() -> np.ndarray:
        a = tensor_view(buf, info)
        if info.dtype == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        a = np.array(a, dtype=np.float32)
        if norm_offset:
            a += np.float32(norm_offset)  # Gemma stores norm weights as (weight - 1)
        return a

    return SourceTensor(name=name, shape=info.shape, dtype=info.dtype, to_float=to_float)
