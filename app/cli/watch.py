"""``shardscope watch``: export each checkpoint of the runs under some roots once it is complete (verified, atomic),
then thin the runs by prune's rules; one pass (``--once``, for cron or a SLURM epilogue) or a loop until SIGINT or
SIGTERM."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

from shardscope.backend.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_PROBLEMS, ShardscopeError
from shardscope.backend.filenames import is_url
from shardscope.backend.text import escape_name

from .export import ExportFormats
from .library import add_keep_rules, rules_of
from .output import add_command, err
from .storage_options import add_storage_options, apply_to_fsspec


def register(sub: Any) -> None:
    sp = add_command(sub, "watch", run, "Follow the runs under ROOTs: export each resumable checkpoint that becomes "
                     "complete (model weights, verified, atomic) to RUN/exports/, then apply the keep rules, removing "
                     "a checkpoint only once its export is verified. Exit 0, 1 when an export or a removal failed. "
                     "On URLs (s3://...) it only plans: it prints the plan, acts nowhere and exits 2.")
    sp.add_argument("roots", nargs="+", metavar="ROOT")
    sp.add_argument("--export", required=True, choices=ExportFormats(), metavar="FORMAT",
                    help="the exports' format: one of %(choices)s")
    sp.add_argument("--config", metavar="CONFIG_JSON", help="with --export hf: the model's Hugging Face config.json "
                    "(as export --hf --config), for every checkpoint the watch exports")
    sp.add_argument("--export-to", metavar="DIR", help="write exports to DIR/<run name>/ instead of RUN/exports/")
    add_keep_rules(sp)
    sp.add_argument("--delete", action="store_true", help="remove for good instead of moving to the trash")
    sp.add_argument("--once", action="store_true", help="one pass, then exit (cron, a SLURM epilogue)")
    sp.add_argument("--interval", type=float, default=30.0, metavar="S", help="seconds between passes (default 30)")
    sp.add_argument("--dry-run", action="store_true", help="print what one pass would do (each checkpoint: export, "
                    "already exported, waiting; keep and why, or remove once exported) and exit 0, writing nothing")
    sp.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    add_storage_options(sp)


def _log(line: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}", flush=True)


def run(args: argparse.Namespace) -> int:
    from shardscope.backend.library.watch import URL_PLANS_ONLY, Watcher, plan_watch

    given = any(v is not None for v in (args.keep_last, args.keep_every, args.keep_best)) or args.keep
    rules = rules_of(args) if given else None  # no rule: export only
    urls = [r for r in args.roots if is_url(r)]
    if args.json and not args.dry_run:
        raise ShardscopeError("watch: --json prints the plan of --dry-run; give both.")
    if args.config and args.export != "hf":
        raise ShardscopeError(f"watch: --config is the Hugging Face config of --export hf, not of {args.export}.")
    if args.dry_run or urls:
        apply_to_fsspec(args, args.roots)
        plan = plan_watch(args.roots, args.export, rules, export_to=args.export_to, config=args.config)
        if args.json:
            json.dump({**plan.to_json(), "acted": False}, sys.stdout)
            sys.stdout.write("\n")
        else:
            for line in plan.lines():
                print(escape_name(line))
        if args.dry_run:
            return EXIT_OK
        err(f"{urls[0]}: {URL_PLANS_ONLY} (the plan above; --dry-run shows it and exits 0).")
        return EXIT_BAD_INPUT
    watcher = Watcher(args.roots, args.export, rules, export_to=args.export_to, delete=args.delete, log=_log,
                      config=args.config)

    def on_signal(signum: int, frame: Any) -> None:
        # NOTE: only noted (and the export in flight cancelled through its Progress): the pass stops at its next
        # check; an export's own handler takes over while it writes (backend/export/atomic.py)
        watcher.stop(signal.Signals(signum).name)

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    failed = False
    try:
        while True:
            report = watcher.run_pass()
            failed |= report.failed > 0
            if args.once or watcher.stopping:
                break
            end = time.monotonic() + max(args.interval, 0.1)
            while not watcher.stopping and time.monotonic() < end:
                time.sleep(0.1)
            if watcher.stopping:
                break
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if watcher.stopping:
        _log(f"stopped by {watcher.stopped_by}; every export is whole or absent")
    sys.stdout.flush()
    return EXIT_PROBLEMS if failed else EXIT_OK
