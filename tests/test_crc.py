"""CRC32 arithmetic (backend/crc.py): combining the CRCs of pieces like zlib over the whole, and the combine
table used from many writer threads at once."""

from __future__ import annotations

import os

import torch


def test_crc32_combine_table_is_whole_before_any_thread_uses_it():
    """The table behind crc32_combine, once grown lazily by writer threads at once, held an operator twice
    (an upload then refused as damaged, 1 run in 5). It is built whole at import and cannot change, so the
    race cannot happen; checked without depending on thread timing, then used from 8 threads at once."""
    import threading
    import zlib

    from shardscope.backend import crc

    assert isinstance(crc._ZERO_BYTES_OPS, tuple) and len(crc._ZERO_BYTES_OPS) == 64
    assert all(isinstance(op, tuple) and len(op) == 32 for op in crc._ZERO_BYTES_OPS)
    a, b = os.urandom(1000), os.urandom((16 << 20) + 12345)
    want, ca, cb = zlib.crc32(a + b), zlib.crc32(a), zlib.crc32(b)
    gate, got = threading.Barrier(8), []

    def work() -> None:
        gate.wait()
        got.append(crc.crc32_combine(ca, cb, len(b)))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want] * 8


def test_crc32_of_pieces_combines_like_zlib():
    import zlib

    from shardscope.backend.crc import crc32_combine

    gen = torch.Generator().manual_seed(1)
    for a_len, b_len in ((0, 5), (3, 0), (1, 1), (1000, 12345), (17, 1 << 20)):
        a = bytes(torch.randint(0, 256, (a_len,), generator=gen, dtype=torch.uint8).tolist())
        b = bytes(torch.randint(0, 256, (b_len,), generator=gen, dtype=torch.uint8).tolist())
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
