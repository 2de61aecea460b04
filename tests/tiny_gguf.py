"""Tiny GGUF files written the way llama.cpp's converter writes them, for import tests.

:func:`write_tiny_gguf` takes a tiny random model (``tiny_models.tiny_config`` sizes), writes it
with ``gguf.GGUFWriter`` under GGUF names, in ggml dimension order, with llama's q/k rows
permuted as ``convert_hf_to_gguf.py`` does, 2-D weights quantized with ``gguf.quants``, the
architecture metadata and a small byte-level BPE tokenizer; it returns the config the file
describes and the float32 weights under pocketlm names *as the file holds them* (dequantized),
so an independent reference sees exactly what the importer should read.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import numpy as np
import tiny_models

from pocketlm.config import ModelConfig

# GGUF importer conventions for Gemma 3 (as llama.cpp reads such a file): every 6th layer global.
GEMMA3_SWA_PATTERN = 6

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# pocketlm name (after "layers.{i}.") -> GGUF name (after "blk.{i}.")
_LAYER_TO_GGUF = {
    "attn_norm.weight": "attn_norm.weight",
    "attn.w_q.weight": "attn_q.weight",
    "attn.w_k.weight": "attn_k.weight",
    "attn.w_v.weight": "attn_v.weight",
    "attn.w_q.bias": "attn_q.bias",
    "attn.w_k.bias": "attn_k.bias",
    "attn.w_v.bias": "attn_v.bias",
    "attn.w_o.weight": "attn_output.weight",
    "attn.q_norm.weight": "attn_q_norm.weight",
    "attn.k_norm.weight": "attn_k_norm.weight",
    "post_attn_norm.weight": "post_attention_norm.weight",
    "mlp_norm.weight": "ffn_norm.weight",
    "mlp.w_gate.weight": "ffn_gate.weight",
    "mlp.w_up.weight": "ffn_up.weight",
    "mlp.w_down.weight": "ffn_down.weight",
    "post_mlp_norm.weight": "post_ffw_norm.weight",
}
_GLOBAL_TO_GGUF = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

# words whose left-to-right merges make up the tiny BPE merge list (byte-level, 'Ġ' = space)
_MERGE_WORDS = (
    "Ġthe", "Ġand", "Ġhello", "Ġworld", "ing", "er", "Ġof", "Ġto", "Ġin", "Ġis", "Ġit", "on",
    "Ġa", "Ġwas", "Ġfor", "Ġthat", "Ġhe", "Ġyou", "Ġwith", "Ġas", "Ġon", "ed", "Ġbe", "Ġat",
    "Ġhis", "Ġshe", "Ġby", "Ġare", "Ġthis", "Ġhave", "Ġfrom", "Ġor", "Ġone", "Ġhad", "Ġnot",
    "Ġbut", "Ġwhat", "Ġall", "Ġwere", "Ġwhen", "Ġwe", "Ġthere", "Ġcan", "Ġan", "Ġyour",
    "Ġwhich", "Ġtheir", "Ġsaid", "Ġif", "Ġdo", "Ġwill", "Ġeach", "Ġabout", "Ġhow", "Ġup",
    "Ġout", "Ġthem", "Ġthen", "Ġmany", "Ġsome", "Ġso", "Ġthese", "Ġwould", "Ġother",
)


def gguf_name(name: str) -> str:
    if name in _GLOBAL_TO_GGUF:
        return _GLOBAL_TO_GGUF[name]
    _, i, rest = name.split(".", 2)
    return f"blk.{i}.{_LAYER_TO_GGUF[rest]}"


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """The q/k row permutation of llama.cpp's converter (halves -> interleaved pairs)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return (w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)
            .reshape(w.shape))


def byte_symbols() -> list[str]:
    """GPT-2's 256 byte-to-unicode symbols, in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tiny_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of a byte-level BPE vocabulary of ``vocab_size``."""
    tokens = byte_symbols()
    seen = set(tokens)
    merges: list[str] = []
    n_merges = vocab_size - len(tokens) - len(SPECIAL_TOKENS)
    assert n_merges >= 0, "vocab_size too small for the byte symbols and the special tokens"
    for word in _MERGE_WORDS:
        for end in range(2, len(word) + 1):
            if len(merges) == n_merges:
                break
            left, right = word[: end - 1], word[end - 1]
            if word[:end] in seen:
                continue
            merges.append(f"{left} {right}")
            tokens.append(word[:end])
            seen.add(word[:end])
    assert len(merges) == n_merges, "not enough merge words for this vocab_size"
    types = [1] * len(tokens)
    tokens += list(SPECIAL_TOKENS)
    types += [3] * len(SPECIAL_TOKENS)
    return tokens, types, merges


def reference_config(arch: str, **overrides) -> ModelConfig:
    """The config a tiny GGUF of family ``arch`` describes (as the importer derives it)."""
    if arch == "gemma3":
        n_layers = overrides.pop("n_layers", GEMMA3_SWA_PATTERN)
        layer_types = [
            "global" if i % GEMMA3_SWA_PATTERN == GEMMA3_SWA_PATTERN - 1 else "sliding"
            for i in range(n_layers)
        ]
        return tiny_models.tiny_config(arch, n_layers=n_layers, layer_types=layer_types,
                                     **overrides)
    return tiny_models.tiny_config(arch, **overrides)


def _k_blocks(qtype_name: str, w: np.ndarray) -> np.ndarray:
    """Rounding of ``w`` (float32 ``[rows, cols]``, cols a multiple of 256) to GGUF Q4_K or
    Q6_K blocks, for test files (the gguf library quantizes neither): plain rounding, with the
    block layouts ggml reads."""
    rows, cols = w.shape
    sb = w.reshape(-1, 256).astype(np.float64)
    if qtype_name == "Q6_K":
        sub = sb.reshape(-1, 16, 16)
        amax = np.abs(sub).max(axis=2)  # per 16
        d = np.maximum(amax.max(axis=1), 1e-8) / (127 * 31)
        d16 = d.astype(np.float16)
        sc = np.clip(np.rint(amax / (31 * d16.astype(np.float64))[:, None]), 1, 127)
        step = d16.astype(np.float64)[:, None] * sc
        q = np.clip(np.rint(sub / step[:, :, None]) + 32, 0, 63).astype(np.uint8)
        q = q.reshape(-1, 2, 4, 32)  # [block, half, j, l]: value 128 h + 32 j + l
        ql = (q[:, :, 0:2] & 0x0F) | ((q[:, :, 2:4] & 0x0F) << 4)  # [block, half, j % 2, l]
        qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
              | ((q[:, :, 3] >> 4) << 6))  # [block, half, l]
        out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                              sc.astype(np.int8).view(np.uint8), d16[:, None].view(np.uint8)],
                             axis=1)
        return out.reshape(rows, cols // 256 * 210)
    sub = sb.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    s = np.maximum((sub.max(axis=2) - lo) / 15, 1e-8)
    d = (s.max(axis=1) / 63).astype(np.float16)
    dmin = np.maximum(-lo.max(axis=1) / 63, -lo.min(axis=1) / 63).astype(np.float16)
    sc = np.clip(np.rint(s / d.astype(np.float64)[:, None]), 1, 63).astype(np.uint8)
    dm = np.maximum(dmin.astype(np.float64), 1e-8)[:, None]
    mn = np.clip(np.rint(-lo / dm), 0, 63).astype(np.uint8)
    step = d.astype(np.float64)[:, None] * sc
    q = np.clip(np.rint((sub + dmin.astype(np.float64)[:, None, None] * mn[:, :, None])
                        / step[:, :, None]), 0, 15).astype(np.uint8)
    scales = np.zeros((sub.shape[0], 12), np.uint8)
    for j in range(4):
        scales[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        scales[:, j + 4] = (mn[:, j] & 63) | ((mn[:, j + 4] >> 4) << 6)
        scales[:, j + 8] = (sc[:, j + 4] & 15) | ((mn[:, j + 4] & 15) << 4)
    q = q.reshape(-1, 4, 2, 32)  # chunk j: sub-blocks 2j (low nibbles) and 2j + 1 (high)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales, qs],
                         axis=1)
    return out.reshape(rows, cols // 256 * 144)


def _store(qtype_name: str, w: np.ndarray):
    """(array to write, raw_dtype, the float32 values the file holds) for one tensor."""
    import gguf
    from gguf.quants import dequantize, quantize

    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype_name == "F32" or w.ndim != 2:
        return w, None, w.copy()
    qtype = gguf.GGMLQuantizationType[qtype_name]
    q = _k_blocks(qtype_name, w) if qtype_name in ("Q4_K", "Q6_K") else quantize(w, qtype)
    return q, qtype, np.asarray(dequantize(q, qtype), dtype=np.float32).reshape(w.shape)


def write_tiny_gguf(path, arch: str = "llama", seed: int = 0, weight_type: str = "Q4_0",
                    embed_type: str | None = None, *, gguf_arch: str | None = None,
                    extra_tensors: dict[str, np.ndarray] | None = None,
                    drop_tensors: tuple[str, ...] = (), tokenizer_model: str = "gpt2",
                    tokenizer_pre: str | None = None, chat_template: str | None = CHATML_TEMPLATE,
                    metadata: dict[str, int | float | str] | None = None,
                    tensor_types: dict[str, str] | None = None,
                    **config_overrides) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Write a tiny ``arch`` model as a GGUF file at ``path``.

    ``weight_type`` is the type of the linear weights; ``embed_type`` that of the token
    embedding and untied output head (default Q8_0 for 4- and 5-bit files, so that a pack
    imports the whole file without requantizing, else ``weight_type``). Norms and biases are F32.
    ``gguf_arch`` overrides ``general.architecture`` (the metadata keys keep ``arch``);
    ``extra_tensors`` (GGUF name -> array) and ``drop_tensors`` (GGUF names) make broken files.
    ``metadata`` adds fields (key -> value: an int as int32, a float as float32, a string), as
    the sampling defaults ``general.sampling.*``. ``tensor_types`` (pocketlm name -> type)
    overrides the type of single tensors, for files that mix types as llama.cpp's do.

    Returns ``(config, state_dict)``: the config the file describes and the float32 weights
    under pocketlm names as the file holds them (after quantization, before any permutation).
    """
    import gguf

    path = Path(path)
    if embed_type is None:
        embed_type = "Q8_0" if weight_type in ("Q4_0", "Q4_1", "Q5_0", "Q5_1") else weight_type
    config = reference_config(arch, **config_overrides)
    weights = tiny_models.random_state_dict(config, seed=seed)

    writer = gguf.GGUFWriter(str(path), gguf_arch or arch)  # writes general.architecture
    writer.add_name(f"tiny-{arch}")
    writer.add_file_type({"F32": 0, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8,
                          "Q5_1": 9, "Q4_K": 15, "Q6_K": 18}[weight_type])
    k = f"{arch}."
    writer.add_uint32(k + "block_count", config.n_layers)
    writer.add_uint32(k + "context_length", config.max_context)
    writer.add_uint32(k + "embedding_length", config.d_model)
    writer.add_uint32(k + "feed_forward_length", config.d_ff)
    writer.add_uint32(k + "attention.head_count", config.n_heads)
    writer.add_uint32(k + "attention.head_count_kv", config.n_kv_heads)
    writer.add_float32(k + "rope.freq_base", config.rope_theta)
    writer.add_float32(k + "attention.layer_norm_rms_epsilon", config.norm_eps)
    if arch == "gemma3":
        writer.add_uint32(k + "attention.key_length", config.head_dim)
        writer.add_uint32(k + "attention.value_length", config.head_dim)
        writer.add_uint32(k + "attention.sliding_window", config.sliding_window)
    else:
        assert config.head_dim * config.n_heads == config.d_model

    tokens, types, merges = tiny_vocab(config.vocab_size)
    writer.add_string("tokenizer.ggml.model", tokenizer_model)
    writer.add_string("tokenizer.ggml.pre",
                      tokenizer_pre or ("qwen2" if arch == "qwen2" else "smollm"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_uint32("tokenizer.ggml.bos_token_id", tokens.index("<|endoftext|>"))
    writer.add_uint32("tokenizer.ggml.eos_token_id", tokens.index("<|im_end|>"))
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_int32(key, value)
        else:
            writer.add_float32(key, value)

    state: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        if name in ("embed.weight", "lm_head.weight"):
            qtype = embed_type
        else:
            qtype = weight_type
        qtype = (tensor_types or {}).get(name, qtype)
        stored, raw_dtype, values = _store(qtype, w)
        state[name] = values
        permute = None
        if arch == "llama" and name.endswith(("attn.w_q.weight", "attn.w_q.bias")):
            permute = config.n_heads
        elif arch == "llama" and name.endswith(("attn.w_k.weight", "attn.w_k.bias")):
            permute = config.n_kv_heads
        if permute is not None:
            # the converter permutes the float rows, then quantizes: rows are whole, so
            # quantizing first and permuting the quantized rows is the same thing
            stored = np.ascontiguousarray(permute_rows(stored, permute))
        gname = gguf_name(name)
        if gname in drop_tensors:
            continue
        writer.add_tensor(gname, stored, raw_dtype=raw_dtype)
    for gname, arr in (extra_tensors or {}).items():
        writer.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # float metadata is stored as float32: the file describes the rounded values
    config = dataclasses.replace(config, norm_eps=float(np.float32(config.norm_eps)),
                                 rope_theta=float(np.float32(config.rope_theta)))
    return config, state


@contextlib.contextmanager
def loaded_tiny_model(tmp_path_factory, label: str, seed: int, **kwargs):
    """A module fixture's model: a tiny llama GGUF (Q4_0; ``kwargs`` go to
    :func:`write_tiny_gguf`) loaded through ``pocketlm.load`` under a POCKET_HOME of its own.
    Yields ``{"root", "gguf", "config", "model", "mp"}``."""
    import pytest

    import pocketlm

    root = tmp_path_factory.mktemp(label)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POCKET_HOME", str(root / "home"))
        path = root / "tiny.gguf"
        config, _ = write_tiny_gguf(path, "llama", seed=seed, weight_type="Q4_0", **kwargs)
        yield {"root": root, "gguf": path, "config": config, "model": pocketlm.load(path),
               "mp": mp}
