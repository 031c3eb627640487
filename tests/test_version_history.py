"""pipeline/version_history.py: a fragment's retained versions held as links between two full
entries rebuild every version bit for bit, and cost the bytes docs/algorithm.md states."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.checksum import tensor_digest
from pipeline.version_chain import chain_step
from pipeline.version_history import VersionHistory

BLOCK = 64
RETAIN = 16


def _chain(n_versions: int, size: int = 4096, seed: int = 0):
    """Master values drifting like a trained fragment, their published chain and the links."""
    rng = np.random.default_rng(seed)
    theta = {"w": rng.standard_normal((size // 64, 64), dtype=np.float32), "b": rng.standard_normal(7, dtype=np.float32)}
    pub = {n: a.copy() for n, a in theta.items()}
    chain, links = [pub], [None]
    for _ in range(n_versions - 1):
        theta = {n: (a + 0.01 * rng.standard_normal(a.shape, dtype=np.float32)).astype(np.float32)
                 for n, a in theta.items()}
        step = chain_step(theta, chain[-1], BLOCK)
        chain.append(step.published)
        links.append(step.raw)
    return chain, links


def _grow(chain, links, retain=RETAIN, with_links=True) -> VersionHistory:
    h = VersionHistory({0: chain[0]})
    for v in range(1, len(chain)):
        h = h.advanced(v, chain[v], range(v - retain + 1, v), links[v] if with_links else None, BLOCK)
    return h


def test_every_retained_version_is_rebuilt_bit_for_bit():
    chain, links = _chain(40)
    h = _grow(chain, links)
    assert list(h) == list(range(40 - RETAIN, 40))
    assert h.full_versions() == [40 - RETAIN, 39]          # the oldest and the newest only
    for v in h:
        assert tensor_digest(h[v]) == tensor_digest(chain[v]), v
        assert all(not a.flags.writeable for a in h[v].values())
    walked = dict(h.items())                                 # one forward walk gives the same values
    assert [tensor_digest(walked[v]) for v in h] == [tensor_digest(chain[v]) for v in h]
    assert 40 - RETAIN - 1 not in h and 40 not in h and len(h) == RETAIN
    with pytest.raises(KeyError):
        h[40 - RETAIN - 1]


def test_it_holds_two_full_versions_plus_links_not_retain_full_copies():
    chain, links = _chain(40, size=64 * 1024)
    params = sum(a.size for a in chain[0].values())
    compact = _grow(chain, links).nbytes / params
    full = _grow(chain, links, with_links=False).nbytes / params
    assert full == pytest.approx(4 * RETAIN, rel=1e-3)
    # 2 full (8 B) + 15 links (every version but the oldest) of 0.5 B int4 and a float32 scale per 64
    assert compact == pytest.approx(8 + (RETAIN - 1) * 0.5625, rel=1e-3)


def test_a_version_entered_without_a_link_stays_full_and_is_a_new_start():
    chain, links = _chain(12)
    h = _grow(chain[:6], links[:6])
    h = h.advanced(6, chain[6], range(-9, 6))                # recovery's adopted version: no link
    for v in range(7, 12):
        h = h.advanced(v, chain[v], range(v - RETAIN + 1, v), links[v], BLOCK)
    assert h.full_versions() == [0, 6, 11]
    assert [tensor_digest(h[v]) for v in h] == [tensor_digest(c) for c in chain]


def test_a_window_that_starts_at_a_link_rebuilds_its_new_oldest_once():
    chain, links = _chain(10)
    h = _grow(chain, links, retain=3)
    assert list(h) == [7, 8, 9] and h.full_versions() == [7, 9]
    assert tensor_digest(h[8]) == tensor_digest(chain[8])


def test_bad_layouts_are_refused():
    chain, links = _chain(4)
    with pytest.raises(ValueError, match="oldest retained version 1 must be held full"):
        VersionHistory({3: chain[3]}, {1: links[1], 2: links[2]}, BLOCK)
    with pytest.raises(ValueError, match="newest retained version 3 must be held full"):
        VersionHistory({0: chain[0]}, {1: links[1], 3: links[3]}, BLOCK)
    with pytest.raises(ValueError, match="its base, is not retained"):
        VersionHistory({0: chain[0], 3: chain[3]}, {2: links[2]}, BLOCK)
    with pytest.raises(ValueError, match="block size"):
        VersionHistory({0: chain[0], 2: chain[2]}, {1: links[1]})
    h = VersionHistory({0: chain[0]})
    with pytest.raises(ValueError, match="not newer"):
        h.advanced(0, chain[0], range(0, 1))


def test_a_fold_over_an_int4_run_keeps_the_compact_history(tmp_path):
    """The fold's own states: after more merges than retained versions the syncer holds two full
    versions per fragment, and its checkpoint (v3, tests/test_checkpoint_v3.py) is smaller than the
    one a full history writes."""
    from pipeline.state import FragmentState, SyncerState
    chain, links = _chain(30)
    compact = _grow(chain, links)
    full = VersionHistory({v: chain[v] for v in compact})
    zeros = {n: np.zeros_like(a) for n, a in chain[-1].items()}

    def state(h):
        return SyncerState([FragmentState(29, dict(chain[-1]), zeros, h)], [{}], 41, "run")
    assert len(state(compact).to_bytes()) < len(state(full).to_bytes()) / 2.5
    assert isinstance(FragmentState(0, zeros, zeros, {0: chain[0]}).history, VersionHistory)
