"""Progress on standard error for long work: a tqdm bar on a terminal, a plain line every
``LINE_EVERY`` seconds otherwise (a log file, CI, ``nohup``), nothing when disabled.

Work shorter than ``LINE_EVERY`` prints nothing off a terminal, so quick commands keep a
clean standard error, while a calibration or an export that runs for many minutes into a
log says where it stands and roughly how long it has left."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator

LINE_EVERY = 30.0  # seconds between plain progress lines when standard error is no terminal


def stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, OSError, ValueError):
        return False


class _Null:
    """A disabled bar: every call is accepted and does nothing."""

    n = 0

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **values) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _amount(n: float, scale: bool, divisor: int) -> str:
    if not scale or abs(n) < divisor:
        return f"{n:,.0f}"
    for suffix in ("k", "M", "G"):
        n /= divisor
        if abs(n) < divisor:
            return f"{n:.1f}{suffix}"
    return f"{n / divisor:.1f}T"


class LineProgress:
    """A progress bar for a standard error that is not a terminal: one plain line (no
    carriage returns) at most every ``every`` seconds, and a closing line if any was printed."""

    def __init__(self, total: float | None, desc: str, unit: str, *, every: float | None = None,
                 initial: float = 0, unit_scale: bool = False, unit_divisor: int = 1000,
                 stream=None, clock=time.monotonic):
        self.total = total
        self.desc = desc
        self.unit = unit.strip()
        self.every = LINE_EVERY if every is None else every
        self.n = initial
        self._start_n = initial
        self._scale = unit_scale
        self._divisor = unit_divisor
        self._stream = stream
        self._clock = clock
        self._t0 = clock()
        self._next = self._t0 + self.every
        self._printed = False
        self._postfix = ""
        self._closed = False

    def _line(self, now: float, done: bool = False) -> str:
        elapsed = now - self._t0
        amount = _amount(self.n, self._scale, self._divisor)
        if self.total:
            amount += f"/{_amount(self.total, self._scale, self._divisor)}"
        text = f"{self.desc}: {amount} {self.unit}".rstrip()
        if self.total and not done:
            text += f" ({100.0 * self.n / self.total:.0f} %)"
        text += f", {_duration(elapsed)}"
        if done:
            text += ", done"
        else:
            text += " elapsed"
            rate = (self.n - self._start_n) / elapsed if elapsed > 0 else 0.0
            if self.total and rate > 0:
                text += f", about {_duration((self.total - self.n) / rate)} left"
        if self._postfix:
            text += f" [{self._postfix}]"
        return text

    def _emit(self, text: str) -> None:
        stream = self._stream or sys.stderr
        try:
            print(text, file=stream, flush=True)
        except (OSError, ValueError):  # a closed or broken stream never stops the work
            pass
        self._printed = True

    def update(self, n: float = 1) -> None:
        self.n += n
        now = self._clock()
        if now >= self._next:
            self._emit(self._line(now))
            self._next = now + self.every

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self._postfix = s

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **values) -> None:
        items = {**(ordered_dict or {}), **values}  # tqdm's signature: a dict and/or keywords
        self._postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._printed:
            self._emit(self._line(self._clock(), done=True))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bar(total: float | None, desc: str, unit: str = "it", *, enabled: bool = True,
        initial: float = 0, unit_scale: bool = False, unit_divisor: int = 1000):
    """A progress bar over ``total`` units (None: unknown) on standard error: tqdm on a
    terminal (cleared when done), :class:`LineProgress` otherwise, a no-op when not
    ``enabled``. Each has ``update(n)``, ``set_postfix_str``, ``close()`` and is a context
    manager."""
    if not enabled:
        return _Null()
    if stderr_is_tty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, initial=initial, unit_scale=unit_scale,
                    unit_divisor=unit_divisor, file=sys.stderr, leave=False)
    return LineProgress(total, desc, unit, initial=initial, unit_scale=unit_scale,
                        unit_divisor=unit_divisor)


def track(items: Iterable, desc: str, unit: str = "it", *, enabled: bool = True,
          total: int | None = None) -> Iterator:
    """Iterate over ``items`` with a :func:`bar` that counts them."""
    if total is None:
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with bar(total, desc, unit, enabled=enabled) as b:
        for item in items:
            yield item
            b.update(1)


__all__ = ["bar", "track", "LineProgress", "LINE_EVERY", "stderr_is_tty"]
