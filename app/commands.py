"""Subcommands beyond inspect/verify/show: gui, export, train, demo. Each registers itself here."""

from __future__ import annotations

import argparse
from collections.abc import Callable

COMMANDS: list[Callable] = []


def command(func: Callable) -> Callable:
    COMMANDS.append(func)
    return func


@command
def _gui(add: Callable) -> None:
    sp = add("gui", run_gui, "Open the checkpoint browser window (optionally on PATH).")
    sp.add_argument("path", nargs="?", help="checkpoint folder or run directory to open")
    sp.add_argument("--select", metavar="FQN", help="select this tensor (or module prefix) after loading")
    sp.add_argument("--screenshot", metavar="FILE.png", help="render the window to a PNG after loading, then exit")
    sp.add_argument("--size", metavar="WxH", default=None, help="window size, e.g. 1400x900")
    sp.add_argument("--run", metavar="RUN_DIR", help="follow this run directory in the Training panel")
    sp.add_argument("--compare", nargs=2, metavar=("A", "B"), help="open the Compare view on two checkpoints")


def no_display() -> bool:
    """True on a Linux/BSD machine with no screen and no offscreen platform asked for."""
    import os
    import sys

    if sys.platform.startswith(("win", "darwin")) or os.environ.get("QT_QPA_PLATFORM"):
        return False
    return not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def run_gui(args: argparse.Namespace) -> int:
    if no_display():
        import sys

        print("shardscope: no display here (DISPLAY and WAYLAND_DISPLAY are unset), so no window can open.\n"
              "  On a server use the subcommands (inspect, verify, show, export, diff, train ...), run the window\n"
              "  on your desktop (it reads fsspec URLs and run folders on shared storage), or render a picture\n"
              "  with QT_QPA_PLATFORM=offscreen and --screenshot FILE.png.", file=sys.stderr)
        return 2
    from shardscope.app.main_window import run

    return run(args)


@command
def _export(add: Callable) -> None:
    sp = add("export", run_export, "Consolidate a sharded checkpoint into one .pt or safetensors file "
             "(or an HF-style sharded safetensors folder), streaming, verified.")
    sp.add_argument("src", help="checkpoint folder")
    sp.add_argument("dst", help="output: X.safetensors, X.pt/.pth/.bin, or a folder with --max-shard-size")
    sp.add_argument("--format", choices=("safetensors", "torch"), help="default: from the destination's name")
    sp.add_argument("--only", action="append", metavar="PREFIX",
                    help="export entries under this prefix (repeatable); safetensors default: model.* if present")
    sp.add_argument("--strip-prefix", metavar="PREFIX", help="remove this from every key, e.g. 'model.'")
    sp.add_argument("--dtype", help="cast floating-point tensors: bf16, fp16 or fp32")
    sp.add_argument("--max-shard-size", metavar="SIZE", help="sharded safetensors, e.g. 5GB or 500MB")
    sp.add_argument("--no-verify", action="store_true", help="skip re-reading the output to compare")
    sp.add_argument("--force", action="store_true", help="overwrite the destination")


def run_export(args: argparse.Namespace) -> int:
    from shardscope.app.cli import TerminalProgress
    from shardscope.backend.checkpoint import open_checkpoint
    from shardscope.backend.export import ExportError, export, format_for, plan_export
    from shardscope.backend.format import parse_size

    try:
        limit = parse_size(args.max_shard_size) if args.max_shard_size else None
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    ckpt = open_checkpoint(args.src)
    fmt = format_for(args.dst, args.format, limit)
    if limit and fmt != "safetensors":
        raise ExportError("--max-shard-size makes sharded safetensors; it does not apply to torch files.")
    plan = plan_export(ckpt, fmt, only=args.only, strip_prefix=args.strip_prefix, dtype=args.dtype,
                       max_shard_size=limit)
    with TerminalProgress(unit="bytes") as progress:
        result = export(plan, args.dst, force=args.force, verify=not args.no_verify, progress=progress)
    print(result.summary())
    return 1 if result.verified is False else 0


def _add_train_options(sp: argparse.ArgumentParser, steps: int) -> None:
    sp.add_argument("--strategy", choices=("fsdp", "ddp"), default="fsdp")
    sp.add_argument("--nproc", type=int, default=2, help="world size (processes)")
    sp.add_argument("--steps", type=int, default=steps, help="total steps (a resumed run ends at the same step)")
    sp.add_argument("--checkpoint-every", type=int, default=10, metavar="K")
    sp.add_argument("--run-dir", help="run directory (default: a new one under the user data dir)")
    sp.add_argument("--resume", metavar="CKPT", help="continue from this DCP checkpoint")
    sp.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    sp.add_argument("--width", type=int)
    sp.add_argument("--depth", type=int)
    sp.add_argument("--heads", type=int)
    sp.add_argument("--seq-len", type=int)
    sp.add_argument("--vocab", type=int)
    sp.add_argument("--batch-size", type=int)
    sp.add_argument("--lr", type=float)
    sp.add_argument("--seed", type=int)
    sp.add_argument("--grad-clip", type=float)
    sp.add_argument("--stall-seconds", type=float, default=60.0,
                    help="warn when a rank reports no new step for this long (default 60)")


@command
def _train(add: Callable) -> None:
    sp = add("train", run_train, "Launch a local FSDP/DDP training run through torchrun and follow it.")
    _add_train_options(sp, 50)
    sp.add_argument("--script", help="run your own training script instead of the built-in trainer")
    sp.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for --script, after --")


@command
def _demo(add: Callable) -> None:
    sp = add("demo", run_demo, "Train a tiny FSDP model on 2 CPU ranks with checkpoints, then open the GUI on it.")
    _add_train_options(sp, 30)
    sp.add_argument("--no-gui", action="store_true", help="train and inspect, but do not open a window")


def _config(args: argparse.Namespace):
    from shardscope.backend.runs.launcher import RunConfig

    model = {k: getattr(args, k) for k in ("width", "depth", "heads", "seq_len", "vocab", "batch_size", "lr",
                                             "seed", "grad_clip") if getattr(args, k, None) is not None}
    script_args = [a for a in (getattr(args, "script_args", None) or []) if a != "--"]
    return RunConfig(strategy=args.strategy, nproc=args.nproc, steps=args.steps,
                     checkpoint_every=args.checkpoint_every, device=args.device, resume=args.resume,
                     script=getattr(args, "script", None), script_args=script_args, model=model)


def follow_run(args: argparse.Namespace) -> tuple[int, str]:
    import sys
    import time

    from shardscope.backend.runs.follow import RunFollower
    from shardscope.backend.runs.launcher import (
        RunLauncher,
        default_runs_root,
        describe_exit,
        log_tail,
        read_status,
    )

    run_dir = args.run_dir or str(default_runs_root() / time.strftime("run-%Y%m%d-%H%M%S"))
    launcher = RunLauncher(run_dir, _config(args)).start()
    print(f"run directory: {launcher.run_dir}")
    follower = RunFollower(run_dir, stall_seconds=args.stall_seconds)
    last: dict = {}
    shown = None
    warned: set[int] = set()
    tty = sys.stdout.isatty()
    try:
        while launcher.poll() is None:
            time.sleep(0.5)
            snap = follower.poll()
            s0 = follower.series.get(0)
            if s0 is not None and len(s0):
                last = {f: s0.column(f)[-1] for f in ("step", "loss", "steps_per_s")}
            for r in set(snap.stalled) - warned:
                print(f"\nwarning: rank {r} has reported no new step for {args.stall_seconds:.0f} s (stalled?)",
                      flush=True)
            warned = set(snap.stalled)
            if last and last.get("step") != shown:
                shown = last.get("step")
                sps = last.get("steps_per_s")
                line = (f"step {last.get('step'):.0f}/{args.steps}  loss {last.get('loss', float('nan')):.4f}  "
                        f"{sps if sps == sps else 0:.1f} steps/s")
                print(("\r\033[K" + line) if tty else line, end="" if tty else "\n", flush=True)
    except KeyboardInterrupt:
        print("\nstopping the run (Ctrl-C) ...", flush=True)
        launcher.stop()
    if tty:
        print()
    status = read_status(run_dir)
    state = status.get("state")
    print(f"run {state}: {describe_exit(status.get('exit_code'))}")
    if state == "failed":
        for r in status.get("failed_ranks") or []:
            print(f"--- rank {r} failed; end of logs/rank_{r}.log:\n{log_tail(run_dir, r)}")
        if not status.get("failed_ranks"):
            print(f"--- end of logs/launcher.log:\n{(launcher.run_dir / 'logs' / 'launcher.log').read_text()[-3000:]}")
    return (0 if state == "finished" else 1), str(launcher.run_dir)


def run_train(args: argparse.Namespace) -> int:
    code, _ = follow_run(args)
    return code


def run_demo(args: argparse.Namespace) -> int:
    from shardscope.backend.checkpoint import open_checkpoint
    from shardscope.backend.checkpoint.verify import verify
    from shardscope.backend.runs.launcher import checkpoints

    code, run_dir = follow_run(args)
    if code != 0:
        return code
    ckpts = checkpoints(run_dir)
    if not ckpts:
        print("the run wrote no checkpoint")
        return 1
    last = ckpts[-1]
    ck = open_checkpoint(last)
    problems = verify(ck, deep=True)
    print(f"last checkpoint {last}: {len(ck.tensors)} tensors over ranks {ck.ranks}, "
          f"{'healthy' if not problems else f'{len(problems)} problems'}")
    print(f"try: shardscope inspect {last}\n     shardscope export {last} model.safetensors --strip-prefix model.")
    if problems:
        return 1
    if args.no_gui:
        return 0
    if no_display():
        print(f"no display here, so the window is not opened; on a desktop: shardscope gui {last} --run {run_dir}")
        return 0
    ns = argparse.Namespace(path=str(last), select="model.blocks.0", screenshot=None, size=None, run=run_dir)
    return run_gui(ns)


@command
def _diff(add: Callable) -> None:
    sp = add("diff", run_diff, "Compare two checkpoints (DCP folders, .pt or .safetensors files) by value. "
             "Exit 0 no differences in values, 1 differences found, 2 cannot read.")
    sp.add_argument("a")
    sp.add_argument("b")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.add_argument("--all", action="store_true", help="list every changed entry (default: the first 50)")


def run_diff(args: argparse.Namespace) -> int:
    import json

    from shardscope.app.cli import TerminalProgress
    from shardscope.backend.compare import diff, open_source

    with open_source(args.a) as a, open_source(args.b) as b, TerminalProgress(enabled=not args.json) as progress:
        result = diff(a, b, progress)
    if args.json:
        print(json.dumps(result.to_json()))
        return 1 if result.differs else 0
    print(f"A: {result.a}\nB: {result.b}")
    print(f"{len(result.only_a)} only in A, {len(result.only_b)} only in B, {len(result.changed)} changed, "
          f"{result.unchanged} unchanged")
    for label, names in (("only in A", result.only_a), ("only in B", result.only_b)):
        for n in names[: None if args.all else 20]:
            print(f"  {label}: {n}")
    shown = result.changed if args.all else result.changed[:50]
    if shown:
        width = max(len(c.fqn) for c in shown)
        print(f"  {'entry':<{width}}  {'kind':<7} {'max|a-b|':>11} {'rel L2':>10} {'changed':>8}")
        for c in shown:
            stats = (f"{c.max_abs_diff:>11.4g} {c.rel_l2:>10.3g} {100 * c.frac_changed:>7.2f}%"
                     if c.rel_l2 is not None else f"{c.detail:>31}")
            print(f"  {c.fqn:<{width}}  {c.kind:<7} {stats}")
    if len(result.changed) > len(shown):
        print(f"  ... {len(result.changed) - len(shown)} more (--all)")
    layout_only = [c for c in result.changed if c.kind == "layout"]
    if layout_only and not result.differs:
        print("only the layout differs (other ranks or chunks); the values are the same")
    return 1 if result.differs else 0


@command
def _import(add: Callable) -> None:
    sp = add("import", run_import, "Turn a .pt or .safetensors file (or an HF folder with an index) into a DCP "
             "checkpoint that dcp.load reads, streaming, verified.")
    sp.add_argument("file")
    sp.add_argument("dst_dir")
    sp.add_argument("--ranks", type=int, default=1, help="write it as if saved by M ranks (row-wise chunks)")
    sp.add_argument("--prefix", help="nest every key under this, e.g. 'model' for dcp.load({'model': ...})")
    sp.add_argument("--no-verify", action="store_true")
    sp.add_argument("--force", action="store_true")


@command
def _reshard(add: Callable) -> None:
    sp = add("reshard", run_reshard, "Rewrite a DCP checkpoint as if saved by M ranks (even row-wise chunks, as "
             "FSDP2 shards), streaming; values unchanged (verified).")
    sp.add_argument("src")
    sp.add_argument("dst")
    sp.add_argument("--ranks", type=int, required=True)
    sp.add_argument("--no-verify", action="store_true")
    sp.add_argument("--force", action="store_true")


def run_import(args: argparse.Namespace) -> int:
    from shardscope.app.cli import TerminalProgress
    from shardscope.backend.export.dcp_writer import import_file

    with TerminalProgress(unit="bytes") as progress:
        result = import_file(args.file, args.dst_dir, args.ranks, args.prefix, args.force, not args.no_verify,
                             progress)
    print(result.summary())
    return 1 if result.verified is False else 0


def run_reshard(args: argparse.Namespace) -> int:
    from shardscope.app.cli import TerminalProgress
    from shardscope.backend.export.dcp_writer import reshard

    with TerminalProgress(unit="bytes") as progress:
        result = reshard(args.src, args.dst, args.ranks, args.force, not args.no_verify, progress)
    print(result.summary())
    return 1 if result.verified is False else 0
