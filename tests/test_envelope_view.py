"""envelope.unseal_view: the body as a view of the blob, with unseal's result and errors for any input."""
import random

import pytest

from pipeline import envelope
from pipeline.errors import FormatError


def _outcome(fn, blob, checksums):
    try:
        version, body = fn(blob, "k", (1, 3), checksums=checksums)
        return "ok", version, bytes(body)
    except FormatError as exc:
        return "error", str(exc)


@pytest.mark.parametrize("checksum,version", [("xxh3-128", 3), ("sha256", 1)])
def test_unseal_view_agrees_with_unseal_on_damaged_blobs(checksum, version):
    checksums = {3: "xxh3-128"}
    blob = envelope.seal("k", version, bytes(range(256)) * 300, checksum)
    version_got, view = envelope.unseal_view(blob, "k", (1, 3), checksums=checksums)
    assert version_got == version and isinstance(view, memoryview) and bytes(view) == bytes(range(256)) * 300
    rng = random.Random(version)
    for _ in range(1500):
        m = bytearray(blob if rng.random() < 0.5 else blob[:64])
        for _ in range(rng.randint(0, 3)):
            m[rng.randrange(len(m))] = rng.randrange(256)
        if rng.random() < 0.2:
            m = m[:rng.randrange(len(m) + 1)]
        if rng.random() < 0.1:
            m += b"\x00"
        assert _outcome(envelope.unseal_view, bytes(m), checksums) == _outcome(envelope.unseal, bytes(m), checksums)
