"""A start-up failure of ``ragspec serve`` is one line on stderr naming the cause and what to do, exit status 2, no
traceback: the real command in a subprocess, as a new user runs it (default log level), for a target model of an
architecture the runtime does not run, a missing model file, a truncated GGUF, one too big for the RAM, a port in
use, a data dir that cannot be made and bad setting values. Each fails before the store or the embedder loads (the
GGUF ones once torch and transformers are imported, the others before that)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest

from decoding.runtime.families import GGUF_ARCHITECTURES
from tests.app.test_cli import ragspec_command
from tests.conftest import free_port

# what the machine's environment may say that would change these runs (a level that hides or adds lines, a
# database or Redis the runs would reach first); kernel build settings are left as they are
UNSET = ("RAGSPEC_LOG_LEVEL", "RAGSPEC_DATABASE_URL", "RAGSPEC_REDIS_URL", "RAGSPEC_HOST", "RAGSPEC_PORT",
         "RAGSPEC_TARGET_MODEL", "RAGSPEC_DRAFTER_MODEL", "RAGSPEC_EMBEDDING_MODEL", "RAGSPEC_MODELS_DIR",
         "RAGSPEC_DOCUMENTS_DIR")


def serve(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``ragspec serve`` on a free port (unless ``args`` name one) with a fresh data dir and ``env`` (RAGSPEC_*)."""
    base = {k: v for k, v in os.environ.items() if k not in UNSET}
    values = {"RAGSPEC_DATA_DIR": str(tmp_path / "data"), "RAGSPEC_THREADS": "1", "RAGSPEC_CALIBRATE": "false",
              **env}
    port = () if "--port" in args else ("--port", str(free_port()))
    return subprocess.run([*ragspec_command(), "serve", *port, *args], capture_output=True, text=True,
                          env={**base, **values}, timeout=300, check=False)


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The failure's line, after checking it is the only output, with exit status 2 and no traceback."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "Application startup failed" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ragspec: "), done.stderr
    assert done.stdout == ""
    return lines[0]


def write_gguf(path: Path, arch: str) -> Path:
    """A tiny GGUF of ``arch`` with the metadata a Llama config needs and two tensors (no tokenizer in it)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- the target model ----------------------------------------------------------------------------------------


def test_a_gguf_too_big_for_the_ram(tmp_path: Path) -> None:
    """Refused before a byte of it is read, saying how much RAM it needs and how much there is (a sparse file: no
    disk)."""
    model = tmp_path / "huge.Q4_K_M.gguf"
    with model.open("wb") as f:
        f.truncate(1 << 40)
    line = one_line(serve(tmp_path, RAGSPEC_TARGET_MODEL=str(model)))
    assert line.startswith(f"ragspec: cannot load the target model {model}: huge.Q4_K_M.gguf needs about "), line
    assert "(its 1024.0 GiB of weights as served, and room to run)" in line
    assert "GiB is available: use a smaller quantization of it" in line


def test_a_gguf_of_another_architecture(tmp_path: Path) -> None:
    model = write_gguf(tmp_path / "falcon.gguf", "falcon")
    line = one_line(serve(tmp_path, RAGSPEC_TARGET_MODEL=str(model)))
    assert line.startswith(f"ragspec: cannot load the target model {model}: GGUF architecture 'falcon' is not "
                           "supported"), line
    assert f"(supported: {', '.join(GGUF_ARCHITECTURES)})" in line
    assert "set RAGSPEC_TARGET_MODEL to a GGUF file (llama, qwen2" in line


def test_a_missing_model_file(tmp_path: Path) -> None:
    model = tmp_path / "models" / "nowhere.gguf"
    line = one_line(serve(tmp_path, RAGSPEC_TARGET_MODEL=str(model)))
    assert f"cannot load the target model: {model} does not exist; set RAGSPEC_TARGET_MODEL" in line, line
    assert "Repo id" not in line  # not taken for a Hugging Face hub id


def test_a_truncated_gguf(tmp_path: Path) -> None:
    """A download cut short: the reader's numpy error becomes the reason, the file is named and called corrupt."""
    whole = write_gguf(tmp_path / "whole.gguf", "llama").read_bytes()
    model = tmp_path / "cut.gguf"
    model.write_bytes(whole[: len(whole) - 100])  # into the last tensor's data
    line = one_line(serve(tmp_path, RAGSPEC_TARGET_MODEL=str(model)))
    assert f"cannot read the GGUF file {model}: it is corrupt, truncated or not a GGUF file" in line, line
    assert "set RAGSPEC_TARGET_MODEL" in line
    assert not (tmp_path / "data" / "documents").exists()  # failed before the store was opened


# ---- the port, the data dir, the settings --------------------------------------------------------------------


def test_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_line(serve(tmp_path, "--port", str(port)))
    assert line == (f"ragspec: cannot listen on 127.0.0.1:{port}: address already in use; stop what listens there, "
                    "or choose another port with --port or RAGSPEC_PORT")


def test_a_data_dir_that_cannot_be_made(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    data = tmp_path / "file" / "data"
    line = one_line(serve(tmp_path, RAGSPEC_DATA_DIR=str(data)))
    assert line.startswith(f"ragspec: cannot create the data dir {data}: not a directory; set RAGSPEC_DATA_DIR"), line


@pytest.mark.parametrize(("value", "says"), [("-3", "greater than or equal to 1"), ("many", "a valid integer")])
def test_a_bad_setting_value(tmp_path: Path, value: str, says: str) -> None:
    line = one_line(serve(tmp_path, RAGSPEC_THREADS=value))
    assert line.startswith("ragspec: bad setting: RAGSPEC_THREADS: ") and says in line, line


def test_the_traceback_is_there_at_debug(tmp_path: Path) -> None:
    """At RAGSPEC_LOG_LEVEL=DEBUG the cause's traceback is logged before the same last line."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = serve(tmp_path, "--port", str(port), RAGSPEC_LOG_LEVEL="DEBUG")
    assert done.returncode == 2
    assert "Traceback" in done.stderr and "OSError: [Errno" in done.stderr, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith(f"ragspec: cannot listen on 127.0.0.1:{port}: address already in use"), done.stderr
