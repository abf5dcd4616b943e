"""A short, fixed-seed mutation-fuzzing pass over real dcp.save output (the long run is
``benchmarks/fuzz_long.py``): no exception other than a ShardscopeError escapes open/verify/read, no case
hangs, memory stays bounded by the file's size, a mutated ``.distcp`` that torch's own loader cannot read is
never healthy and values read equal torch's; and the CLI answers 0/1/2 without a traceback. The same contract
for the DeepSpeed ZeRO parser on real DeepSpeed saves (their archives and their pickles mutated), and for the
Megatron format on a real Megatron-Core save (its common.pt and metadata.json mutated)."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import run_cli
from fuzz.deepspeed_files import deepspeed_corpus, exercise_deepspeed, mutated_file
from fuzz.harness import corpus, make_case, mutated, run_case, run_same_metadata_case, torch_reads
from fuzz.megatron_files import exercise_megatron, megatron_corpus
from fuzz.megatron_files import mutated_file as mutated_megatron_file
from fuzz.mutators import metadata_attribute_order, planner_paths
from fuzz.safetensors_files import NAME as SAFETENSORS_NAME
from fuzz.safetensors_files import exercise_safetensors, safetensors_corpus
from fuzz.safetensors_files import mutated_file as mutated_safetensors
from fuzz.zstd_files import mutated_items, rebuild, write_zstd_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

CHECKPOINTS = ["fsdp2_r2", "fsdp_safetensors_r2", "fsdp_nocoll_r2", "lightning_r2"]
METADATA_CASES = 600
DISTCP_CASES = 250
PLANNER_CASES = 150
ATTRIBUTE_ORDER_CASES = 60
SAFETENSORS_CASES = 300
DEEPSPEED_CASES = 400
DEEPSPEED_SAVES = ["z2-bf16-2r", "z3-bf16-3r", "z1-fp32-2r"]
MEGATRON_CASES = 200
ZSTD_CASES = 60
CASE_TIMEOUT = 30.0


@pytest.fixture(scope="module")
def seeds(fixtures):
    return corpus([fixtures[n] for n in CHECKPOINTS])


def _fuzz(seed_list, examples: int, tmp_path, mutators=None, oracle: bool = False) -> Counter:
    outcomes: Counter = Counter()

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.integers(0, len(seed_list) - 1), st.integers(0, 2**31))
    def check(i: int, case: int) -> None:
        seed = seed_list[i]
        folder = make_case(seed.checkpoint, seed.target, mutated(seed, case, mutators), tmp_path / "case")
        use_oracle = (oracle or seed.target.endswith(".distcp")) and torch_reads(seed.checkpoint)
        out = run_case(folder, CASE_TIMEOUT, oracle=use_oracle)
        outcomes[out.kind] += 1
        assert out.kind not in ("crash", "hang", "memory", "unsound"), \
            f"{seed.checkpoint.name}/{seed.target} #{case}: {out.kind}\n{out.detail}"

    check()
    return outcomes


def test_mutated_metadata_gives_answers_or_clean_errors(seeds, tmp_path):
    meta, _ = seeds
    outcomes = _fuzz(meta, METADATA_CASES, tmp_path)
    assert outcomes["error"] > 0 and outcomes["ok"] + outcomes["problems"] > 0, outcomes  # both paths reached


def test_mutated_distcp_gives_answers_or_clean_errors(seeds, tmp_path):
    _, data = seeds
    outcomes = _fuzz(data, DISTCP_CASES, tmp_path)
    assert outcomes["problems"] > 0, outcomes  # damaged items are found by deep verify


def test_reordered_metadata_reads_as_torch_reads(seeds, tmp_path):
    """Issue 29, item 7: the Metadata pickled again (torch's own classes) with an extra attribute placed first that
    builds the storage keys, values or chunks in another order (or storage_data dropped), torch's own DCP loader
    the oracle: healthy with torch's values where it reads the folder (the same Metadata, other pickle order),
    never healthy where it refuses."""
    meta, _ = seeds
    trusted = [s for s in meta if s.target == ".metadata" and torch_reads(s.checkpoint)]
    outcomes: Counter = Counter()

    @settings(max_examples=ATTRIBUTE_ORDER_CASES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.integers(0, len(trusted) - 1), st.integers(0, 2**31))
    def check(i: int, case: int) -> None:
        seed = trusted[i]
        folder = make_case(seed.checkpoint, seed.target, mutated(seed, case, [metadata_attribute_order]),
                           tmp_path / "case")
        out = run_same_metadata_case(folder, CASE_TIMEOUT)
        outcomes[out.kind] += 1
        assert out.kind not in ("crash", "hang", "memory", "unsound"), \
            f"{seed.checkpoint.name} #{case}: {out.kind}\n{out.detail}"

    check()
    assert outcomes["ok"] > 0 and outcomes["error"] > 0, outcomes


def test_mutated_safetensors_files_read_as_the_library_reads_them(tmp_path):
    """Issue 29, item 8: ``save_file`` outputs with holes, names twice, tails, overlaps and byte damage, the
    safetensors library the oracle: what it refuses is never healthy, what it reads reads the same."""
    seed_list = safetensors_corpus(tmp_path)
    outcomes: Counter = Counter()

    @settings(max_examples=SAFETENSORS_CASES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.integers(0, len(seed_list) - 1), st.integers(0, 2**31))
    def check(i: int, case: int) -> None:
        folder = tmp_path / "case"
        folder.mkdir(exist_ok=True)
        (folder / SAFETENSORS_NAME).write_bytes(mutated_safetensors(seed_list[i], case))
        out = run_case(folder, CASE_TIMEOUT, oracle=True, check=exercise_safetensors)
        outcomes[out.kind] += 1
        assert out.kind not in ("crash", "hang", "memory", "unsound"), f"{seed_list[i].name} #{case}: {out.kind}\n" \
            f"{out.detail}"

    check()
    assert outcomes["ok"] > 0 and outcomes["error"] > 0, outcomes


def test_mutated_zstd_items_give_answers_or_clean_errors(tmp_path):
    """Issue 32, item 1: torch's ZStandard DCP (written here by torch's FileSystemWriter) with one item's archive
    mutated inside its frame, its compressed bytes mutated, or a frame lying about its size (declaring 2**40 bytes
    and more, or holding 64 MiB): the codec's answers or clean errors, memory bounded, torch's loader the oracle."""
    source = write_zstd_checkpoint(tmp_path / "zstd")
    outcomes: Counter = Counter()
    for case in range(ZSTD_CASES):
        folder = rebuild(source, tmp_path / "case", mutated_items(source, case))
        out = run_case(folder, CASE_TIMEOUT, oracle=True)
        outcomes[out.kind] += 1
        assert out.kind not in ("crash", "hang", "memory", "unsound"), f"zstd #{case}: {out.kind}\n{out.detail}"
    assert outcomes["problems"] > 0 and outcomes["ok"] > 0, outcomes  # both decoded and refused items reached


def test_mutated_planner_data_gives_answers_or_clean_errors(seeds, tmp_path):
    """Key paths alone (huge, negative and bool indices, prefixes, dict/list clashes, renamed entries that spell
    them), through the nesting a .pt export builds: a problem or a valid nesting, never a crash or a 10**12 list."""
    meta, _ = seeds
    outcomes = _fuzz(meta, PLANNER_CASES, tmp_path, [planner_paths])
    assert outcomes["problems"] > 0 and outcomes["ok"] > 0, outcomes


def test_mutated_deepspeed_files_give_answers_or_clean_errors(deepspeed_checkpoints, tmp_path):
    """Model and optimizer files of ZeRO-1, 2 and 3 saves, mutated as bytes or through their data.pkl: a
    description (problems allowed) or one CheckpointError of one line; nothing else, no hang, bounded memory."""
    from make_deepspeed_fixtures import TAG

    seeds = deepspeed_corpus([deepspeed_checkpoints[n] / "ckpt" / TAG for n in DEEPSPEED_SAVES])
    outcomes: Counter = Counter()

    @settings(max_examples=DEEPSPEED_CASES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.integers(0, len(seeds) - 1), st.integers(0, 2**31))
    def check(i: int, case: int) -> None:
        seed = seeds[i]
        folder = make_case(seed.folder, seed.target, mutated_file(seed, case), tmp_path / "case")
        out = run_case(folder, CASE_TIMEOUT, check=exercise_deepspeed)
        outcomes[out.kind] += 1
        assert out.kind in ("ok", "problems", "error"), \
            f"{seed.folder}/{seed.target} ({seed.part}) #{case}: {out.kind}\n{out.detail}"
        assert "\n" not in out.detail, out.detail  # one line for the user

    check()
    assert outcomes["error"] > 0 and outcomes["problems"] > 0 and outcomes["ok"] > 0, outcomes


def test_mutated_megatron_files_give_answers_or_clean_errors(megatron_run, tmp_path):
    """A Megatron-Core iter folder with its common.pt (bytes, zip, data.pkl) or metadata.json (bytes, JSON) mutated:
    a description or one one-line CheckpointError; a mutated common.pt never refuses the checkpoint (a problem of
    it: the tensors still read); nothing else, no hang, bounded memory."""
    seeds = megatron_corpus([megatron_run / "iter_0000100"])
    outcomes: Counter = Counter()

    @settings(max_examples=MEGATRON_CASES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.integers(0, len(seeds) - 1), st.integers(0, 2**31))
    def check(i: int, case: int) -> None:
        seed = seeds[i]
        folder = make_case(seed.folder, seed.target, mutated_megatron_file(seed, case), tmp_path / "case")
        out = run_case(folder, CASE_TIMEOUT, check=exercise_megatron)
        outcomes[(seed.target, out.kind)] += 1
        allowed = ("ok", "problems") if seed.target == "common.pt" else ("ok", "problems", "error")
        assert out.kind in allowed, f"{seed.target} ({seed.part}) #{case}: {out.kind}\n{out.detail}"
        assert "\n" not in out.detail, out.detail  # one line for the user

    check()
    assert outcomes[("common.pt", "problems")] > 0 and outcomes[("metadata.json", "error")] > 0, outcomes
    assert outcomes[("metadata.json", "problems")] > 0, outcomes


@pytest.mark.parametrize("n", range(6))
def test_cli_on_mutated_input_exits_cleanly(seeds, tmp_path, n):
    meta, data = seeds
    seed = (meta + data)[(n * 7) % len(meta + data)]
    folder = make_case(seed.checkpoint, seed.target, mutated(seed, 1000 + n), tmp_path / "case")
    command = [("inspect",), ("verify", "--deep"), ("show",)][n % 3]
    args = [*command, folder, "--no-cache"]
    if command == ("show",):
        args.insert(2, "model.blocks.0.fc1.weight")
    proc = run_cli(*args, timeout=120)
    assert proc.returncode in (0, 1, 2), (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(st.data())
def test_coverage_counts_match_a_brute_force_count(data):
    """Gap and overlap element counts of the difference-array coverage equal counting every element."""
    import numpy as np
    from shardscope.backend.checkpoint.layout import coverage
    from shardscope.backend.checkpoint.model import Checkpoint, ChunkTable, TensorEntry

    nd = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=nd, max_size=nd)))
    chunks = []
    for _ in range(data.draw(st.integers(0, 6))):
        lo = [data.draw(st.integers(0, s - 1)) for s in shape]
        chunks.append((lo, [data.draw(st.integers(1, s - a)) for a, s in zip(lo, shape, strict=True)]))
    dims = [v for lo, sz in chunks for v in (*lo, *sz)]
    n = len(chunks)
    table = ChunkTable(np.zeros(n, np.int32), np.full(n, -1, np.int32), np.zeros(n, np.int64),
                       np.zeros(n, np.int64), np.arange(n, dtype=np.int64) * 2 * nd, np.asarray(dims, np.int64))
    ckpt = Checkpoint("x", "dcp", None, [], [], [], table)
    ckpt.tensors = [TensorEntry("t", "float32", shape, 0, n, ckpt)]
    ckpt.reindex()
    count = np.zeros(shape, np.int64)
    for lo, sz in chunks:
        count[tuple(slice(a, a + s) for a, s in zip(lo, sz, strict=True))] += 1
    cov = coverage(ckpt, ckpt.tensors[0])
    assert cov.gap_elements == int((count == 0).sum())
    assert cov.overlap_elements == int(np.maximum(count - 1, 0).sum())
    assert cov.exact == bool((count == 1).all())
