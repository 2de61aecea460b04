"""The ``pocket`` command line: verbs, output and one-line errors (offline, on a tiny model)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiny_gguf

from pocketlm import cli
from pocketlm.errors import ModelNotFoundError
from pocketlm.registry import RECIPES, REGISTRY, TRIMMED

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny GGUF and its deploy file, packed once through the CLI."""
    root = tmp_path_factory.mktemp("cli")
    src = root / "tiny.gguf"
    tiny_gguf.write_tiny_gguf(src, "llama", seed=4, weight_type="Q4_1")
    out = root / "tiny.pocket"
    assert cli.main(["pack", str(src), "-o", str(out)]) == 0
    return {"root": root, "gguf": src, "pocket": out}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("POCKET_MODEL", raising=False)
    return tmp_path / "home"


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, *words: str) -> str:
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pocket: error: "), err
    for w in words:
        assert w in lines[0], (w, err)
    return lines[0]


# -- pack ------------------------------------------------------------------------------------
def test_pack_prints_a_report(files, tmp_path, capsys):
    out = tmp_path / "again.pocket"
    code, stdout, _ = run_cli(capsys, "pack", files["gguf"], "-o", out)
    assert code == 0 and out.is_file()
    assert f"wrote {out}" in stdout
    assert "bits per weight:" in stdout
    assert "largest relative errors" in stdout
    assert "imported losslessly" in stdout
    assert stdout.count("lossless)") >= 1


def test_pack_refuses_to_overwrite(files, tmp_path, capsys):
    out = tmp_path / "exists.pocket"
    out.write_bytes(b"precious")
    code, stdout, err = run_cli(capsys, "pack", files["gguf"], "-o", out)
    assert_one_line_error(code, err, "--force", str(out))
    assert out.read_bytes() == b"precious"
    code, stdout, err = run_cli(capsys, "pack", files["gguf"], "-o", out, "--force",
                                "--embed-bits", 4)
    assert code == 0 and out.read_bytes()[:8] != b"precious"
    code, stdout, _ = run_cli(capsys, "inspect", out, "--json")
    assert json.loads(stdout)["quant"]["embed_bits"] == 4


def test_pack_group_size_that_does_not_divide_a_tensor(files, tmp_path, capsys):
    out = tmp_path / "g64.pocket"
    code, _, err = run_cli(capsys, "pack", files["gguf"], "-o", out, "--group-size", 64)
    # d_ff = 96: the down projection's input dimension is not a multiple of 64
    assert_one_line_error(code, err, "mlp.w_down.weight", "group size 64")
    assert not out.exists()


@pytest.mark.parametrize("where", ["folder", "under-a-file", "unwritable"])
def test_pack_to_a_place_it_cannot_write_fails_first(files, tmp_path, capsys, monkeypatch,
                                                     where):
    """The output is checked before the source is read and quantized; nothing is left behind."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = {"folder": tmp_path, "under-a-file": blocker / "x.pocket",
           "unwritable": Path("/proc/x.pocket")}[where]

    def no_source(*args, **kwargs):
        raise AssertionError("the source was opened")

    monkeypatch.setattr("pocketlm.pack.open_source", no_source)
    before = sorted(tmp_path.rglob("*"))
    code, _, err = run_cli(capsys, "pack", files["gguf"], "-o", out, "--force")
    assert_one_line_error(code, err, f"cannot write {out}")
    assert sorted(tmp_path.rglob("*")) == before


def test_pack_precision_flags(tmp_path, capsys):
    """A Q5_0 GGUF: the default keeps it (INT5), --all-int4 requantizes; both flags at once is a
    usage error."""
    from pocketlm.formats.pocketfile import PocketFile

    src = tmp_path / "q5.gguf"
    tiny_gguf.write_tiny_gguf(src, "llama", seed=4, weight_type="Q5_0")
    schemes = {}
    for flags in ([], ["--all-int4"]):
        out = tmp_path / f"q5{len(flags)}.pocket"
        code, stdout, _ = run_cli(capsys, "pack", src, "-o", out, *flags)
        assert code == 0, stdout
        schemes[tuple(flags)] = PocketFile(out).json("quant")["scheme"]
    assert schemes == {(): "int4-g32+int5", ("--all-int4",): "int4-g32"}
    with pytest.raises(SystemExit) as exc:  # a usage error
        cli.main(["pack", str(src), "-o", str(tmp_path / "x.pocket"), "--all-int4",
                  "--keep-precision"])
    assert exc.value.code == 1
    assert_one_line_error(1, capsys.readouterr().err, "not allowed with argument")
    assert not (tmp_path / "x.pocket").exists()


def test_pack_bad_group_size_is_a_one_line_usage_error(files, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["pack", str(files["gguf"]), "-o", str(tmp_path / "x.pocket"),
                  "--group-size", "48"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("pocket: error:") and "48" in err and err.count("\n") == 1
    assert not (tmp_path / "x.pocket").exists()


# -- inspect ---------------------------------------------------------------------------------
def test_inspect(files, capsys):
    code, stdout, _ = run_cli(capsys, "inspect", files["pocket"])
    assert code == 0
    assert "model:       llama, 3 layers, d_model 64" in stdout
    assert "vocab 320" in stdout
    assert "int4-g32" in stdout
    assert "tiny.gguf" in stdout
    assert "checksums:   verified" in stdout
    code, stdout, _ = run_cli(capsys, "inspect", files["pocket"], "--tensors", "--no-verify")
    assert code == 0 and "layers.0.attn.w_q.weight" in stdout and "not verified" in stdout


def test_inspect_shows_what_the_file_holds_and_no_terminal_escapes(files, capsys, tmp_path):
    import hashlib
    import struct

    code, stdout, _ = run_cli(capsys, "inspect", files["pocket"])
    assert code == 0 and "embeddings INT8, 22 quantized tensors" in stdout  # read, not the option
    # a crafted header's strings: an escape sequence or a newline is written out, not sent to
    # the terminal (the header checksum is no authentication)
    buf = files["pocket"].read_bytes()
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8:8 + n])
    md = header["__metadata__"]
    md.pop("header_checksum")
    md["provenance"] = json.dumps({"source_file": "a\x1b[31mRED\x1b[0m\x07\nsecond line",
                                   "source_sha256": "derived", "packed_at": "\x1b]0;pwned\x07",
                                   "untrimmed_sha256": "0123456789abcdef99"})
    md["quant"] = json.dumps({**json.loads(md["quant"]), "calibration": {
        "head": {"top1_vs_float": {"en": float("nan")}}}})  # NaN: no JSON value
    tensors = {k: [v["dtype"], v["shape"], v["data_offsets"]] for k, v in header.items()
               if k != "__metadata__"}
    canon = json.dumps({"metadata": md, "tensors": tensors}, sort_keys=True,
                       separators=(",", ":"), ensure_ascii=True)
    md["header_checksum"] = "sha256:" + hashlib.sha256(canon.encode()).hexdigest()
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    crafted = tmp_path / "crafted.pocket"
    crafted.write_bytes(struct.pack("<Q", len(h)) + h + buf[8 + n:])
    code, stdout, _ = run_cli(capsys, "inspect", crafted)
    assert code == 0 and "\x1b" not in stdout and "\x07" not in stdout, stdout
    assert "source:      a\\x1b[31mRED\\x1b[0m\\x07\\nsecond line (" in stdout
    # a trimmed model's source_sha256 is a derived id: the source file's own hash is shown
    assert "sha256 0123456789abcdef..." in stdout
    code, stdout, _ = run_cli(capsys, "inspect", crafted, "--json")

    def refuse(constant):
        raise ValueError(f"{constant} is no JSON value")

    data = json.loads(stdout, parse_constant=refuse)  # it echoed a bare NaN
    assert data["quant"]["calibration"]["head"]["top1_vs_float"] == {"en": None}


def test_inspect_json(files, capsys):
    code, stdout, _ = run_cli(capsys, "inspect", files["pocket"], "--json")
    assert code == 0
    data = json.loads(stdout)
    assert data["format"] == "pocket"
    assert data["config"]["arch"] == "llama" and data["config"]["vocab_size"] == 320
    assert data["quant"]["tensors"] == 22  # 7 linear weights in each of 3 layers, embedding
    assert data["provenance"]["source_format"] == "gguf"
    assert data["file_bytes"] == files["pocket"].stat().st_size
    assert "checksums" not in data and "tensor_list" not in data
    code, stdout, _ = run_cli(capsys, "inspect", files["pocket"], "--json", "--tensors")
    listed = {t["name"]: t for t in json.loads(stdout)["tensor_list"]}  # it was dropped
    assert code == 0 and listed["layers.0.attn.w_q.weight"]["shape"]


def test_inspect_a_gguf_is_refused(files, capsys):
    code, _, err = run_cli(capsys, "inspect", files["gguf"])
    assert_one_line_error(code, err, "pocket pack")


# -- run -------------------------------------------------------------------------------------
def test_run_streams_text(files, capsys):
    code, stdout, err = run_cli(capsys, "run", "-m", files["pocket"], "hello", "-n", 5, "--raw")
    assert code == 0
    assert stdout.endswith("\n") and len(stdout) > 1
    import pocketlm

    m = pocketlm.load(files["pocket"])
    assert stdout == m.generate("hello", max_tokens=5) + "\n"
    code, echoed, _ = run_cli(capsys, "run", "-m", files["pocket"], "hello", "-n", 5, "--echo",
                              "--raw")
    assert echoed == "hello" + stdout


def test_run_never_ends_in_half_a_character(files, capsys):
    # every token is one byte of 你: -n 2 stops inside it, -n 3 after it
    for n, expected in [(2, "\n"), (3, "你\n")]:
        for mode in ("--raw", "--chat"):
            code, stdout, _ = run_cli(capsys, "run", "-m", files["pocket"], "hello", "-n", n,
                                      "--regex", "你+", mode)
            assert (code, stdout) == (0, expected)


def test_run_uses_the_chat_template_by_default(files, capsys):
    code, stdout, _ = run_cli(capsys, "run", "-m", files["pocket"], "hello", "-n", 5)
    assert code == 0
    import pocketlm

    m = pocketlm.load(files["pocket"])
    reply = m.chat([{"role": "user", "content": "hello"}], max_tokens=5)
    assert stdout == reply + "\n"
    with pytest.raises(SystemExit) as exc:  # mutually exclusive flags: a usage error
        cli.main(["run", "-m", str(files["pocket"]), "hi", "--chat", "--raw"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("pocket: error:") and err.count("\n") == 1


def test_run_sampling_and_chat_flags(files, capsys):
    args = ["run", "-m", files["pocket"], "hello", "-n", 8, "--temp", 0.9, "--seed", 3,
            "--top-k", 40, "--top-p", 0.95, "--min-p", 0.01, "--repeat-penalty", 1.1]
    code1, out1, _ = run_cli(capsys, *args)
    code2, out2, _ = run_cli(capsys, *args)
    assert code1 == code2 == 0 and out1 == out2
    # --temperature (the OpenAI / Hugging Face name) is --temp
    spelled = [("--temperature" if a == "--temp" else a) for a in args]
    assert run_cli(capsys, *spelled)[:2] == (0, out1)
    code, out, err = run_cli(capsys, "run", "-m", files["pocket"], "hi", "-n", 4, "--chat",
                             "-v")
    assert code == 0
    # the time to the first token, then the decode speed after it (the speed over the whole
    # call, prefill included, read 2.5 times too slow for a 600-token prompt)
    assert re.search(r"\[\d+ prompt tokens, 4 generated in [\d.]+ s: first token after "
                     r"[\d.]+ s, then [\d.]+ tok/s, finish: length\]", err), err


def test_run_a_gguf_packs_into_pocket_home(files, home, capsys):
    code, stdout, _ = run_cli(capsys, "run", "-m", files["gguf"], "hello", "-n", 3)
    assert code == 0
    assert len(list((home / "packed").glob("*.pocket"))) == 1


def test_run_reads_the_prompt_from_stdin(files, capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("hello"))
    code, stdout, _ = run_cli(capsys, "run", "-m", files["pocket"], "-", "-n", 3)
    assert code == 0
    code2, stdout2, _ = run_cli(capsys, "run", "-m", files["pocket"], "hello", "-n", 3)
    assert stdout == stdout2


def test_run_joins_unquoted_prompt_words_and_names_its_help_on_unknown_flags(files, capsys):
    quoted = run_cli(capsys, "run", "-m", files["pocket"], "hello there", "-n", 4, "--raw")
    unquoted = run_cli(capsys, "run", "-m", files["pocket"], "hello", "there", "-n", 4, "--raw")
    assert quoted[0] == unquoted[0] == 0 and quoted[1] == unquoted[1]
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "-m", str(files["pocket"]), "hi", "--threads", "2"])
    assert exc.value.code == 1
    assert_one_line_error(1, capsys.readouterr().err,
                          "unrecognized arguments: --threads 2 (see `pocket run --help`)")


def test_module_entry_point(files, tmp_path):
    env = {**os.environ, "POCKET_HOME": str(tmp_path / "home"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pocketlm.cli", "run", "-m",
                           str(files["pocket"]), "hello", "-n", "4"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n") and len(proc.stdout) > 1
    proc = subprocess.run([sys.executable, "-m", "pocketlm.cli", "run", "-m",
                           str(tmp_path / "missing.pocket"), "hello"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    assert_one_line_error(proc.returncode, proc.stderr, "missing.pocket")


@pytest.mark.parametrize("verb", ["list", "run"])
def test_a_closed_standard_output_is_one_line_error(files, tmp_path, verb):
    # without a stdout, Python's print() wrote nothing and `pocket list >&-` exited 0, while
    # run's sys.stdout.write (and serve's logging set-up) were a traceback
    env = {**os.environ, "POCKET_HOME": str(tmp_path / "home"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    args = ["list"] if verb == "list" else ["run", "-m", str(files["pocket"]), "hi", "-n", "2"]
    proc = subprocess.run([sys.executable, "-m", "pocketlm.cli", *args], stdout=None,
                          stderr=subprocess.PIPE, text=True, env=env, timeout=120,
                          preexec_fn=lambda: os.close(1))
    assert_one_line_error(proc.returncode, proc.stderr, "standard output is closed")


# -- help and list ---------------------------------------------------------------------------
@pytest.mark.parametrize("verb", [None, "run", "chat", "pull", "list", "pack", "inspect"])
def test_help(verb, capsys):
    argv = ["--help"] if verb is None else [verb, "--help"]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pocket")
    if verb:
        assert f"pocket {verb}" in out


def test_no_verb_prints_help(capsys):
    assert cli.main([]) == 1
    assert "usage: pocket" in capsys.readouterr().out


def test_version(capsys):
    import pocketlm

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert pocketlm.__version__ in capsys.readouterr().out


def test_ctrl_c_while_the_commands_load_is_one_line(capsys, monkeypatch):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["run", "hi"]) == 130
    assert capsys.readouterr().err.strip() == "pocket: interrupted"


def test_importing_pocketlm_and_its_cli_loads_no_runtime():
    # so that Ctrl-C at once lands in main's handler, not in an import's traceback
    code = ("import sys, pocketlm, pocketlm.cli; "
            "print(sorted(m for m in ('numpy', 'pocketlm.api', 'pocketlm._native') "
            "if m in sys.modules)); print(pocketlm.load.__module__, "
            "pocketlm.PocketModel.__name__, 'load' in dir(pocketlm))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["[]", "pocketlm.api PocketModel True"]


def test_list_is_offline(capsys, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("list must not fetch anything")

    monkeypatch.setattr(subprocess, "run", no_network)
    monkeypatch.setattr(subprocess, "Popen", no_network)
    code, stdout, _ = run_cli(capsys, "list")
    assert code == 0
    for name in [*REGISTRY, *TRIMMED, *RECIPES]:
        assert name in stdout
    code, stdout, _ = run_cli(capsys, "list", "--json")
    rows = [json.loads(line) for line in stdout.splitlines()]
    assert {r["name"] for r in rows} == set(REGISTRY) | set(TRIMMED) | set(RECIPES)
    assert {r["recipe"] for r in rows if "recipe" in r} == set(RECIPES)
    assert {r["base"] for r in rows if "base" in r} <= set(REGISTRY)
    assert not any(r["pulled"] for r in rows)


def test_list_matches_the_readme_sample(capsys):
    """The README's `pocket list` is what it prints (nothing pulled here; the sample has the
    default model pulled)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    sample = readme.split("$ pocket list\n", 1)[1].split("\n\n", 1)[0].splitlines()
    code, stdout, _ = run_cli(capsys, "list")
    assert code == 0
    default = [i for i, line in enumerate(sample) if line.startswith("smollm2-135m ")]
    assert len(default) == 1
    sample[default[0]] = sample[default[0]].replace("  yes ", "  no  ", 1)
    assert stdout.splitlines() == sample


# -- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("verb", ["inspect", "run"])
def test_model_path_not_utf8(tmp_path, capsys, verb):
    """A path the OS hands over with undecodable bytes: missing, it is named as missing (it
    was called 'not valid Unicode'); present, the error says to rename it."""
    name = os.fsdecode(bytes(tmp_path) + b"/m\xfe.gguf")
    args = [name] if verb == "inspect" else ["-m", name, "hi"]
    code, _, err = run_cli(capsys, verb, *args)
    assert_one_line_error(code, err, "neither an existing file", "\\xfe")
    if verb == "run":  # inspect reads a present file by its path (and says it is no .pocket)
        Path(name).write_bytes(b"GGUF")
        code, _, err = run_cli(capsys, verb, *args)
        assert_one_line_error(code, err, "not UTF-8", "rename it")


def test_missing_model_file(tmp_path, capsys):
    missing = tmp_path / "nope.pocket"
    code, stdout, err = run_cli(capsys, "run", "-m", missing, "hello")
    assert_one_line_error(code, err, str(missing))
    code, stdout, err = run_cli(capsys, "inspect", missing)
    assert_one_line_error(code, err, str(missing))
    code, stdout, err = run_cli(capsys, "inspect", "")
    assert_one_line_error(code, err, "the file to inspect is empty")
    code, stdout, err = run_cli(capsys, "pack", tmp_path / "nope.gguf", "-o",
                                tmp_path / "x.pocket")
    assert_one_line_error(code, err, "nope.gguf")
    # an unset shell variable: not the working folder ("." exists), nor a folder as a text file
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")  # refused before it is read
    code, stdout, err = run_cli(capsys, "pack", src, "-o", "")
    assert_one_line_error(code, err, "-o/--output is empty")
    code, stdout, err = run_cli(capsys, "pack", src, "-o", tmp_path / "x.pocket",
                                "--bits-per-weight", "4.6", "--calib", tmp_path)
    assert_one_line_error(code, err, f"--calib {tmp_path}: is a folder, expected a text file")


@pytest.mark.parametrize("verb", ["run", "chat", "bench", "serve"])
def test_an_empty_model_is_refused_not_taken_for_the_default(verb, capsys):
    # `-m "$MODEL"` with MODEL unset: an error, not a quiet run of smollm2-135m
    code, _, err = run_cli(capsys, verb, "-m", "", *(["hello"] if verb == "run" else []))
    assert_one_line_error(code, err, "-m/--model is empty")
    if verb == "serve":
        code, _, err = run_cli(capsys, "serve", "--model-name", " ")
        assert_one_line_error(code, err, "--model-name is empty")


def test_unknown_registry_name(capsys):
    code, _, err = run_cli(capsys, "run", "-m", "smollm2-13m", "hello")
    line = assert_one_line_error(code, err, "smollm2-13m", "known models")
    assert "did you mean 'smollm2-135m'" in line
    code, _, err = run_cli(capsys, "pull", "no-such-model")
    assert_one_line_error(code, err, "no-such-model")


def test_corrupt_pocket_file(files, tmp_path, capsys):
    bad = tmp_path / "corrupt.pocket"
    data = bytearray(files["pocket"].read_bytes())
    data[-20] ^= 0xFF  # inside the last tensor
    bad.write_bytes(bytes(data))
    code, _, err = run_cli(capsys, "run", "-m", bad, "hello", "-n", 2)
    assert_one_line_error(code, err, "corrupt", "CRC-32")
    code, _, err = run_cli(capsys, "inspect", bad)
    assert_one_line_error(code, err, "corrupt")
    code, _, _ = run_cli(capsys, "inspect", bad, "--no-verify")
    assert code == 0


def test_truncated_pocket_file(files, tmp_path, capsys):
    bad = tmp_path / "short.pocket"
    bad.write_bytes(files["pocket"].read_bytes()[:5000])
    code, _, err = run_cli(capsys, "run", "-m", bad, "hello")
    assert_one_line_error(code, err, "truncated")


def test_foreign_file(tmp_path, capsys):
    foreign = tmp_path / "random.pocket"
    raw = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    foreign.write_bytes(b"\x00" + raw[1:8] + b"x" + raw[9:])  # no '{' where a header starts
    code, _, err = run_cli(capsys, "run", "-m", foreign, "hello")
    assert_one_line_error(code, err, "not a model file")
    code, _, err = run_cli(capsys, "inspect", foreign)
    assert_one_line_error(code, err, str(foreign))
    code, _, err = run_cli(capsys, "pack", foreign, "-o", tmp_path / "out.pocket")
    assert_one_line_error(code, err, str(foreign))
    empty = tmp_path / "empty.pocket"
    empty.write_bytes(b"")
    code, _, err = run_cli(capsys, "run", "-m", empty, "hello")
    assert_one_line_error(code, err)


@pytest.mark.parametrize("flags,word", [  # the flag named, not the Python parameter
    (["--temp", "nan"], "--temp must"),
    (["--temp", "-1"], "--temp must"),
    (["--temp", "inf"], "--temp must"),
    (["--top-p", "-0.5"], "--top-p must"),
    (["--top-p", "1.5"], "--top-p must"),
    (["--top-p", "nan"], "--top-p must"),
    (["--top-k", "-3"], "--top-k must"),
    (["--min-p", "2"], "--min-p must"),
    (["--repeat-penalty", "0"], "--repeat-penalty must"),
    (["--seed", "-1"], "--seed must"),
    (["-n", "-1"], "--max-tokens must"),
])
def test_bad_sampling_flags(files, capsys, flags, word):
    code, stdout, err = run_cli(capsys, "run", "-m", files["pocket"], "hello", *flags)
    assert_one_line_error(code, err, word)
    assert stdout == ""


def test_prompt_too_long_for_the_context(files, capsys):
    prompt = " ".join(["hello world"] * 10)
    code, _, err = run_cli(capsys, "run", "-m", files["pocket"], prompt, "--ctx", 8)
    assert_one_line_error(code, err, "context")
    code, _, err = run_cli(capsys, "run", "-m", files["pocket"], prompt, "--ctx", 8, "--chat")
    assert_one_line_error(code, err, "context")


def test_debug_reraises(tmp_path, capsys):
    with pytest.raises(ModelNotFoundError):
        cli.main(["--debug", "run", "-m", str(tmp_path / "nope.pocket"), "hello"])


def test_bad_ctx_flag(files, capsys):
    code, _, err = run_cli(capsys, "run", "-m", files["pocket"], "hello", "--ctx", -5)
    assert_one_line_error(code, err, "--ctx must be a positive number of tokens")


def test_ctx_beyond_the_model_is_said(files, capsys):
    """--ctx larger than the model's context is cut to it (as load does), and said so."""
    import pocketlm

    most = pocketlm.load(files["pocket"]).config.max_context
    code, _, err = run_cli(capsys, "run", "-m", files["pocket"], "hello", "-n", 2, "--ctx",
                           most + 1000)
    assert code == 0
    assert f"holds at most {most} tokens of context; --ctx {most + 1000} gives {most}" in err
    code, _, err = run_cli(capsys, "run", "-m", files["pocket"], "hello", "-n", 2, "--ctx", most)
    assert code == 0 and "holds at most" not in err


def test_bad_threads_variable_is_a_one_line_error(files, capsys, monkeypatch):
    """A malformed POCKET_THREADS is reported by the command that uses it, not raised while
    the argument parser is built (which broke every command)."""
    monkeypatch.setenv("POCKET_THREADS", "two")
    code, _, err = run_cli(capsys, "bench", "-m", files["pocket"], "--n-prompt", 8)
    assert_one_line_error(code, err, "POCKET_THREADS='two' is not an integer")
    code, _, err = run_cli(capsys, "run", "-m", files["pocket"], "hello", "-n", 2)
    if code:  # the native engine reads it; the numpy one has no threads
        assert_one_line_error(code, err, "POCKET_THREADS='two' is not an integer")
    code, stdout, _ = run_cli(capsys, "bench", "-m", files["pocket"], "--threads", "1",
                              "--n-prompt", 8, "--n-gen", 2, "--runs", 1, "--json")
    assert code == 0 and '"threads": 1' in stdout


@pytest.mark.parametrize("model", ["gguf", "registry"])
def test_unwritable_pocket_home_is_a_one_line_error(files, tmp_path, capsys, monkeypatch, model):
    """A GGUF packed on first use and a registry model pulled on first use both need
    POCKET_HOME: a home that cannot be created is named, with what to do."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("POCKET_HOME", str(blocker / "home"))
    name = files["gguf"] if model == "gguf" else "smollm2-135m"
    code, _, err = run_cli(capsys, "run", "-m", name, "hello", "-n", 2)
    assert_one_line_error(code, err, f"cannot create {blocker / 'home'}", "POCKET_HOME")


def _stdin(monkeypatch, text: str | bytes) -> None:
    """``text`` as the chat's piped stdin (a real text stream over bytes, as a pipe gives)."""
    import io

    raw = text if isinstance(text, bytes) else text.encode()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8"))


def test_chat_session(files, capsys, monkeypatch):
    _stdin(monkeypatch, "hi\n\n/help\n/reset\nhello there\n/quit\nnot read\n")
    code, stdout, err = run_cli(capsys, "chat", "-m", files["pocket"], "-n", 4,
                                "--system", "Be brief.")
    assert code == 0
    assert "pocket chat:" in err and "[conversation cleared]" in err and "/reset" in err
    assert stdout.count("\n") == 2 and ">>>" not in stdout  # two replies, no prompt: piped

    _stdin(monkeypatch, "")
    code, _, _ = run_cli(capsys, "chat", "-m", files["pocket"])
    assert code == 0


def test_chat_session_reports_errors_and_goes_on(files, capsys, monkeypatch):
    _stdin(monkeypatch, "hello world " * 10 + "\nhi\n/bye\n")
    code, stdout, err = run_cli(capsys, "chat", "-m", files["pocket"], "-n", 3, "--ctx", 24)
    assert code == 0
    assert "pocket: error:" in err and "context" in err
    assert "/reset" not in err.split("pocket: error:")[1]  # a first line too long: no history
    assert stdout.count("\n") == 1


def test_chat_says_reset_when_the_conversation_fills_the_context(files, capsys, monkeypatch):
    _stdin(monkeypatch, "hi\nhi\nhi\nhi\nhi\n/reset\nhi\n/bye\n")
    code, stdout, err = run_cli(capsys, "chat", "-m", files["pocket"], "-n", 6, "--ctx", 40)
    assert code == 0
    errors = [x for x in err.splitlines() if x.startswith("pocket: error:")]
    assert errors and all("/reset starts a new one" in x for x in errors)
    assert stdout.count("\n") == 5 - len(errors) + 1  # and a reply after /reset


def test_a_piped_line_that_is_not_utf8_is_refused_alone(files, capsys, monkeypatch):
    # a strict decoder (most UTF-8 locales) dropped its whole buffered chunk: the lines
    # before and after it were lost, with one error and exit 0
    _stdin(monkeypatch, b"Hello\nWhat is 2+2?\ncaf\xe9\nHi\n")
    code, stdout, err = run_cli(capsys, "chat", "-m", files["pocket"], "-n", 2)
    assert code == 0
    errors = [x for x in err.splitlines() if x.startswith("pocket: error:")]
    assert len(errors) == 1 and "not UTF-8" in errors[0]
    assert stdout.count("\n") == 3  # the three other lines answered


def test_a_piped_line_without_end_is_bounded(files, capsys, monkeypatch):
    # /dev/zero (or a binary file) was read as one line until memory ran out (the bound:
    # 64 characters a token of context, at least 64 Ki)
    _stdin(monkeypatch, "x" * 300_000 + "\nhi\n")
    code, stdout, err = run_cli(capsys, "chat", "-m", files["pocket"], "-n", 2, "--ctx", 64)
    assert code == 0
    errors = [x for x in err.splitlines() if x.startswith("pocket: error:")]
    assert len(errors) == 1 and "longer than 65,536 characters" in errors[0], err
    assert stdout.count("\n") == 1  # the next line answered


def test_a_line_at_the_bound_with_crlf_is_a_line_and_endless_input_ends(files, capsys,
                                                                        monkeypatch):
    _stdin(monkeypatch, "a" * 65_536 + "\r\n")  # a line of exactly the bound, CRLF-ended
    code, _, err = run_cli(capsys, "chat", "-m", files["pocket"], "-n", 2, "--ctx", 64)
    assert code == 0 and "longer than" not in err and "context" in err
    _stdin(monkeypatch, "x" * (64 * 65_536 + 10))  # /dev/zero: read on for ever, in bounds
    code, _, err = run_cli(capsys, "chat", "-m", files["pocket"], "-n", 2, "--ctx", 64)
    assert code == 1 and err.splitlines()[-1].startswith("pocket: error: stdin holds no "
                                                         "line end in")


def test_chat_commands_and_lines_that_begin_with_a_slash(files, capsys, monkeypatch):
    _stdin(monkeypatch, "/usr/bin/python: not found, why?\n//usr/bin/python: not found\n"
                        "/quit now\n")
    code, stdout, err = run_cli(capsys, "chat", "-m", files["pocket"], "-n", 2)
    assert code == 0
    assert "[not sent: /usr/bin/python: is no command]" in err
    assert "[not sent: /quit takes nothing after it]" in err
    assert "/exit" in err and "//" in err  # the whole list, and how to send such a line
    assert stdout.count("\n") == 1  # the // line was sent


def test_chat_refuses_a_model_without_a_chat_template_before_it_starts(files, capsys,
                                                                        monkeypatch):
    load = cli._load

    def without_template(args):  # a family with no template of its own, none in the file
        m = load(args)
        m.chat_template = None
        return m

    monkeypatch.setattr(cli, "_load", without_template)
    _stdin(monkeypatch, "Hi\nHello\n")  # it started, and failed each line (exit 0)
    code, _, err = run_cli(capsys, "chat", "-m", files["pocket"])
    assert_one_line_error(code, err, "no chat template", "pocket run")


def test_an_empty_system_message_is_sent(files, capsys, monkeypatch):
    import pocketlm.api

    seen = []
    chat = pocketlm.api.PocketModel.chat

    def spy(self, messages, *a, **kw):
        seen.append([dict(x) for x in messages])
        return chat(self, messages, *a, **kw)

    monkeypatch.setattr(pocketlm.api.PocketModel, "chat", spy)
    _stdin(monkeypatch, "hi\n")
    code, _, _ = run_cli(capsys, "chat", "-m", files["pocket"], "-n", 2, "--system", "")
    assert code == 0 and seen[0][0] == {"role": "system", "content": ""}


def test_chat_processes_hold_sigint_out_of_their_other_threads(files):
    """A terminal's Ctrl-C can reach any thread that does not block it: taken by the engine's
    workers or numpy's BLAS thread, Python only noted it, and a chat waiting for its next line
    sat there until Enter. Only the main thread may take it."""
    import os
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "pocketlm.cli", "chat", "-m",
                             str(files["pocket"])], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "POCKET_THREADS": "2"})
    try:
        assert "pocket chat:" in proc.stderr.readline()  # loaded: every thread is running
        tasks = sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task"))
        assert len(tasks) >= 3, tasks  # main, the engine's worker, numpy's BLAS thread

        def sigint_blocked(tid):
            with open(f"/proc/{proc.pid}/task/{tid}/status") as f:
                mask = next(x for x in f if x.startswith("SigBlk:")).split()[1]
            return bool(int(mask, 16) & (1 << (2 - 1)))  # SIGINT is signal 2

        assert not sigint_blocked(proc.pid)
        assert all(sigint_blocked(t) for t in tasks if t != proc.pid)
    finally:
        proc.stdin.close()
        proc.wait(30)


# -- outputs that would destroy what they should not ---------------------------------------
def test_force_never_replaces_the_input_nor_an_unrelated_folder(files, tmp_path, capsys,
                                                                 monkeypatch):
    import shutil

    src = tmp_path / "same.gguf"
    shutil.copy(files["gguf"], src)
    before = src.read_bytes()
    code, _, err = run_cli(capsys, "pack", src, "-o", src, "--force")
    assert_one_line_error(code, err, "is the input")
    assert src.read_bytes() == before
    dep = tmp_path / "same.pocket"
    shutil.copy(files["pocket"], dep)
    code, _, err = run_cli(capsys, "export", dep, "--to", "gguf", "-o", dep, "--force")
    assert_one_line_error(code, err, "is the input")
    assert dep.read_bytes() == files["pocket"].read_bytes()
    # the other files a pack reads: a Hugging Face folder's own files, the --calib text
    import tiny_hf

    hf = tmp_path / "hf"
    tiny_hf.write_tiny_hf(hf, "llama", seed=2)
    weights = (hf / "model.safetensors").read_bytes()
    for name in ("model.safetensors", "config.json"):
        code, _, err = run_cli(capsys, "pack", hf, "-o", hf / name, "--force")
        assert_one_line_error(code, err, "is one of the files of the input")
    assert (hf / "model.safetensors").read_bytes() == weights
    calib = tmp_path / "calib.txt"
    calib.write_text("The parcel left the depot this morning. " * 80)
    code, _, err = run_cli(capsys, "pack", src, "-o", calib, "--calib", calib, "--force")
    assert_one_line_error(code, err, "is the input")
    assert calib.read_text().startswith("The parcel")
    # an earlier deploy file in the folder is what --force may replace
    for _ in range(2):
        code, _, err = run_cli(capsys, "pack", hf, "-o", hf / "m.pocket", "--force")
        assert code == 0, err

    # --to hf --force replaces a whole folder: an earlier export, not a folder of other things
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "export", files["pocket"], "--to", "hf", "-o", victim,
                           "--force")
    assert_one_line_error(code, err, "holding other things")
    assert (victim / "keep.txt").read_text() == "mine" and (victim / "sub").is_dir()
    hf = tmp_path / "hf"
    for _ in range(2):  # a second export replaces the first
        assert run_cli(capsys, "export", files["pocket"], "--to", "hf", "-o", hf,
                       "--force")[0] == 0
    assert (hf / "config.json").is_file()
    monkeypatch.chdir(victim)
    for here in (".", ".."):
        code, _, err = run_cli(capsys, "export", files["pocket"], "--to", "hf", "-o", here,
                               "--force")
        assert_one_line_error(code, err, "working folder")
    assert (victim / "keep.txt").read_text() == "mine"


def test_a_model_name_too_long_for_a_file_name_is_not_found():
    import pocketlm
    from pocketlm.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError):
        pocketlm.load("a" * 300)


@pytest.mark.parametrize("flags, words", [
    (["-n", "-1"], "--max-tokens must be a non-negative integer"),
    (["--temp", "nan"], "--temp must be a finite number"),
    (["--temperature", "-1"], "--temp must be >= 0 (0 = greedy)"),
    (["--seed", "-3"], "--seed must be a non-negative integer"),
    (["--top-p", "1.5"], "--top-p must be in [0, 1]"),
    (["--top-k", "-1"], "--top-k must be a non-negative integer"),
    (["--min-p", "2"], "--min-p must be in [0, 1]"),
    (["--repeat-penalty", "0"], "--repeat-penalty must be > 0"),
])
def test_bad_sampling_flags_are_refused_before_a_model_is_loaded(capsys, monkeypatch, flags,
                                                                 words):
    """A model that does not exist shows that nothing was loaded (or pulled, or packed) first;
    chat says it once and exits 1, instead of once per line and exit 0."""
    import io

    code, _, err = run_cli(capsys, "run", "-m", "no-such-model", *flags, "hi")
    assert_one_line_error(code, err, words)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nthere\n"))
    code, _, err = run_cli(capsys, "chat", "-m", "no-such-model", *flags)
    assert_one_line_error(code, err, words)


@pytest.mark.parametrize("command, flag", [(["run"], "--ctx"), (["chat"], "--ctx"),
                                           (["serve"], "--ctx"), (["eval", "--ppl", "x.txt"],
                                                                   "--n-ctx")])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_context_flag_below_one_token_is_named_before_a_model_is_loaded(capsys, command,
                                                                         flag, value):
    # the flag, not load()'s n_ctx, and before the model is pulled, packed or loaded
    code, _, err = run_cli(capsys, command[0], "-m", "no-such-model", *command[1:], flag, value,
                           *(["hi"] if command == ["run"] else []))
    assert_one_line_error(code, err, f"{flag} must be a positive number of tokens, got {value}")


def test_train_and_finetune_refuse_an_out_that_is_a_file_before_any_work(files, tmp_path,
                                                                         capsys):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n\n" * 50)
    code, _, err = run_cli(capsys, "train", "--data", text, "--out", taken, "--steps", 1)
    assert_one_line_error(code, err, "a file of that name exists")
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "a"}, '
                     '{"role": "assistant", "content": "b"}]}\n')
    code, _, err = run_cli(capsys, "finetune", "-m", files["gguf"], "--data", chats, "--out",
                           taken, "--steps", 1)
    assert_one_line_error(code, err, "a file of that name exists")
    assert taken.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == \
        ["chats.jsonl", "corpus.txt", "taken"]


def test_finetune_refuses_a_calib_file_too_short_before_the_training(files, tmp_path, capsys):
    # it was refused only by the export, after the training had written its checkpoint
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "a"}, '
                     '{"role": "assistant", "content": "b"}]}\n')
    short = tmp_path / "short.txt"
    short.write_text("three words here")
    code, _, err = run_cli(capsys, "finetune", "-m", files["gguf"], "--data", chats, "--out",
                           tmp_path / "run", "--steps", 1, "--export", tmp_path / "ft.pocket",
                           "--calib", short)
    assert_one_line_error(code, err, "short.txt: ")
    assert "shorter than one calibration sequence of 128" in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "ft.pocket").exists()


def test_data_prepare_writes_its_chats_only_once_the_arguments_are_good(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n\n" * 50)
    chats = tmp_path / "chats.jsonl"
    code, _, err = run_cli(capsys, "data", "prepare", "--text", text, "--out", tmp_path / "s",
                           "--vocab-size", 300, "--holdout", 2, "--chats-out", chats)
    assert_one_line_error(code, err, "--holdout")
    assert not chats.exists() and not (tmp_path / "s").exists()
