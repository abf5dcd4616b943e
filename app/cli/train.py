"""``shardscope train``: launch a training run through torchrun and follow it on the terminal."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from shardscope.backend.errors import EXIT_OK, EXIT_PROBLEMS

from .output import add_command


def add_train_options(sp: argparse.ArgumentParser, steps: int) -> None:
    """The options ``train`` and ``demo`` share."""
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


def register(sub: Any) -> None:
    sp = add_command(sub, "train", run, "Launch a local FSDP/DDP training run through torchrun and follow it.")
    add_train_options(sp, 50)
    sp.add_argument("--script", help="run your own training script instead of the built-in trainer")
    sp.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for --script, after --")


def run_config(args: argparse.Namespace) -> Any:
    """The :class:`RunConfig` the command line asks for."""
    from shardscope.backend.runs.launcher import RunConfig

    model = {k: getattr(args, k) for k in ("width", "depth", "heads", "seq_len", "vocab", "batch_size", "lr",
                                             "seed", "grad_clip") if getattr(args, k, None) is not None}
    script_args = [a for a in (getattr(args, "script_args", None) or []) if a != "--"]
    return RunConfig(strategy=args.strategy, nproc=args.nproc, steps=args.steps,
                     checkpoint_every=args.checkpoint_every, device=args.device, resume=args.resume,
                     script=getattr(args, "script", None), script_args=script_args, model=model)


def follow_run(args: argparse.Namespace) -> tuple[int, str]:
    """Start the run, print progress until it ends (Ctrl-C stops it); returns (exit code, run dir)."""
    from shardscope.backend.runs.follow import RunFollower
    from shardscope.backend.runs.launcher import RunLauncher, default_runs_root, describe_exit, log_tail, read_status

    run_dir = args.run_dir or str(default_runs_root() / time.strftime("run-%Y%m%d-%H%M%S"))
    launcher = RunLauncher(run_dir, run_config(args)).start()
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
    return (EXIT_OK if state == "finished" else EXIT_PROBLEMS), str(launcher.run_dir)


def run(args: argparse.Namespace) -> int:
    code, _ = follow_run(args)
    return code
