"""``export()``: a plan written by its format's registered writer (``registry.WRITERS``) into an atomic output,
then verified by re-reading what was written, then committed. Nothing is left at the destination on any failure."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from ..checkpoint.chunks import ChunkReader
from ..checkpoint.storage import why_absent
from ..errors import CheckpointError
from ..progress import Progress
from .atomic import AtomicOutput
from .lineage import lineage_for
from .output_seal import Origin
from .plan import ExportItem, ExportPlan
from .registry import WriteFn, writer
from .result import ExportResult
from .source import TensorSource
from .verify import WHAT, Expectation, Verifier, check_written


def check_sources(plan: ExportPlan) -> None:
    """Every file the plan reads exists, before anything is written."""
    needed = {c.file for it in plan.items for c in it.entry.chunks} | {o.file for _, o in plan.objects if o.file}
    sizes = {f.name: f.bytes for f in plan.ckpt.files}
    for f in sorted(needed, key=str):
        if not f or sizes.get(f) is None:
            users = [it.entry.fqn for it in plan.items if any(c.file == f for c in it.entry.chunks)][:3]
            why = why_absent(plan.ckpt.path, f) if f else "is missing"
            raise CheckpointError(f"{os.path.join(plan.ckpt.path, f or '?')} {why}; needed by "
                                  f"{', '.join(users) or 'non-tensor entries'}.", path=f)


def export(plan: ExportPlan, dst: str, force: bool = False, verify: bool = True,
           progress: Progress | None = None, storage_options: dict | None = None,
           values: Callable[[ChunkReader, list[ExportItem]], TensorSource] | None = None,
           sources: list[str] | None = None, lineage: dict[str, Any] | None = None) -> ExportResult:
    """Write the plan to ``dst`` atomically (a folder when the plan is sharded). With ``verify`` every
    tensor's bytes are re-read from the output and compared with the source's before the rename.
    ``values`` makes the tensor source whose bytes are written in place of the plan's checkpoint's (the weight
    average: ``sources`` then lists every checkpoint it reads, ``lineage`` its sidecar's document)."""
    t0 = time.monotonic()
    w = writer(plan.format)  # ExportError for a name no plan writer is registered under
    write = cast(WriteFn, w.write)  # not None: writer() refuses a format written apart from plans (DCP)
    progress = progress or Progress()  # its cancel flag stops the writer threads when one of them fails
    check_sources(plan)
    total = plan.total_bytes
    left_out = list(plan.left_out)
    if lineage is None:
        lineage = lineage_for(plan.ckpt.path, plan.format, plan.ckpt.format, plan.model)  # the source as it is read
    with AtomicOutput(dst, kind=w.output_kind(plan.max_shard_size), force=force, need_bytes=plan.need_bytes(),
                      storage_options=storage_options, sources=sources or [plan.ckpt.path], progress=progress,
                      lineage=lineage) as out:
        progress.start(2 * total, "read+verified")  # each byte read from the source, then re-read from the output
        with ChunkReader(plan.ckpt) as reader:
            source = values(reader, list(plan.items)) if values is not None else \
                TensorSource(reader, list(plan.items), kernel_copy=True)
            # remote: every item this export reads, planned into fixed segments before the first read
            if not reader.handles.local:  # (a local reader plans nothing: files_at_once is 5 s for 300,000 tensors)
                reader.plan_reads((c for it in plan.items for c in it.entry.chunks), (o for _, o in plan.objects),
                                  files_at_once=source.files_at_once())
            # Each tensor is re-read from the written file and checked as soon as it is written, while the next
            # ones are written. --no-verify still re-reads what the kernel copied: that is where its stored CRC32
            # is checked.
            def kernel_copied(e: Expectation) -> bool:
                return e.name in source.kernel_copied

            source.verifier = verifier = Verifier(progress, want=None if verify else kernel_copied)
            try:
                names, expect = write(plan, out.path, dst, source, progress, left_out)
                out.hold_for_tests("written")
                for e in expect:  # what a writer wrote without handing it over as it went (none for safetensors)
                    if (e.file, e.offset) not in verifier.submitted:
                        verifier.check(e)
                # The data goes to disk (fsync) while the last tensors are re-read from the page cache and checked.
                with ThreadPoolExecutor(1, thread_name_prefix="export-fsync") as syncer:
                    synced = syncer.submit(out.sync)
                    mismatches = verifier.finish()
                    synced.result()
            finally:
                verifier.close()
            by_key = {it.key: it for it in plan.items}
            mismatches = _one_by_one(mismatches, verifier.failed, expect, by_key)
            for key in mismatches:  # a kernel-copied record that fails its stored CRC: name the bad source
                if key in by_key:
                    source.check_source(by_key[key])
        if not mismatches:  # the output's manifest, from the bytes written, checked against a sealed source's
            mismatches = out.seal(None if values is not None else plan.ckpt.path, _origins(plan))
        if mismatches:
            return ExportResult(out.dst, [], len(plan.items), total, time.monotonic() - t0, plan.format,
                                left_out=left_out, notes=list(plan.notes), verified=False, mismatches=mismatches)
        out.commit()
    files = [os.path.join(out.dst, n) if n else out.dst for n in names]
    return ExportResult(out.dst, files, len(plan.items), total, time.monotonic() - t0, plan.format,
                        left_out=left_out, notes=list(plan.notes), verified=True if verify else None,
                        verified_what=WHAT if verify else "", uploaded=out.uploaded, kept=out.kept)


def _origins(plan: ExportPlan) -> dict[str, Origin]:
    """Each output tensor's source entry, and what was done to it: a Hugging Face model's transform (the rotary
    permutation, a split), the cast when its dtype is not the source's."""
    def done(it: ExportItem) -> str | None:
        what = [it.transform.describe()] if it.transform is not None else []
        what += [f"cast {it.entry.dtype} to {it.dtype}"] if it.dtype != it.entry.dtype else []
        return "; ".join(what) or None

    return {it.key: Origin(it.entry.fqn, done(it)) for it in plan.items}


def _one_by_one(names: list[str], failed: list[Expectation], expect: list[Expectation], by_key: dict) -> list[str]:
    """The tensors to name for ranges that failed: a run of small tensors checked as one range ("a … b") is
    checked again tensor by tensor, so the message names the ones whose bytes differ."""
    out = [n for n in names if n in by_key]
    for e in failed:
        if e.name in by_key:
            continue
        inside = [x for x in expect if x.file == e.file and e.offset <= x.offset < e.offset + e.length]
        out += check_written(inside) or [e.name]
    return out


__all__ = ["check_sources", "export"]
