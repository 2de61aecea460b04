"""The runtime: one model's weights, its engine, and the checks every call gets.

The runtime holds weights as loaded (float32 arrays or :class:`~pocketlm.quant.QuantTensor`
views of the deploy file) and hands the forward pass to one of two engines
(:mod:`pocketlm.runtime.engine`) that run the same math. It never imports torch.

* the native engine (``pocketlm._native.NativeModel``): the whole forward pass, every layer
  and the output head, in one C call per :meth:`Runtime.forward`. Used when the kernel backend
  is native (``POCKET_KERNELS``, default when built) and every weight is in a layout it
  supports (INT4 / INT5 / INT8 QuantTensors, float32 arrays, C-contiguous). ``POCKET_ACT``
  picks float (``f32``) or int8 (``q8``) activations for the quantized products (default
  ``q8`` where the CPU level has SIMD int8 products: avx2, avx512, neon; ``f32`` at the
  portable scalar level), ``POCKET_KV`` the KV cache format (``f32`` | ``f16`` | ``q8``;
  default ``f16`` with q8 activations, ``f32`` with f32), ``POCKET_THREADS`` the threads
  (default: 2, or the usable CPUs if fewer). Its caches are :class:`NativeKVCache` objects.
* the numpy reference (``POCKET_KERNELS=numpy``, or ``engine="numpy"``; also for weights
  handed in a layout the engine does not take, see :class:`Runtime`), which computes layer by
  layer in numpy only (:mod:`pocketlm.runtime.kernels.numpy_ref`, never the native extension)
  and is the specification the native engine is tested against. A model the native engine
  refuses is an error, not a reason to switch engines.

The ``POCKET_*`` settings are read once, when the runtime is created
(:meth:`~pocketlm.runtime.settings.EngineSettings.from_env`, or the ``settings`` given), and a
bad value is an error whichever engine runs.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from ..config import ModelConfig
from ..errors import ContextLengthError, FormatError, KernelError, TokenIdError
from ..quant import EncodedQuantTensor, QuantTensor
from . import kernels as K
from .adapters import find_adapters
from .engine import Engine, KVCache, NativeKVCache, NativeModelEngine, NumpyEngine
from .kernels import native as _native_kernels
from .settings import EngineSettings

Weight = np.ndarray | QuantTensor

__all__ = ["KVCache", "NativeKVCache", "Runtime", "Weight"]


def check_token_ids(ids, vocab_size: int, what: str = "") -> np.ndarray:
    """``ids`` (a list, tuple or 1-D array of integers in ``0 .. vocab_size - 1``) as int64; a
    :class:`TokenIdError` for anything else (floats, strings, bools, other shapes), never a
    silent conversion. ``what`` (e.g. ``"forward()"``) leads the messages."""
    pre = f"{what}: " if what else ""
    if not isinstance(ids, (list, tuple, np.ndarray)):
        raise TokenIdError(f"{pre}token ids must be a list of integers, got "
                           f"{type(ids).__name__}")
    if isinstance(ids, np.ndarray) and ids.dtype.kind != "O":
        if ids.ndim != 1:
            raise TokenIdError(f"{pre}token ids must be one-dimensional, got shape {ids.shape}")
        if ids.size and ids.dtype.kind not in "iu":
            raise TokenIdError(f"{pre}token ids must be integers, got an array of {ids.dtype}")
        a = ids
    else:  # a list, a tuple or an object array: each value is looked at (no bool taken as 1)
        if isinstance(ids, np.ndarray) and ids.ndim != 1:
            raise TokenIdError(f"{pre}token ids must be one-dimensional, got shape {ids.shape}")
        for i in ids:
            if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
                raise TokenIdError(f"{pre}token ids must be integers, got {i!r} "
                                   f"({type(i).__name__})")
            if not 0 <= i < vocab_size:
                raise TokenIdError(f"token id {i} is out of range 0..{vocab_size - 1}")
        return np.asarray(ids, dtype=np.int64).reshape(-1)
    if a.size and (a.min() < 0 or a.max() >= vocab_size):
        bad = a[(a < 0) | (a >= vocab_size)][0]
        raise TokenIdError(f"token id {bad} is out of range 0..{vocab_size - 1}")
    return a.astype(np.int64, copy=False)


class Runtime:
    def __init__(self, config: ModelConfig, weights: dict[str, Weight], *,
                 engine: str | None = None, file_backed: bool = False,
                 settings: EngineSettings | None = None):
        """``engine``: ``"native"`` (required: raises if it cannot be used), ``"numpy"`` (the
        reference) or None (native when the native backend is in force, ``POCKET_KERNELS``;
        numpy only when a weight is in a layout the engine does not take, with the reason in
        ``engine_note``: a model the engine refuses is a KernelError, never a quiet switch to
        numpy). ``file_backed``: the weights are views of a read-only file mapping (a deploy
        file), so the native engine may drop their pages once copied (checked: a weight in
        memory is a KernelError, since dropping its pages would lose it).
        ``settings``: the engine settings (default: read from the environment now; an
        invalid ``POCKET_*`` value raises KernelError or UnsupportedError)."""
        self.config = config
        expected = config.tensor_shapes()
        for name, shape in expected.items():
            w = weights.get(name)
            if w is None:
                raise FormatError(f"model weights lack tensor {name!r}")
            if not isinstance(w, (np.ndarray, QuantTensor)):
                raise FormatError(f"tensor {name!r} must be a numpy array or a QuantTensor, got "
                                  f"{type(w).__name__}")
            if tuple(w.shape) != tuple(shape):
                raise FormatError(f"tensor {name!r} has shape {tuple(w.shape)}, expected {shape}")
        # LoRA adapters kept beside the weights (runtime.adapters): checked here, whichever
        # engine runs them
        self.lora_rank = next((int(a.shape[0]) for a, _ in
                               find_adapters(config, weights).values()), 0)
        self.w = weights
        self.engine_note = ""  # why the native engine is not in use
        if engine not in (None, "native", "numpy"):
            raise KernelError(f"engine must be 'native', 'numpy' or None, got {engine!r}")
        self.settings = EngineSettings.from_env() if settings is None else settings
        self._engine: Engine = NumpyEngine(config, weights)
        if engine == "native" or (engine is None and K.backend_name(self.settings) == "native"):
            # a setting this machine cannot run is the user's error, not a model the engine
            # cannot run
            _native_kernels.check_settings(self.settings)
            if not _native_kernels.engine_available():
                reason = _native_kernels.unavailable_reason() or "the native engine is not built"
            else:
                reason = _native_kernels.engine_weights(config, weights, adapters=False)[1]
            if reason and engine is None:
                # weights handed in a layout only the reference reads (or no engine built):
                # the numpy path, and the reason is kept; nothing else falls back
                self.engine_note = reason
            else:
                # a model the engine refuses is an error: running it anyway on the numpy path
                # would hide the problem (POCKET_KERNELS=numpy is the way to ask for numpy)
                self.native = _native_kernels.NativeEngine(
                    config, weights, settings=self.settings, release_source=file_backed)
                for w in weights.values():
                    if isinstance(w, EncodedQuantTensor):
                        w.release()  # repacked by the engine: the decoded arrays can go

    @property
    def native(self):
        """The native engine (:class:`~pocketlm.runtime.kernels.native.NativeEngine`) when
        in use, else None. Setting it (a NativeEngine over these weights, or None for the
        numpy reference) switches the engine; caches made before belong to the old one."""
        return self._engine.native

    @native.setter
    def native(self, native_engine) -> None:
        self._engine = (NumpyEngine(self.config, self.w) if native_engine is None
                        else NativeModelEngine(self.config, native_engine))

    @property
    def engine(self) -> str:
        """``"native"`` (the whole forward pass in C) or ``"numpy"`` (layer by layer)."""
        return self._engine.name

    def _check_cache(self, cache) -> None:
        if not isinstance(cache, KVCache):
            raise KernelError(f"expected a KV cache of this runtime (new_cache()), got "
                              f"{type(cache).__name__}")
        if not self._engine.owns(cache):
            raise KernelError("this KV cache belongs to another runtime")
        n = cache.length  # a public attribute: one set by hand is checked, not trusted
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or not (
                0 <= n <= cache.capacity):
            raise KernelError(f"the KV cache's length must be an integer from 0 to its capacity "
                              f"{cache.capacity}, got {n!r} (set it with truncate())")

    def _token_ids(self, ids, what: str, empty: str = "needs at least one token"
                   ) -> np.ndarray:
        ids = check_token_ids(ids, self.config.vocab_size, what)
        if ids.size == 0:
            raise TokenIdError(f"{what} {empty}")
        return ids

    @staticmethod
    def _flags(screen, n: int | None, what: str):
        """``screen`` checked: a bool (``n`` None), or None or ``n`` bools (one per row)."""
        if n is None:
            if not isinstance(screen, (bool, np.bool_)):
                raise KernelError(f"{what} must be True or False, got {screen!r}")
            return screen
        if screen is None:
            return None
        if not isinstance(screen, (list, tuple, np.ndarray)) or len(screen) != n or not all(
                isinstance(s, (bool, np.bool_)) for s in screen):
            shown = f"{len(screen)} entries" if isinstance(screen, (list, tuple, np.ndarray)) \
                else repr(screen)
            raise KernelError(f"{what} must be None or {n} bools (one per row), got {shown}")
        return screen

    @staticmethod
    @contextmanager
    def _using(caches):
        """Hold ``caches`` for one call: a cache serves one sequence, one call at a time (two
        threads running the same cache would write the same positions). Left by this call's
        token, whatever line an interrupt stops it at (see :class:`~pocketlm.runtime.engine.CacheGuard`)."""
        token = object()
        try:
            for c in caches:
                if not c.busy.enter(token):
                    raise KernelError("this KV cache is in use by another call (another "
                                      "thread): a cache serves one sequence, one call at a time")
            yield
        finally:
            for c in caches:
                c.busy.leave(token)

    def new_cache(self, capacity: int | None = None) -> KVCache:
        cap = self.config.max_context if capacity is None else capacity
        if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)):
            raise ContextLengthError(f"KV cache capacity must be a positive number of positions, "
                                     f"got {cap!r}")
        cap = int(cap)
        if cap > self.config.max_context:
            raise ContextLengthError(f"requested context {cap} exceeds the model's maximum "
                                     f"{self.config.max_context}")
        if cap <= 0:
            raise ContextLengthError(f"KV cache capacity must be positive, got {cap}")
        return self._engine.new_cache(cap)

    def cache_nbytes(self, capacity: int) -> int:
        """Bytes of keys and values that :meth:`new_cache` allocates for ``capacity``
        positions (the native engine rounds positions up to 16 and may store float16, or int8
        with a float16 scale per 16 values)."""
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or \
                capacity <= 0:
            raise ContextLengthError(f"KV cache capacity must be a positive number of "
                                     f"positions, got {capacity!r}")
        return self._engine.cache_nbytes(int(capacity))

    def forward_batch(self, ids, caches: list[KVCache], *,
                      screen: list[bool] | None = None) -> np.ndarray:
        """One token for each of several sequences (continuous batching): ``ids[i]`` runs at
        the next position of ``caches[i]``; returns float32 logits ``[len(ids), vocab]``.

        The native engine streams the weights once for the whole batch; each row computes bit
        for bit what :meth:`forward` of that one token computes, so results do not depend on
        who else is in the batch. The caches must be distinct. ``screen``: per row, as in
        :meth:`forward`."""
        ids = self._token_ids(ids, "forward_batch()")
        n = ids.shape[0]
        if not isinstance(caches, (list, tuple)) or len(caches) != n:
            shown = len(caches) if isinstance(caches, (list, tuple)) else type(caches).__name__
            raise KernelError(f"forward_batch() takes a list of caches, one per token: got "
                              f"{shown} for {n} tokens")
        for c in caches:
            self._check_cache(c)
        if len({id(c) for c in caches}) != n:
            raise KernelError("a KV cache appears twice in one batch")
        screen = self._flags(screen, n, "forward_batch() screen")
        with self._using(caches):
            for c in caches:
                if c.length >= c.capacity:
                    raise ContextLengthError(f"{c.length + 1} tokens do not fit the context of "
                                             f"{c.capacity}")
            return self._engine.forward_batch(ids, caches, screen)

    def copy_prefix(self, dst: KVCache, src: KVCache, n: int) -> None:
        """Make the first ``n`` positions of ``dst`` those of ``src`` (``dst.length = n``): a
        prompt prefix computed once serves another sequence."""
        if dst is src:
            raise KernelError("copy_prefix() needs two different caches")
        for c in (dst, src):
            if not isinstance(c, KVCache):
                self._check_cache(c)  # names what it got
        if type(src) is not type(dst):
            raise KernelError("copy_prefix() needs two caches of the same engine")
        self._check_cache(src)
        self._check_cache(dst)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise ContextLengthError(f"copy_prefix() copies a whole number of positions, got "
                                     f"{n!r}")
        with self._using([dst, src]):
            if not 0 <= n <= min(src.length, dst.capacity):
                raise ContextLengthError(f"cannot copy {n} positions from a cache holding "
                                         f"{src.length} into one of capacity {dst.capacity}")
            self._engine.copy_prefix(dst, src, int(n))

    def forward(self, ids, cache: KVCache, *, all_logits: bool = False,
                screen: bool = False) -> np.ndarray:
        """Run ``ids`` at the next positions of ``cache``; return float32 logits
        ``[len(ids), vocab]`` (``all_logits``) or ``[vocab]`` for the last token.

        ``screen=True`` (without ``all_logits``) tells the engine that the caller takes the
        largest logit only (greedy decoding without penalties, biases or a grammar): a native
        engine with a screened head (``POCKET_HEAD_SCREEN``, docs/engine.md) then returns the
        head's values on its K best tiles of 16 rows and estimates elsewhere. Every other
        call gets every logit from the head."""
        ids = self._token_ids(ids, "forward()")
        n = ids.shape[0]
        self._check_cache(cache)
        all_logits = self._flags(all_logits, None, "forward() all_logits")
        screen = self._flags(screen, None, "forward() screen")
        with self._using([cache]):
            start = cache.length
            if start + n > cache.capacity:
                raise ContextLengthError(f"{start + n} tokens do not fit the context of "
                                         f"{cache.capacity}")
            return self._engine.forward(ids, cache, all_logits, screen)

    MAX_VERIFY = 128  # drafted tokens one verify() call checks at most

    def verify(self, ids, cache: KVCache, *, screen: bool = False) -> np.ndarray:
        """Verify drafted tokens: run ``ids`` at the next positions of ``cache`` and return
        float32 logits ``[len(ids), vocab]``, row ``i`` exactly (bit for bit) what a one-token
        :meth:`forward` of ``ids[i]`` computes after ``ids[:i]``: one pass over the weights for
        all of them. ``cache.length`` grows by ``len(ids)``; a caller that accepts only the
        first ``a`` rows calls ``cache.truncate(length + a)`` (the rest is overwritten later).
        ``screen``: as in :meth:`forward`, for every row."""
        ids = self._token_ids(ids, "verify()", f"takes 1 to {self.MAX_VERIFY} tokens, got 0")
        n = ids.shape[0]
        if n > self.MAX_VERIFY:
            raise TokenIdError(f"verify() takes 1 to {self.MAX_VERIFY} tokens, got {n}")
        self._check_cache(cache)
        screen = self._flags(screen, None, "verify() screen")
        with self._using([cache]):
            if cache.length + n > cache.capacity:
                raise ContextLengthError(f"{cache.length + n} tokens do not fit the context of "
                                         f"{cache.capacity}")
            return self._engine.verify(ids, cache, screen)

    def verify_batch(self, drafts: list[tuple[list[int], KVCache]], *,
                     screen: list[bool] | None = None) -> list[np.ndarray]:
        """:meth:`verify` for several sequences in one pass over the weights: ``drafts`` is a
        list of ``(ids, cache)`` with distinct caches; returns each one's logits
        ``[len(ids), vocab]``, rows exactly as :meth:`verify` computes them (the speculative
        step of continuous batching). ``screen``: per sequence, as in :meth:`forward`."""
        if not isinstance(drafts, (list, tuple)) or not drafts or not all(
                isinstance(d, (list, tuple)) and len(d) == 2 for d in drafts):
            raise KernelError("verify_batch() takes a non-empty list of (token ids, cache) "
                              "pairs")
        checked = []
        for ids, cache in drafts:
            ids = self._token_ids(ids, "verify_batch()",
                                  f"takes 1 to {self.MAX_VERIFY} tokens per sequence, got 0")
            if ids.shape[0] > self.MAX_VERIFY:
                raise TokenIdError(f"verify_batch() takes 1 to {self.MAX_VERIFY} tokens per "
                                   f"sequence, got {ids.shape[0]}")
            self._check_cache(cache)
            checked.append((ids, cache))
        if len({id(c) for _, c in drafts}) != len(drafts):
            raise KernelError("a KV cache appears twice in one batch")
        screen = self._flags(screen, len(drafts), "verify_batch() screen")
        with self._using([c for _, c in checked]):
            for ids, cache in checked:
                if cache.length + ids.shape[0] > cache.capacity:
                    raise ContextLengthError(f"{cache.length + ids.shape[0]} tokens do not fit "
                                             f"the context of {cache.capacity}")
            return self._engine.verify_batch(checked, screen)
