"""The writer registry (backend/export/registry.py): the CLI's --format choices come from it, ``export()``
refuses a format it does not hold, and every rule of a requested export speaks of options in words, never of a
command-line flag (the Export dialog shows the messages as they are)."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shardscope.backend.export import WRITERS, ExportError, check_request, export, export_formats, plan_export
from shardscope.backend.export.destination import check_destination
from shardscope.backend.export.registry import OPTION_WORDS, parse_shard_size
from shardscope.backend.formats import open_checkpoint

EXPORT_DIR = Path(__file__).resolve().parent.parent / "backend" / "export"


def test_cli_format_choices_are_the_registry_names():
    from shardscope.app.cli.main import build_parser

    parser, _ = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    fmt = next(a for a in sub.choices["export"]._actions if a.dest == "format")
    assert list(fmt.choices) == list(export_formats()) == [n for n, w in WRITERS.items() if w.write is not None]
    assert "onnx" not in fmt.choices
    assert all(n in fmt.choices for n in export_formats())
    assert ", ".join(export_formats()) in sub.choices["export"].format_help()


def test_building_the_cli_parser_does_not_import_the_writers():
    """Every command builds the export parser; its --format choices are read from the registry only when asked."""
    code = ("import sys; from shardscope.app.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m.startswith(('numpy', 'shardscope.backend.export'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_every_writer_is_registered_once_with_words_for_its_options():
    assert all(name == w.name for name, w in WRITERS.items())
    assert len({w.label for w in WRITERS.values()}) == len(WRITERS)
    suffixes = [s for w in WRITERS.values() for s in w.suffixes]
    assert len(suffixes) == len(set(suffixes))  # a destination's name calls for one writer at most
    for w in WRITERS.values():
        assert w.output in ("file", "dir") and w.options <= set(OPTION_WORDS)
        assert w.suffixes or w.output == "dir", w.name  # a file format can be told from the name
        assert w.output_kind(10**9) == "dir"


@pytest.mark.parametrize(("dst", "fmt", "shard", "want"), [
    ("m.safetensors", None, None, "safetensors"), ("m.pt", None, None, "torch"), ("m.PTH", None, None, "torch"),
    ("m.bin", None, None, "torch"), ("m.ckpt", None, None, "torch"), ("folder", None, 10**9, "safetensors"),
    ("m.pt", None, 10**9, "safetensors"),  # a maximum shard size makes a sharded folder, whatever its name
    ("anything", "torch", None, "torch"), ("m.pt", "safetensors", None, "safetensors")])
def test_the_format_is_given_or_told_from_the_name(dst, fmt, shard, want):
    assert check_request(dst, fmt, max_shard_size=shard).name == want


def _message(call) -> str:
    with pytest.raises(ExportError) as info:
        call()
    return str(info.value)


REQUEST_RULES = {  # each rule of check_request, with words the message must hold
    "unknown format": (lambda: check_request("m.pt", "onnx"), "unknown format 'onnx'; use one of safetensors, torch"),
    "dcp is no export": (lambda: check_request("out", "dcp"), "written by import and reshard, not by export"),
    "no format from the name": (lambda: check_request("noext"), "choose a format, or give a maximum shard size"),
    "shard size for torch": (lambda: check_request("m.pt", "torch", max_shard_size=10**9),
                             "a maximum shard size applies only to safetensors and Hugging Face model output"),
    "config for torch": (lambda: check_request("m.pt", config="c.json"), "a config.json to copy applies only to"),
    "source path for torch": (lambda: check_request("m.pt", record_source=True),
                              "recording the source path applies only to safetensors and Hugging Face model output"),
    "config unsharded": (lambda: check_request("m.safetensors", config="c.json"), "give a maximum shard size too"),
    "dtype": (lambda: check_request("m.pt", dtype="int4"), "floating-point dtype int4: use bf16, fp16 or fp32"),
    "rename without =": (lambda: check_request("m.pt", rename=["abc"]), "rename rule 'abc': write it as"),
    "rename bad regex": (lambda: check_request("m.pt", rename=["(=x"]), "rename rule '(=x': bad regular expression"),
    "shard size": (lambda: parse_shard_size("lots"), "maximum shard size: not a size: 'lots'"),
}


@pytest.mark.parametrize("rule", sorted(REQUEST_RULES))
def test_request_rules_name_no_command_line_flag(rule):
    call, words = REQUEST_RULES[rule]
    message = _message(call)
    assert words in message and "--" not in message, message


def test_plan_rules_name_no_command_line_flag(fixtures):
    ckpt = open_checkpoint(fixtures["fsdp2_r2"])
    cases = {
        "only": ({"only": ["nosuch"]}, "nosuch (a prefix to export) matches no entry"),
        "exclude": ({"exclude": ["nosuch"]}, "nosuch (a prefix to leave out) matches no entry"),
        "collision": ({"rename": [r"^model\..*=same"]}, "both become 'same' (the prefix stripped, the rename rules"),
        "rename matches nothing": ({"rename": ["^nosuch=x"]}, "rename rule ^nosuch: matches no exported key"),
        "checked here too": ({"max_shard_size": 10**9},
                             "a maximum shard size applies only to safetensors and Hugging Face model output"),
    }
    for name, (options, words) in cases.items():
        message = _message(lambda options=options: plan_export(ckpt, "torch", **options))
        assert words in message and "--" not in message, (name, message)
    plan = plan_export(ckpt, "safetensors", exclude=["model.head", "optimizer"])
    assert not [n for n in plan.left_out + plan.notes if "--" in n]


def test_destination_rules_name_no_command_line_flag(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    (tmp_path / "folder").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "folder")
    os.mkfifo(tmp_path / "fifo")
    cases = [(tmp_path / "file", "file", "exists; choose a name that does not exist yet, or allow overwriting it"),
             (tmp_path / "folder", "file", "or give a maximum shard size for a sharded folder"),
             (tmp_path / "link", "dir", "is a symbolic link"), (tmp_path / "file", "dir", "is a file, not a folder"),
             (tmp_path / "fifo", "file", "not a regular file")]
    for dst, kind, words in cases:
        message = _message(lambda dst=dst, kind=kind: check_destination(str(dst), kind))
        assert words in message and "--" not in message, message
    message = _message(lambda: check_destination(str(tmp_path / "folder" / "x"), "dir", True, [str(tmp_path)]))
    assert "lies inside the source" in message and "--" not in message


def test_dcp_rule_names_no_command_line_flag(tmp_path):
    from shardscope.backend.export.dcp_writer import write_dcp

    message = _message(lambda: write_dcp([], [], str(tmp_path / "out"), 0))
    assert message == "the number of ranks must be at least 1." and not (tmp_path / "out").exists()


def _raised_strings(path: Path) -> list[str]:
    """The text of every string in a ``raise`` statement of ``path`` (f-strings' literal parts too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Raise) and node.exc is not None:
            out += [c.value for c in ast.walk(node.exc) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return out


def test_no_export_error_names_a_command_line_flag():
    """A rule the tests above do not reach (a disk full, a remote destination) may not name a flag either."""
    flagged = {p.name: s for p in sorted(EXPORT_DIR.glob("*.py")) for s in _raised_strings(p) if "--" in s}
    assert flagged == {}


def test_export_refuses_a_format_no_writer_is_registered_under(fixtures, tmp_path):
    plan = plan_export(open_checkpoint(fixtures["fsdp2_r2"]), "safetensors")
    for name, words in (("onnx", "unknown format 'onnx'; use one of safetensors, torch, hf."),
                        ("dcp", "DCP (reshard) output is written by import and reshard, not by export")):
        message = _message(lambda name=name: export(dataclasses.replace(plan, format=name), str(tmp_path / "x")))
        assert words in message, message
    assert list(tmp_path.iterdir()) == []
