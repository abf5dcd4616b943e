"""The ``shardscope`` command: one subcommand per job, using ``backend`` only (no Qt) except ``gui``.

Exit codes: 0 success, 1 problems/differences found or verification failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from shardscope.backend.errors import Cancelled, ShardscopeError
from shardscope.backend.format import human_bytes

EXIT_OK, EXIT_PROBLEMS, EXIT_BAD_INPUT = 0, 1, 2


def _err(msg: str) -> None:
    print(f"shardscope: {msg}", file=sys.stderr)


# ---------------------------------------------------------------- inspect / verify / show
def inspect_json(ckpt: Any, problems: list) -> dict:
    from shardscope.backend.checkpoint.layout import rank_balance

    return {
        "path": ckpt.path,
        "format": ckpt.format,
        "version": ckpt.version,
        "save_id": ckpt.save_id,
        "files": [{"name": f.name, "rank": f.rank, "bytes": f.bytes, "kind": f.kind} for f in ckpt.files],
        "tensors": [t.to_json() for t in ckpt.tensors],
        "objects": [o.to_json() for o in ckpt.objects],
        "ranks": [r.to_json() for r in rank_balance(ckpt)],
        "problems": [p.to_json() for p in problems],
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    from shardscope.backend.checkpoint import open_checkpoint
    from shardscope.backend.checkpoint.layout import rank_balance
    from shardscope.backend.checkpoint.verify import verify

    ckpt = open_checkpoint(args.path, use_cache=not args.no_cache)
    problems = verify(ckpt)
    if args.json:
        json.dump(inspect_json(ckpt, problems), sys.stdout)
        sys.stdout.write("\n")
        return EXIT_OK
    out = sys.stdout
    out.write(f"{ckpt.path}\n")
    out.write(f"  format     {ckpt.format}  (DCP version {ckpt.version or 'unknown'})\n")
    if ckpt.save_id:
        out.write(f"  save id    {ckpt.save_id}\n")
    out.write(f"  tensors    {len(ckpt.tensors)}  ({human_bytes(ckpt.total_bytes)}, "
              f"{len(ckpt.chunk_table)} chunks)\n")
    out.write(f"  other      {len(ckpt.objects)} non-tensor entries\n")
    out.write(f"  files      {len(ckpt.data_files)} data files, "
              f"{human_bytes(sum(f.bytes or 0 for f in ckpt.files))} on disk\n")
    out.write("  ranks      (writer rank: DCP writes a replicated tensor once, so a rank here is the rank\n"
              "             that wrote a chunk, not every rank that held it)\n")
    for r in rank_balance(ckpt):
        label = f"rank {r.rank}" if r.rank >= 0 else "no rank"
        out.write(f"    {label:<9} {r.chunks:>8} chunks  {human_bytes(r.bytes):>10}\n")
    if args.tensors:
        out.write("\n")
        width = max((len(t.fqn) for t in ckpt.tensors), default=10)
        for t in ckpt.tensors:
            out.write(f"  {t.fqn:<{width}}  {t.dtype:<9} {list(t.shape)!s:<18} {human_bytes(t.nbytes):>10}  "
                      f"{t.chunk_count} chunks, ranks {t.ranks}\n")
    _print_problems(problems)
    return EXIT_OK


def _print_problems(problems: list) -> None:
    if not problems:
        print("  health     healthy")
        return
    print(f"  health     {len(problems)} problem(s)")
    for p in problems[:200]:
        print(f"    [{p.kind}] {p.message}")
    if len(problems) > 200:
        print(f"    ... and {len(problems) - 200} more (use --json for all)")


DEEP_NOTE = " (deep: every item read; CRC32 checked where the format stores one)"


def cmd_verify(args: argparse.Namespace) -> int:
    from shardscope.backend.checkpoint import open_checkpoint
    from shardscope.backend.checkpoint.verify import verify

    ckpt = open_checkpoint(args.path, use_cache=not args.no_cache)
    with TerminalProgress(enabled=args.deep and not args.json) as progress:
        problems = verify(ckpt, deep=args.deep, progress=progress)
    if args.json:
        json.dump({"path": ckpt.path, "deep": args.deep, "healthy": not problems,
                   "problems": [p.to_json() for p in problems]}, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(f"{ckpt.path}: {len(ckpt.tensors)} tensors, {len(ckpt.chunk_table)} chunks, "
              f"{len(ckpt.data_files)} files{DEEP_NOTE if args.deep else ''}")
        _print_problems(problems)
    return EXIT_PROBLEMS if problems else EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    from shardscope.backend.checkpoint import open_checkpoint
    from shardscope.backend.checkpoint.layout import coverage
    from shardscope.backend.checkpoint.values import ChunkReader, small_value_repr, tensor_stats

    ckpt = open_checkpoint(args.path, use_cache=not args.no_cache)
    if not ckpt.has_tensor(args.fqn):
        obj = next((o for o in ckpt.objects if o.fqn == args.fqn), None)
        if obj is None:
            close = [t.fqn for t in ckpt.tensors if args.fqn in t.fqn][:5]
            hint = f" Did you mean: {', '.join(close)}?" if close else " List them with `shardscope inspect --tensors`."
            _err(f"{ckpt.path}: no entry named {args.fqn!r}.{hint}")
            return EXIT_BAD_INPUT
        with ChunkReader(ckpt) as reader:
            value = reader.read_object(obj)
        print(f"{obj.fqn}  (non-tensor entry in {obj.file}, bytes {obj.offset}..{obj.offset + obj.length})")
        print(f"  value  {small_value_repr(value, 2000)}")
        return EXIT_OK
    entry = ckpt.tensor(args.fqn)
    cov = coverage(ckpt, entry)
    print(f"{entry.fqn}")
    print(f"  dtype   {entry.dtype}\n  shape   {list(entry.shape)}\n  bytes   {human_bytes(entry.nbytes)}")
    print(f"  chunks  {entry.chunk_count} from ranks {entry.ranks}; "
          f"{'tile the tensor exactly' if cov.exact else 'DO NOT tile the tensor (see verify)'}")
    print(f"  {'offsets':<16} {'sizes':<16} {'rank':>4}  {'file':<16} {'byte offset':>12} {'length':>10}")
    for c in entry.chunks:
        print(f"  {list(c.offsets)!s:<16} {list(c.sizes)!s:<16} {c.rank if c.rank is not None else '-':>4}  "
              f"{c.file:<16} {c.offset:>12} {c.length:>10}")
    if args.no_values:
        return EXIT_OK
    with ChunkReader(ckpt) as reader:
        tensor = reader.read_tensor(entry)
    st = tensor_stats(tensor)
    print("  values")
    if st.min is None:
        print("    no finite values")
    else:
        print(f"    min {st.min:.6g}  max {st.max:.6g}  mean {st.mean:.6g}  std {st.std:.6g}")
    print(f"    NaN {st.nan}  Inf {st.inf}  zeros {st.zeros}  of {st.numel}")
    if args.json:
        print(json.dumps({"tensor": entry.to_json(), "stats": st.to_json()}))
    return EXIT_OK


# ---------------------------------------------------------------- progress on a terminal
class TerminalProgress:
    """A progress line on stderr (bytes, rate, time left) when stderr is a terminal."""

    def __init__(self, enabled: bool = True, unit: str = "items") -> None:
        from shardscope.backend.progress import Progress

        self.enabled = enabled and sys.stderr.isatty()
        self.unit = unit
        self._last = 0.0
        self._t0 = 0.0
        self.progress = Progress(self._show)

    def __enter__(self) -> Any:
        import time

        self._t0 = time.monotonic()
        return self.progress

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()

    def _show(self, done: int, total: int, message: str) -> None:
        import time

        from shardscope.backend.format import human_duration

        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and done < total:
            return
        self._last = now
        elapsed = max(now - self._t0, 1e-6)
        frac = done / total if total else 0.0
        bar = "#" * int(frac * 30)
        if self.unit == "bytes":
            rate = done / elapsed
            left = (total - done) / rate if rate > 0 else 0
            text = (f"[{bar:<30}] {human_bytes(done)}/{human_bytes(total)} {human_bytes(rate)}/s "
                    f"{human_duration(left)} left")
        else:
            text = f"[{bar:<30}] {done}/{total} {message[:40]}"
        sys.stderr.write("\r\033[K" + text)
        sys.stderr.flush()


# ---------------------------------------------------------------- entry point
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardscope",
        description="Browse, train and export PyTorch distributed (DCP) checkpoints. "
                    "Without a subcommand, opens the GUI (on PATH if given).")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(func=func)
        return sp

    sp = add("inspect", cmd_inspect, "Summarise a checkpoint: format, tensors, ranks, bytes, problems.")
    sp.add_argument("path")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.add_argument("--tensors", action="store_true", help="list every tensor")
    sp.add_argument("--no-cache", action="store_true", help="do not use the metadata cache")

    sp = add("verify", cmd_verify, "Check a checkpoint's health (exit 0 healthy, 1 problems, 2 unreadable).")
    sp.add_argument("path")
    sp.add_argument("--deep", action="store_true", help="read every item, check CRC32, dtype and shape")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--no-cache", action="store_true")

    sp = add("show", cmd_show, "Show one tensor: shape, dtype, chunk table and value statistics.")
    sp.add_argument("path")
    sp.add_argument("fqn")
    sp.add_argument("--no-values", action="store_true", help="only the chunk table, read no values")
    sp.add_argument("--json", action="store_true", help="also print the chunk table and statistics as JSON")
    sp.add_argument("--no-cache", action="store_true")

    for extra in _EXTRA_COMMANDS:
        extra(add)
    return p


_EXTRA_COMMANDS: list[Callable] = []


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _register_optional_commands()
    parser = build_parser()
    sub_names = next(set(a.choices) for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if not argv or (argv[0] not in sub_names and not argv[0].startswith("-")):
        argv = ["gui", *argv]  # `shardscope` and `shardscope PATH` open the window
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return args.func(args)
    except Cancelled:
        _err("cancelled")
        return 130
    except ShardscopeError as exc:
        _err(str(exc))
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except BrokenPipeError:
        os._exit(0)


def _register_optional_commands() -> None:
    if not _EXTRA_COMMANDS:
        from shardscope.app import commands

        _EXTRA_COMMANDS.extend(commands.COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
