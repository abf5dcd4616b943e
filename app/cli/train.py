"""``shardscope train``: launch a training run through torchrun (here under its supervisor, or on SLURM) and
follow it on the terminal (or return at once with ``--detach``; ``--dry-run`` writes a SLURM job script only).
The attached progress line is shared with ``shardscope follow``."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

from shardscope.backend.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_PROBLEMS, ShardscopeError

from .output import add_command


def add_train_options(sp: argparse.ArgumentParser, steps: int) -> None:
    """The options ``train`` and ``demo`` share."""
    sp.add_argument("--strategy", choices=("fsdp", "ddp"), default="fsdp")
    sp.add_argument("--nproc", type=int, default=2, help="processes (per node with --on slurm)")
    sp.add_argument("--steps", type=int, default=steps, help="total steps (a resumed run ends at the same step)")
    sp.add_argument("--checkpoint-every", type=int, default=10, metavar="K")
    sp.add_argument("--run-dir", help="run directory (default: a new one under the user data dir; with --on slurm "
                    "it must be on storage every node sees)")
    sp.add_argument("--resume", metavar="CKPT", help="continue from this DCP checkpoint (a script gets it in "
                    "$SHARDSCOPE_RESUME)")
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
                    help="warn when a rank reports no new step for this long (default 60; recorded in the run's "
                         "config.json: the window and `follow` use it)")


def add_slurm_options(sp: argparse.ArgumentParser) -> None:
    g = sp.add_argument_group("SLURM (with --on slurm)")
    g.add_argument("--on", choices=("local", "slurm"), default="local",
                   help="where to run: this machine (default) or a SLURM job (writes RUN/job.sbatch, submits it)")
    g.add_argument("--nodes", type=int, default=1, help="nodes; one torchrun per node")
    g.add_argument("--gpus-per-node", type=int, help="GPUs per node (and processes per node)")
    g.add_argument("--cpus-per-task", type=int, help="CPUs per node's task (default: one per process)")
    g.add_argument("--partition", help="SLURM partition (default: the cluster's default)")
    g.add_argument("--time", help="time limit, e.g. 2:00:00")
    g.add_argument("--account", help="SLURM account")
    g.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="extra #SBATCH line, e.g. --sbatch-arg=--mem=64G (repeatable)")


def register(sub: Any) -> None:
    sp = add_command(sub, "train", run, "Launch an FSDP/DDP training run through torchrun (here or on SLURM) "
                     "and follow it.")
    add_train_options(sp, 50)
    from shardscope.backend.runs.launcher import SCRIPT_CONTRACT

    sp.add_argument("--script", help=f"run your own training script instead of the built-in trainer. "
                    f"{SCRIPT_CONTRACT}")
    sp.add_argument("--detach", action="store_true", help="start the run, print its directory and return at once "
                    "(it runs on by itself; `shardscope follow RUN` attaches, `shardscope stop RUN` stops it)")
    sp.add_argument("--dry-run", action="store_true", help="with --on slurm: write RUN/job.sbatch and print it, "
                    "submitting nothing")
    add_slurm_options(sp)
    sp.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for --script, after --")


def run_config(args: argparse.Namespace) -> Any:
    """The :class:`RunConfig` the command line asks for, with paths resolved against the working directory."""
    from shardscope.backend.runs.launcher import RunConfig
    from shardscope.backend.runs.slurm import SlurmOptions

    model = {k: getattr(args, k) for k in ("width", "depth", "heads", "seq_len", "vocab", "batch_size", "lr",
                                             "seed", "grad_clip") if getattr(args, k, None) is not None}
    script_args = [a for a in (getattr(args, "script_args", None) or []) if a != "--"]
    on = getattr(args, "on", "local")
    opts = SlurmOptions(nodes=args.nodes, gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task,
                        partition=args.partition, time=args.time, account=args.account,
                        sbatch_args=list(args.sbatch_arg)) if on == "slurm" else None
    cfg = RunConfig(strategy=args.strategy, nproc=args.nproc, steps=args.steps,
                    checkpoint_every=args.checkpoint_every, device=args.device, resume=args.resume,
                    script=getattr(args, "script", None), script_args=script_args, model=model, on=on, slurm=opts,
                    stall_seconds=getattr(args, "stall_seconds", None))
    cfg = cfg.resolved()
    problems = cfg.problems(submitting=not getattr(args, "dry_run", False))
    if problems:
        raise ShardscopeError("; ".join(f"--{k.replace('_', '-')}: {v}" for k, v in problems.items()))
    return cfg


def follow_run(args: argparse.Namespace) -> tuple[int, str]:
    """Start the run and print its progress until it ends (Ctrl-C stops it), or return at once (``--detach``,
    ``--dry-run``); returns (exit code, run dir)."""
    from shardscope.backend.runs.launcher import RunLauncher
    from shardscope.backend.runs.rundir import new_run_dir

    config = run_config(args)
    launcher = RunLauncher(args.run_dir or new_run_dir(), config)
    if getattr(args, "dry_run", False):
        script = launcher.dry_run()
        print(script.read_text(), end="")
        print(f"shardscope: dry run: wrote {script}; nothing was submitted (the same command without --dry-run "
              "submits it)", file=sys.stderr)
        return EXIT_OK, str(launcher.run_dir)
    launcher.start()
    print(f"run directory: {launcher.run_dir}", flush=True)
    if launcher.note:
        print(launcher.note, flush=True)
    if getattr(args, "detach", False):
        job = launcher.status().get("job_id")
        print(f"started{f' as SLURM job {job}' if job else ''}; it runs on by itself: `shardscope follow "
              f"{launcher.run_dir}` shows its progress, `shardscope stop {launcher.run_dir}` stops it", flush=True)
        return EXIT_OK, str(launcher.run_dir)
    print("Ctrl-C stops the run (`train --detach` starts one that runs on by itself; `shardscope follow RUN` "
          "attaches to a run without stopping it)", flush=True)
    total = None if config.script else config.steps
    return attach(launcher.run_dir, total, args.stall_seconds, stops=True, launcher=launcher), str(launcher.run_dir)


def attach(run_dir: Any, total: int | None, stall_seconds: float | None, stops: bool, launcher: Any = None) -> int:
    """Print the run's progress line until it is over; its exit code (see :func:`report_end`). Ctrl-C or SIGTERM
    stops the run when ``stops`` (an attached ``train``), else detaches (``follow``: exit 130, the run goes on)."""
    from shardscope.backend.runs.follow import RunFollower
    from shardscope.backend.runs.launcher import stop_run
    from shardscope.backend.runs.rundir import OVER_STATES

    follower = RunFollower(run_dir, stall_seconds=stall_seconds)
    shown = ""
    said = ""
    warned: set[int] = set()
    tty = sys.stdout.isatty()
    previous_term = signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's or `kill`'s stop = Ctrl-C
    try:
        while True:
            snap = follower.poll()
            status = snap.status
            if launcher is not None and launcher.proc is not None:
                launcher.proc.poll()  # reaps the supervisor once it has ended
            over = status.get("state") in OVER_STATES
            if over:
                follower.poll()  # the points written between the read above and the run's end
            waiting = f"queued: {status.get('explanation', '')}" if status.get("state") == "queued" else ""
            if waiting and waiting != said:
                print(f"job {status.get('job_id')} {waiting}", flush=True)
            said = waiting
            for r in set(snap.stalled) - warned:
                print(f"\nwarning: rank {r} has reported no new step for {follower.stall_limit:.0f} s (stalled?)",
                      flush=True)
            warned = set(snap.stalled)
            line = follower.progress(total)
            if line and line != shown:
                shown = line
                print(("\r\033[K" + line) if tty else line, end="" if tty else "\n", flush=True)
            if over:  # the last line shown is the run's last step, however fast it ended
                break
            time.sleep(0.5)
    except KeyboardInterrupt as exc:
        if not stops:
            print(f"\ndetached ({str(exc) or 'Ctrl-C'}): the run goes on. `shardscope follow {run_dir}` attaches "
                  f"again, `shardscope stop {run_dir}` stops it.", flush=True)
            return EXIT_INTERRUPTED
        print(f"\nstopping the run ({str(exc) or 'Ctrl-C'}) ...", flush=True)
        # NOTE: a second Ctrl-C or SIGTERM while stopping must not leave the stop half-waited-for.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            launcher.stop() if launcher is not None else stop_run(run_dir)
        finally:
            signal.signal(signal.SIGINT, previous)
    finally:
        signal.signal(signal.SIGTERM, previous_term)
    if tty:
        print()
    return report_end(run_dir)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def report_end(run_dir: Any) -> int:
    """Print how the run ended (and the failed ranks' tracebacks); the exit code for it."""
    from shardscope.backend.runs.launcher import run_status
    from shardscope.backend.runs.rundir import log_tail

    status = run_status(run_dir)
    state = status.get("state")
    print(f"run {state}: {status.get('explanation', '')}")
    if state == "failed":
        for r in status.get("failed_ranks") or []:
            print(f"--- rank {r} failed; end of logs/rank_{r}.log:\n{log_tail(run_dir, r)}")
        if not status.get("failed_ranks"):
            print(f"--- end of logs/launcher.log:\n{log_tail(run_dir, -1, 40)}")
    return EXIT_OK if state == "finished" else EXIT_PROBLEMS


def run(args: argparse.Namespace) -> int:
    code, _ = follow_run(args)
    return code
