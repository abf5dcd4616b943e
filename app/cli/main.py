"""Parser assembly and the exit-code contract every subcommand goes through.

Codes (see :mod:`shardscope.backend.errors`): 0 ok, 1 problems found, 2 bad input (one line naming the
file), 3 internal error (one line pointing to the log file with the traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import sys
from collections.abc import Iterable

from shardscope.backend.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, ShardscopeError

from .output import err

log = logging.getLogger("shardscope.cli")

# One module per subcommand (or per pair of closely related ones); each has ``register(sub)``.
GLOBAL_FLAGS = ("-v", "--verbose", "--no-cache")  # options given before the subcommand
COMMAND_MODULES = ("inspect", "verify", "show", "gui", "export", "diff", "convert", "train", "runs", "follow",
                   "stop", "demo", "library", "watch", "drift", "bisect", "average", "seal")
# the module that registers each subcommand: a command line that names one imports only that module (every
# module costs `ls` its imports); tests/test_cli_contract.py holds this equal to what the modules register
COMMAND_MODULE_OF = {**{m: m for m in COMMAND_MODULES if m not in ("convert", "library")},
                     "import": "convert", "reshard": "convert", "ls": "library", "prune": "library"}


def build_parser(modules: Iterable[str] | None = None
                 ) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The full parser (``modules``: with only those modules' subcommands) and its subcommands' parsers by
    name."""
    parser = argparse.ArgumentParser(
        prog="shardscope",
        description="Browse, train and export PyTorch distributed (DCP) checkpoints. "
                    "Without a subcommand, opens the GUI (on PATH if given).",
        epilog="Exit codes: 0 ok, 1 problems found, 2 bad input, 3 internal error (see the log), 130 interrupted.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")
    parser.add_argument("--no-cache", dest="no_cache_global", action="store_true",
                        help="neither read nor write the metadata cache (nor ls's probe cache), for every command "
                             "and the window (same as SHARDSCOPE_NO_CACHE=1; the cache lives in "
                             "$SHARDSCOPE_CACHE_DIR, default "
                             "~/.cache/shardscope/metadata)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES if modules is None else modules:
        # NOTE: a missing or broken command module fails here, loudly: skipping it once hid a subcommand
        # from every user of a wheel that lacked the module
        importlib.import_module(f"{__package__}.{name}").register(sub)
    return parser, dict(sub.choices)


def unknown_command(word: str, names: Iterable[str]) -> str | None:
    """The error line for a first word that is neither a subcommand nor a path (``shardscope exprot``), else
    None: a word naming something that exists, or that looks like a path or URL, opens the window on it."""
    if os.path.exists(word) or "/" in word or os.sep in word or "://" in word or "." in word:
        return None
    scored = sorted(((difflib.SequenceMatcher(None, word, n).ratio(), n) for n in names), reverse=True)
    close = [n for r, n in scored if r >= 0.6 and r >= scored[0][0] - 0.1]  # the best, and any nearly as close
    if close:
        return f"unknown command '{word}'; did you mean {' or '.join(repr(c) for c in close)}?"
    return f"unknown command '{word}', and no file or folder of that name (commands: {', '.join(sorted(names))})"


def main(argv: list[str] | None = None) -> int:
    """Run one ``shardscope`` command line and return its exit code."""
    from shardscope.backend.log import setup_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if a not in GLOBAL_FLAGS), None)
    parser, commands = build_parser((COMMAND_MODULE_OF[first],) if first in COMMAND_MODULE_OF else None)
    if first is None or (first not in commands and not first.startswith("-")):
        if first is not None and (unknown := unknown_command(first, commands)):
            err(unknown)
            return EXIT_BAD_INPUT
        argv.insert(argv.index(first) if first is not None else len(argv), "gui")  # `shardscope [PATH]`
    args, extra = parser.parse_known_args(argv)
    if extra:  # NOTE: the subcommand's usage, not the top level's, for a mistyped flag of a subcommand
        command_parser = commands.get(args.command, parser)
        command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logfile = setup_logging(args.verbose)
    if args.no_cache_global:
        os.environ["SHARDSCOPE_NO_CACHE"] = "1"  # read by the cache (also in the window's reader processes)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    log.info("shardscope %s", " ".join(argv))
    try:
        return args.func(args)
    except ShardscopeError as exc:
        log.info("%s: %s", type(exc).__name__, exc)
        err(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        err("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        os._exit(0)  # NOTE: stdout closed by `| head`; flushing at exit would raise again
    except Exception as exc:
        log.exception("internal error in `shardscope %s`", " ".join(argv))
        where = f"the traceback is in {logfile}" if logfile else "run with --verbose for the traceback"
        err(f"internal error: {type(exc).__name__}: {exc} ({where}; please report it)")
        return EXIT_INTERNAL
