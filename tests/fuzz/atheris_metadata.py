"""Coverage-guided fuzzing of the ``.metadata`` reader with atheris (libFuzzer), seeded with real files.

    python tests/fuzz/atheris_metadata.py FIXTURES_DIR [libFuzzer options, e.g. -runs=20000 -max_len=400000]

Each input is written as the ``.metadata`` of a copy of a real checkpoint (hard links to its ``.distcp``
files) and opened, verified deep and read; anything but a ShardscopeError escaping is a finding. The
mutator mixes libFuzzer's byte mutations with the pickle-aware ones of :mod:`fuzz.mutators`.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import atheris  # noqa: E402

with atheris.instrument_imports():
    from shardscope.backend.errors import ShardscopeError

    from fuzz.harness import exercise, make_case
    from fuzz.mutators import METADATA_MUTATORS, mutate

SOURCE: Path | None = None
WORK = Path(tempfile.mkdtemp(prefix="atheris-metadata-"))


def test_one_input(data: bytes) -> None:
    """One libFuzzer input: the bytes of a ``.metadata``."""
    assert SOURCE is not None
    folder = make_case(SOURCE, ".metadata", data, WORK / "case")
    try:
        exercise(folder)
    except ShardscopeError:
        pass


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    """Half libFuzzer's own byte mutations, half the pickle-aware ones."""
    rng = random.Random(seed)
    if rng.random() < 0.5 or not data:
        return atheris.Mutate(data, max_size)
    return mutate(data, rng, METADATA_MUTATORS)[:max_size]


def main() -> None:
    global SOURCE
    fixtures = Path(sys.argv[1])
    SOURCE = fixtures / "fsdp2_r2"
    corpus = WORK / "corpus"
    corpus.mkdir()
    for name in ("fsdp2_r2", "ddp_r2", "lightning_r2", "nopg"):
        (corpus / name).write_bytes((fixtures / name / ".metadata").read_bytes())
    atheris.Setup([sys.argv[0], str(corpus), *sys.argv[2:]], test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
