"""The docs stay true: every subcommand has its section in docs/commands.md naming every option it takes, the
README's command map links only to sections that exist, and every page the README links to is there."""

from __future__ import annotations

import re
from pathlib import Path

from shardscope.app.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = (ROOT / "docs" / "commands.md").read_text()


def _sections() -> dict[str, str]:
    parts = re.split(r"^## shardscope ", REFERENCE, flags=re.M)[1:]
    return {p.split("\n", 1)[0].strip(): p for p in parts}


def test_every_subcommand_and_option_is_in_the_reference():
    _, subparsers = build_parser()
    sections = _sections()
    missing = []
    for name, parser in subparsers.items():
        if name not in sections:
            missing.append(name)
            continue
        text = sections[name]
        if "[train options]" in text:  # demo takes train's options, documented there
            text += sections["train"]
        for action in parser._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help" and option not in text:
                    missing.append(f"{name} {option}")
    assert not missing, missing


def test_the_readme_links_only_to_what_exists():
    readme = (ROOT / "README.md").read_text()
    anchors = {"shardscope-" + name for name in _sections()}
    for target in re.findall(r"\]\(([^)#\s]+)(?:#([\w-]+))?\)", readme):
        path, anchor = target
        if path.startswith("http"):
            continue
        assert (ROOT / path).exists(), path
        if anchor and path == "docs/commands.md":
            assert anchor in anchors, anchor
