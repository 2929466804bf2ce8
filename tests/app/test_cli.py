"""The ``ragspec`` console script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app.cli.main import SUBCOMMANDS, build_parser, command_settings, main
from app.settings import Settings
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


def test_the_global_flags_are_given_to_the_settings_not_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--data-dir and --log-level go over the environment's values, into the settings every handler gets: the
    directories derived from the data dir follow the flag, one set by its own variable stays, and the process's
    environment is left as it was."""
    for name in [n for n in os.environ if n.startswith("RAGSPEC_")]:
        monkeypatch.delenv(name)
    seen: list[Settings] = []

    def probe(args: object, settings: Settings) -> int:
        seen.append(settings)
        return 0

    def add_probe(sub: Any) -> None:
        sub.add_parser("probe").set_defaults(handler=probe)

    monkeypatch.setitem(SUBCOMMANDS, "probe", add_probe)
    assert main(["--data-dir", str(tmp_path / "flag"), "--log-level", "warning", "probe"]) == 0
    (settings,) = seen
    flag = tmp_path / "flag"
    assert (settings.data_dir, settings.log_level) == (flag, "warning")
    assert (settings.documents_dir, settings.models_dir) == (flag / "documents", flag / "models")
    assert not [n for n in os.environ if n.startswith("RAGSPEC_")]

    monkeypatch.setenv("RAGSPEC_DATA_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("RAGSPEC_DOCUMENTS_DIR", str(tmp_path / "shared"))
    monkeypatch.setenv("RAGSPEC_LOG_LEVEL", "ERROR")
    flagged = command_settings(build_parser().parse_args(["--data-dir", str(flag), "probe"]))
    assert (flagged.data_dir, flagged.documents_dir) == (flag, tmp_path / "shared")
    assert (flagged.models_dir, flagged.log_level) == (flag / "models", "ERROR")
    for argv in (["probe"], ["--data-dir", "", "--log-level", "", "probe"]):  # an empty flag: as an empty variable
        plain = command_settings(build_parser().parse_args(argv))
        assert (plain.data_dir, plain.models_dir, plain.log_level) == (tmp_path / "env", tmp_path / "env" / "models",
                                                                       "ERROR")
    assert os.environ["RAGSPEC_DATA_DIR"] == str(tmp_path / "env")


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
