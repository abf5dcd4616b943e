"""The exit-code contract every subcommand follows (backend/errors.py, app/cli/main.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import run_cli
from shardscope.app.cli import main
from shardscope.backend.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_OK


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    proc = run_cli("inspect", tmp_path / "missing")
    assert proc.returncode == EXIT_BAD_INPUT
    assert proc.stderr.count("\n") == 1 and "missing" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_internal_error_is_exit_3_with_the_traceback_in_the_log(fixtures, monkeypatch, capsys, tmp_path):
    """A bug (here injected into our own verify step) must not look like 'problems found' (exit 1)."""
    import shardscope.backend.checkpoint.verify as verify_module

    def broken(*args, **kwargs):
        raise ZeroDivisionError("injected bug")

    monkeypatch.setattr(verify_module, "verify", broken)
    log = tmp_path / "log" / "shardscope.log"
    monkeypatch.setenv("SHARDSCOPE_LOG", str(log))
    import logging

    root = logging.getLogger("shardscope")
    saved = root.handlers[:], getattr(root, "_shardscope_configured", False)
    root.handlers.clear()
    root._shardscope_configured = False
    try:
        code = main(["inspect", str(fixtures["fsdp2_r2"])])
    finally:
        for h in root.handlers:
            h.close()
        root.handlers[:] = saved[0]
        root._shardscope_configured = saved[1]
    err = capsys.readouterr().err
    assert code == EXIT_INTERNAL
    assert err.count("\n") == 1 and "internal error" in err and str(log) in err
    text = log.read_text()
    assert "Traceback" in text and "injected bug" in text


@pytest.mark.parametrize("argv", [["--help"], ["-v", "--help"]])
def test_help_exits_ok(argv):
    proc = subprocess.run([sys.executable, "-m", "shardscope.app.cli", *argv], capture_output=True, text=True,
                          env={**os.environ}, timeout=120)
    assert proc.returncode == EXIT_OK
    for name in ("inspect", "verify", "show", "export", "diff", "import", "reshard", "train", "demo", "gui"):
        assert f"    {name}" in proc.stdout


def test_names_are_escaped_on_terminals():
    from shardscope.backend.text import escape_name

    assert escape_name("layer\nweight\u202e") == "layer\\x0aweight\\u202e"
    assert "\n" not in escape_name("a\r\nb") and escape_name("model.w") == "model.w"


def test_a_missing_command_module_fails_loudly(monkeypatch):
    """build_parser once skipped a subcommand whose module did not import: the command vanished without a word."""
    import importlib

    cli_main = importlib.import_module("shardscope.app.cli.main")
    _parser, names = cli_main.build_parser()
    assert names.keys() >= {"inspect", "verify", "show", "export", "diff", "import", "reshard", "ls", "prune",
                            "train", "gui"}
    # a command line naming a command imports only its module: the map says which, for every command
    assert cli_main.COMMAND_MODULE_OF.keys() == names.keys()
    for module in cli_main.COMMAND_MODULES:
        _parser, only = cli_main.build_parser((module,))
        assert only.keys() == {c for c, m in cli_main.COMMAND_MODULE_OF.items() if m == module}, module
    monkeypatch.setattr(cli_main, "COMMAND_MODULES", (*cli_main.COMMAND_MODULES, "no_such_command"))
    with pytest.raises(ModuleNotFoundError, match="no_such_command"):
        cli_main.build_parser()
