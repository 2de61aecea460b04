"""Progress off a terminal: plain lines at an interval, nothing for short work."""

import io
import subprocess
import sys

from pocketlm import progress


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_short_work_prints_nothing():
    out, clock = io.StringIO(), Clock()
    with progress.LineProgress(10, "packing", "tensor", every=30, stream=out, clock=clock) as b:
        for _ in range(10):
            clock.t += 1.0
            b.update(1)
    assert out.getvalue() == ""


def test_long_work_prints_a_line_per_interval_and_a_closing_line():
    out, clock = io.StringIO(), Clock()
    b = progress.LineProgress(128, "calibrating", "seq", every=30, stream=out, clock=clock)
    for _ in range(128):
        clock.t += 1.0
        b.update(1)
    b.set_postfix(acc="0.812")
    b.close()
    b.close()  # a second close prints nothing more
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 128 // 30 + 1, lines
    assert lines[0] == "calibrating: 30/128 seq (23 %), 30s elapsed, about 1m38s left"
    assert lines[-1] == "calibrating: 128/128 seq, 2m08s, done [acc=0.812]"
    # tqdm's form, a dict (the trainer's loss and speed), with keywords after it
    b = progress.LineProgress(4, "sft", "step", every=1, stream=out, clock=clock)
    b.set_postfix({"loss": "1.250", "tok/s": "900"}, val="1.300")
    clock.t += 2.0
    b.update(1)
    assert out.getvalue().splitlines()[-1].endswith("[loss=1.250, tok/s=900, val=1.300]")


def test_unknown_total_and_scaled_units():
    out, clock = io.StringIO(), Clock()
    b = progress.LineProgress(None, "choosing pieces", "char", every=10, stream=out, clock=clock,
                              unit_scale=True)
    clock.t = 11.0
    b.update(2_500_000)
    assert out.getvalue().splitlines() == ["choosing pieces: 2.5M char, 11s elapsed"]


def test_disabled_bar_accepts_every_call():
    b = progress.bar(5, "x", enabled=False)
    with b:
        b.update(3)
        b.set_postfix(a=1)
        b.set_postfix_str("y")
    assert list(progress.track([1, 2, 3], "x", enabled=False)) == [1, 2, 3]


def test_a_pipe_gets_lines_not_carriage_returns():
    code = ("import time\nfrom pocketlm import progress\nprogress.LINE_EVERY = 0.05\n"
            "for _ in progress.track(range(4), 'working', 'step'):\n    time.sleep(0.06)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    assert "\r" not in p.stderr and lines, p.stderr
    assert all(line.startswith("working: ") for line in lines), lines
    assert lines[-1].startswith("working: 4/4 step") and lines[-1].endswith("done"), lines
