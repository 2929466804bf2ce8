"""The ``ragspec`` console script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli.main import SUBCOMMANDS, build_parser, main
from decoding.runtime.bundled import MARKER_NAME
from tests.conftest import DATA_DIR


def ragspec_command() -> list[str]:
    script = Path(sys.executable).parent / "ragspec"
    return [str(script)] if script.exists() else [sys.executable, "-m", "app.cli.main"]


def run_cli(*args: str, data_dir: Path = DATA_DIR) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAGSPEC_DATA_DIR": str(data_dir), "RAGSPEC_LOG_LEVEL": "WARNING"}
    return subprocess.run([*ragspec_command(), *args], capture_output=True, text=True, env=env, timeout=600,
                          check=False)


def test_parser_knows_the_subcommands() -> None:
    assert {"models", "serve", "ingest", "ask", "reindex"} <= set(SUBCOMMANDS)
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--port", "9001"])
    assert (args.host, args.port) == ("0.0.0.0", 9001)
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2


def test_help_lists_subcommands() -> None:
    done = run_cli("--help")
    assert done.returncode == 0
    assert all(name in done.stdout for name in SUBCOMMANDS)


def test_models_is_idempotent(bundled_gguf_dir: Path) -> None:
    """Run twice on the shared data dir: both succeed, the second writes nothing and touches nothing."""
    first = run_cli("models")
    assert first.returncode == 0, first.stderr
    marker = bundled_gguf_dir / MARKER_NAME
    stamp = marker.stat().st_mtime_ns
    second = run_cli("models")
    assert second.returncode == 0, second.stderr
    assert "served from the GGUF as stored" in second.stdout
    assert str(bundled_gguf_dir.resolve()) in second.stdout
    assert "all-MiniLM-L6-v2" in second.stdout
    assert marker.stat().st_mtime_ns == stamp
