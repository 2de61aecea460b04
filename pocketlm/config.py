"""Model configuration: the one schema every importer, the deploy file and the runtime share.

The runtime implements one decoder with switches; each supported family is a setting of them:

=========  ===========================================================================
family     what differs
=========  ===========================================================================
llama      RMSNorm, SwiGLU, GQA, RoPE (rotate-half); optional tied head (SmolLM2)
qwen2      llama + biases on the q/k/v projections
qwen3      llama + per-head RMSNorm on q and k (QK-norm)
gemma3     QK-norm, sandwich norms (after attention and MLP too), GeGLU (tanh GELU),
           embeddings scaled by sqrt(d_model), sliding-window layers with their own
           RoPE base, tied head
pocket     pocketlm's own: llama + QK-norm + tied head (deep and thin)
=========  ===========================================================================

Tensor names (the training model's state-dict keys, used unchanged in ``.pocket`` files):

    embed.weight                         [vocab_size, d_model]
    layers.{i}.attn_norm.weight          [d_model]
    layers.{i}.attn.w_q.weight           [n_heads * head_dim, d_model]   (+ .bias if qkv_bias)
    layers.{i}.attn.w_k.weight           [n_kv_heads * head_dim, d_model] (+ .bias)
    layers.{i}.attn.w_v.weight           [n_kv_heads * head_dim, d_model] (+ .bias)
    layers.{i}.attn.w_o.weight           [d_model, n_heads * head_dim]
    layers.{i}.attn.q_norm.weight        [head_dim]                       (qk_norm)
    layers.{i}.attn.k_norm.weight        [head_dim]                       (qk_norm)
    layers.{i}.post_attn_norm.weight     [d_model]                        (sandwich_norms)
    layers.{i}.mlp_norm.weight           [d_model]
    layers.{i}.mlp.w_gate.weight         [d_ff, d_model]
    layers.{i}.mlp.w_up.weight           [d_ff, d_model]
    layers.{i}.mlp.w_down.weight         [d_model, d_ff]
    layers.{i}.post_mlp_norm.weight      [d_model]                        (sandwich_norms)
    norm.weight                          [d_model]
    lm_head.weight                       [vocab_size, d_model]            (absent if tied)

Conventions: every norm is ``x / rms(x) * weight`` (Gemma's ``1 + weight`` is folded into the
stored weight at import); RoPE rotates the two halves of each head (``rotate_half``); linear
layers compute ``x @ weight.T (+ bias)``.

Bounds (:meth:`ModelConfig.validate`). A config comes from a file header, so every field is
checked before anything is sized from it; the maxima are far beyond any model this runtime
targets and keep every size the config implies within reach of the native engine's limits:

===================  ===========================  ============================================
field                accepted                     why the limit
===================  ===========================  ============================================
vocab_size           1 .. 2**22 (4,194,304)       largest published vocabularies: 262,144
d_model              1 .. 65,536
n_layers             1 .. 1,024
n_heads              1 .. 1,024; n_heads * head_dim <= 2**20 (the engine's widest product)
n_kv_heads           1 .. n_heads, dividing n_heads
head_dim             2 .. 4,096, even (RoPE rotates halves)
d_ff                 1 .. 2**20 (1,048,576)
max_context          1 .. 2**20 (1,048,576)
sliding_window       None or 1 .. 2**20           required when a layer is "sliding"
norm_eps             0 < eps <= 1                 a zero or negative epsilon divides by zero
rope_theta           1 .. 1e12                    smaller bases overflow the angle tables
rope_theta_local     None or 1 .. 1e12
embed_scale          0 < scale <= 1e4             Gemma's is sqrt(d_model) <= 256
attn_scale           None or 0 < scale <= 1e3     None: 1 / sqrt(head_dim)
tie_embeddings, qkv_bias, qk_norm, sandwich_norms: bools (not 0 / 1 or strings)
===================  ===========================  ============================================

Integers must be ``int`` (not ``bool``), floats finite real numbers; anything else is a
:class:`~pocketlm.errors.FormatError` naming the field, the value and the accepted range.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import reprlib
from dataclasses import dataclass, field
from typing import Any

from .errors import FormatError, UnsupportedError

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "pocket")
ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("global", "sliding")

# field -> (minimum, maximum) of the integers that size memory (see the module docstring)
INT_BOUNDS = {
    "vocab_size": (1, 1 << 22),
    "d_model": (1, 65536),
    "n_layers": (1, 1024),
    "n_heads": (1, 1024),
    "n_kv_heads": (1, 1024),
    "head_dim": (2, 4096),
    "d_ff": (1, 1 << 20),
    "max_context": (1, 1 << 20),
}
MAX_Q_DIM = 1 << 20  # n_heads * head_dim
MAX_SLIDING_WINDOW = 1 << 20
# field -> (lowest, highest, lowest included); None-able fields are listed in OPTIONAL_FLOATS
FLOAT_BOUNDS = {
    "norm_eps": (0.0, 1.0, False),
    "rope_theta": (1.0, 1e12, True),
    "rope_theta_local": (1.0, 1e12, True),
    "embed_scale": (0.0, 1e4, False),
    "attn_scale": (0.0, 1e3, False),
}
OPTIONAL_FLOATS = ("rope_theta_local", "attn_scale")
BOOL_FIELDS = ("tie_embeddings", "qkv_bias", "qk_norm", "sandwich_norms")


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_context: int = 2048
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"
    embed_scale: float = 1.0
    attn_scale: float | None = None  # None: 1 / sqrt(head_dim)
    sliding_window: int | None = None  # window size (tokens, the current one included)
    rope_theta_local: float | None = None  # RoPE base of sliding-window layers
    layer_types: list[str] = field(default_factory=list)  # "global" | "sliding" per layer

    def __post_init__(self) -> None:
        self._validate_fields()  # before n_layers sizes anything (the default layer_types)
        if isinstance(self.layer_types, list) and not self.layer_types:
            self.layer_types = ["global"] * self.n_layers
        self.validate()

    # -- derived -----------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def layer_rope_theta(self, layer: int) -> float:
        if self.layer_types[layer] == "sliding" and self.rope_theta_local is not None:
            return self.rope_theta_local
        return self.rope_theta

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding" else None

    def n_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f = self.d_model, self.d_ff
        per_layer = d * self.q_dim + 2 * d * self.kv_dim + self.q_dim * d + 3 * d * f
        per_layer += 2 * d + (2 * self.head_dim if self.qk_norm else 0)
        per_layer += (2 * d if self.sandwich_norms else 0)
        per_layer += (self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0)
        total = self.n_layers * per_layer + self.vocab_size * d + d
        if not self.tie_embeddings:
            total += self.vocab_size * d
        return total

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model must have, with its shape: the contract importers fill."""
        d, f = self.d_model, self.d_ff
        shapes: dict[str, tuple[int, ...]] = {"embed.weight": (self.vocab_size, d)}
        for i in range(self.n_layers):
            p = f"layers.{i}."
            shapes[p + "attn_norm.weight"] = (d,)
            shapes[p + "attn.w_q.weight"] = (self.q_dim, d)
            shapes[p + "attn.w_k.weight"] = (self.kv_dim, d)
            shapes[p + "attn.w_v.weight"] = (self.kv_dim, d)
            shapes[p + "attn.w_o.weight"] = (d, self.q_dim)
            if self.qkv_bias:
                shapes[p + "attn.w_q.bias"] = (self.q_dim,)
                shapes[p + "attn.w_k.bias"] = (self.kv_dim,)
                shapes[p + "attn.w_v.bias"] = (self.kv_dim,)
            if self.qk_norm:
                shapes[p + "attn.q_norm.weight"] = (self.head_dim,)
                shapes[p + "attn.k_norm.weight"] = (self.head_dim,)
            if self.sandwich_norms:
                shapes[p + "post_attn_norm.weight"] = (d,)
                shapes[p + "post_mlp_norm.weight"] = (d,)
            shapes[p + "mlp_norm.weight"] = (d,)
            shapes[p + "mlp.w_gate.weight"] = (f, d)
            shapes[p + "mlp.w_up.weight"] = (f, d)
            shapes[p + "mlp.w_down.weight"] = (d, f)
        shapes["norm.weight"] = (d,)
        if not self.tie_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, d)
        return shapes

    # -- checks and (de)serialisation --------------------------------------------------------
    def validate(self) -> None:
        """Raise FormatError (UnsupportedError for an unknown family or activation) unless every
        field is of its type and within the bounds of the module docstring."""
        self._validate_fields()
        if not isinstance(self.layer_types, list) or len(self.layer_types) != self.n_layers or \
                not all(isinstance(t, str) and t in LAYER_TYPES for t in self.layer_types):
            raise FormatError(
                "model config: layer_types must list 'global' or 'sliding' for each of the "
                f"{self.n_layers} layers, got {short_repr(self.layer_types)}"
            )
        if "sliding" in self.layer_types and self.sliding_window is None:
            raise FormatError("model config: sliding layers need a positive sliding_window, "
                              "got None")

    def _validate_fields(self) -> None:
        """The checks of every scalar field (layer_types aside): cheap, and nothing is sized
        from a field before it passes."""
        for name in ("arch", "activation"):
            if not isinstance(getattr(self, name), str):
                raise FormatError(f"model config: {name} must be a string, got "
                                  f"{short_repr(getattr(self, name))}")
        if self.arch not in FAMILIES:
            raise UnsupportedError(
                f"unsupported architecture {self.arch!r}; supported: {', '.join(FAMILIES)}"
            )
        if self.activation not in ACTIVATIONS:
            raise UnsupportedError(
                f"unsupported activation {self.activation!r}; supported: {', '.join(ACTIVATIONS)}"
            )
        for name, (lo, hi) in INT_BOUNDS.items():
            _check_int(name, getattr(self, name), lo, hi)
        if self.n_heads % self.n_kv_heads:
            raise FormatError(
                f"model config: n_heads ({self.n_heads}) must be a multiple of "
                f"n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise FormatError(f"model config: head_dim must be even, got {self.head_dim}")
        if self.q_dim > MAX_Q_DIM:
            raise FormatError(f"model config: n_heads * head_dim must be at most {MAX_Q_DIM}, "
                              f"got {self.n_heads} * {self.head_dim} = {self.q_dim}")
        if self.sliding_window is not None:
            _check_int("sliding_window", self.sliding_window, 1, MAX_SLIDING_WINDOW)
        for name, (lo, hi, lo_included) in FLOAT_BOUNDS.items():
            value = getattr(self, name)
            if value is None and name in OPTIONAL_FLOATS:
                continue
            setattr(self, name, _check_float(name, value, lo, hi, lo_included,
                                             name in OPTIONAL_FLOATS))
        for name in BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise FormatError(f"model config: {name} must be true or false, got "
                                  f"{short_repr(value)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        if not isinstance(data, dict):
            raise FormatError(f"model config must be a JSON object of fields, got "
                              f"{short_repr(data)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise FormatError(
                f"model config has unknown fields {sorted(unknown)}; this file may come from a "
                "newer pocketlm: upgrade with `pip install -U pocketlm`"
            )
        try:
            return cls(**data)
        except TypeError as exc:
            raise FormatError(f"model config is incomplete: {exc}") from None


@dataclass
class GenerationDefaults:
    """A model's own generation settings, stored in its deploy file (the ``generation``
    metadata) as the importer found them in the source (a GGUF file's ``general.sampling.*``
    keys, a Hugging Face folder's ``generation_config.json``).

    A sampling field the source does not set holds the built-in value (greedy decoding, every
    filter off); ``max_tokens`` None means the model names no length, and each caller's own
    built-in length applies. :meth:`resolve` is the one rule every surface (API, CLI, server)
    follows: an explicit argument wins, then the model's setting, then the built-in one.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["max_tokens"] is None:
            del d["max_tokens"]
        return d

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """FormatError unless every default is a value generation accepts (finite numbers in
        their ranges, non-negative integers)."""
        def number(name: str, lo: float, hi: float, lo_included: bool) -> None:
            setattr(self, name, _check_float(name, getattr(self, name), lo, hi, lo_included,
                                             False, what="generation defaults"))

        number("temperature", 0.0, 1e4, True)
        number("top_p", 0.0, 1.0, True)  # 0: the most likely token alone
        number("min_p", 0.0, 1.0, True)
        number("repetition_penalty", 0.0, 1e4, False)
        _check_int("top_k", self.top_k, 0, INT_BOUNDS["vocab_size"][1],
                   what="generation defaults")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 0, INT_BOUNDS["max_context"][1],
                       what="generation defaults")

    def resolve(self, builtin_max_tokens: int | None = None, **explicit: Any) -> dict[str, Any]:
        """The settings to generate with: each of ``explicit`` (temperature, top_k, top_p,
        min_p, repetition_penalty, max_tokens) that is not None, else the model's, else the
        built-in one (``builtin_max_tokens`` for the length, which each caller picks: None
        when it has none either). Values are not checked here: the sampler checks them."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(explicit) - set(names))
        if unknown:
            raise TypeError(f"unknown generation setting {unknown[0]!r}")
        out = {}
        for name in names:
            value = explicit.get(name)
            out[name] = getattr(self, name) if value is None else value
        if out["max_tokens"] is None:
            out["max_tokens"] = builtin_max_tokens
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationDefaults:
        """The defaults in ``data``; fields this version does not know are ignored."""
        if not isinstance(data, dict):
            raise FormatError(f"generation defaults must be a JSON object, got {short_repr(data)}")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if values == _UNSET_BEFORE_IMPORT:
            # what every deploy file held before the importers read the source's settings:
            # the built-in values and a max_tokens of 256 that no model chose
            del values["max_tokens"]
        return cls(**values)


# the generation metadata of deploy files packed before the importers filled it
_UNSET_BEFORE_IMPORT = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                        "repetition_penalty": 1.0, "max_tokens": 256}


def short_repr(value: Any) -> str:
    """A short repr of a value read from a file or given by a caller, for an error message
    (never huge, never raises: integers past Python's str conversion limit are described)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = reprlib.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_int(name: str, value: Any, lo: int, hi: int, *, what: str = "model config") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"{what}: {name} must be an integer in {lo}..{hi}, got "
                          f"{short_repr(value)}")
    if not lo <= value <= hi:
        raise FormatError(f"{what}: {name} must be in {lo}..{hi}, got {short_repr(value)}")


def _check_float(name: str, value: Any, lo: float, hi: float, lo_included: bool,
                 optional: bool, *, what: str = "model config") -> float:
    """``value`` as a float if it is a finite real number in the range, else FormatError."""
    bounds = f"{'[' if lo_included else '('}{lo:g}, {hi:g}]"
    expected = f"a finite number in {bounds}" + (" or null" if optional else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FormatError(f"{what}: {name} must be {expected}, got {short_repr(value)}")
    try:
        v = float(value)
    except OverflowError:  # an integer beyond float range
        v = math.inf
    if not math.isfinite(v) or v > hi or v < lo or (v == lo and not lo_included):
        raise FormatError(f"{what}: {name} must be {expected}, got {short_repr(value)}")
    return v
