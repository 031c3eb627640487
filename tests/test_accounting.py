"""Store accounting (storage/accounting.py) and the price table and cost estimate (workers/tools/cost.py)."""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from storage.accounting import CountingStore, StoreCounters
from storage.errors import AlreadyExists, NotFound
from storage.local import LocalStore
from workers.tools.cost import (DEFAULT_PRICES, GB, MONTH_S, PriceTable, estimate_monthly_cost, load_prices,
                                prices_from_dict)


def test_counts_and_bytes_are_exact_for_a_sequence_of_local_operations(tmp_path):
    store = CountingStore(LocalStore(str(tmp_path / "run")))
    store.put_if_absent("log/0001", b"a" * 100)
    with pytest.raises(AlreadyExists):
        store.put_if_absent("log/0001", b"b" * 7)          # refused: a request, no bytes
    store.put("hints/latest", b"c" * 10)
    store.put("hints/latest", b"d" * 12)
    assert store.get("log/0001") == b"a" * 100
    with pytest.raises(NotFound):
        store.get("log/missing")
    assert store.head("hints/latest").size == 12
    assert store.exists("log/0001") and not store.exists("log/0002")
    assert store.list("log/") == ["log/0001"]
    assert store.list("nothing/") == []                     # an empty listing is still one request
    assert store.list("log/", limit=0) == []                # no request at all
    store.delete("hints/latest")
    store.delete("hints/latest")                            # missing: no error, still a request

    assert store.snapshot() == StoreCounters(put=2, put_if_absent=2, get=2, head=3, list=2, delete=2, failed=2,
                                             bytes_written=122, bytes_read=100)
    assert store.snapshot().requests == 13
    assert store.uri == store.inner.uri


def test_listing_counts_one_request_per_page(tmp_path):
    inner = LocalStore(str(tmp_path / "run"))
    for i in range(5):
        inner.put(f"d/{i}", b"")
    inner.page_size = 2                                     # as S3Store exposes it
    store = CountingStore(inner)
    assert len(store.list("d/")) == 5                       # pages of 2, 2, 1
    assert len(store.list("d/", limit=4)) == 4              # pages of 2, 2
    assert store.snapshot().list == 5


def test_multipart_writes_count_their_parts():
    class Fake:                                             # an S3Store-like store that records nothing
        uri = "fake://"
        transfer = SimpleNamespace(multipart_threshold=10, multipart_chunksize=4)

        def put(self, key, data): pass
        def put_if_absent(self, key, data): pass
        def get(self, key): return b""
        def head(self, key): raise NotFound("no", key=key)
        def exists(self, key): return False
        def list(self, prefix="", start_after=None, limit=None): return []
        def delete(self, key): pass

    store = CountingStore(Fake())
    store.put("small", b"x" * 10)                           # at the threshold: one PutObject
    store.put_if_absent("big", b"x" * 11)                   # 3 parts + initiate + complete = 5 requests
    counts = store.snapshot()
    assert (counts.put, counts.put_if_absent, counts.multipart_puts, counts.requests) == (1, 1, 4, 6)
    assert counts.bytes_written == 21


def test_counting_is_thread_safe_and_snapshots_subtract(tmp_path):
    store = CountingStore(LocalStore(str(tmp_path / "run")))
    store.put("k", b"12345")
    before = store.snapshot()

    def reader() -> None:
        for _ in range(200):
            store.get("k")

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    step = store.snapshot() - before
    assert step == StoreCounters(get=800, bytes_read=4000)
    assert before + step == store.snapshot()


def test_the_wrapper_refuses_what_is_not_a_store():
    with pytest.raises(TypeError, match="ObjectStore"):
        CountingStore(object())


# -- prices and the estimate -----------------------------------------------------------------------

def test_the_default_table_is_s3_standard_us_east_1_and_names_its_source():
    p = DEFAULT_PRICES
    assert (p.put_per_1000, p.get_per_1000, p.delete_per_1000) == (0.005, 0.0004, 0.0)
    assert (p.inter_region_per_gb, p.storage_per_gb_month) == (0.02, 0.023)
    assert "aws.amazon.com/s3/pricing" in p.source and "us-east-1" in p.source


def test_cost_estimate_arithmetic():
    counters = StoreCounters(put=600, put_if_absent=300, multipart_puts=50, list=50, get=4000, head=1000,
                             delete=10)
    hour = 3600.0
    est = estimate_monthly_cost(counters, hour, cross_region_bytes=3 * GB, stored_bytes=10 * GB)
    assert est.scale == pytest.approx(720.0)                            # hours in a 30-day month
    assert est.put_requests_usd == pytest.approx(1000 / 1000 * 0.005 * 720)     # 3.60
    assert est.get_requests_usd == pytest.approx(5000 / 1000 * 0.0004 * 720)    # 1.44
    assert est.delete_requests_usd == 0.0
    assert est.transfer_usd == pytest.approx(3 * 0.02 * 720)                      # 43.20
    assert est.storage_usd == pytest.approx(10 * 0.023)                           # not scaled: 0.23
    assert est.total_usd == pytest.approx(3.60 + 1.44 + 43.20 + 0.23)
    # a month measured over a month is the counters themselves
    month = estimate_monthly_cost(StoreCounters(get=1000), MONTH_S)
    assert month.scale == 1.0 and month.total_usd == pytest.approx(0.0004)


def test_cost_estimate_refuses_bad_arguments():
    for duration in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="duration_s"):
            estimate_monthly_cost(StoreCounters(), duration)
    with pytest.raises(ValueError, match="cross_region_bytes"):
        estimate_monthly_cost(StoreCounters(), 1.0, cross_region_bytes=-1)
    with pytest.raises(ValueError, match="counters"):
        estimate_monthly_cost({"get": 1}, 1.0)


def test_prices_are_overridable_from_a_json_file(tmp_path):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"inter_region_per_gb": 0.09, "get_per_1000": 0.001}))
    table = load_prices(path)
    assert table.inter_region_per_gb == 0.09 and table.get_per_1000 == 0.001
    assert table.put_per_1000 == DEFAULT_PRICES.put_per_1000
    assert str(path) in table.source
    est = estimate_monthly_cost(StoreCounters(), MONTH_S, table, cross_region_bytes=GB)
    assert est.transfer_usd == pytest.approx(0.09)


@pytest.mark.parametrize("content, match", [
    ('{"egress_per_gb": 0.09}', "unknown price field.*'egress_per_gb'"),
    ('{"put_per_1000": -1}', "put_per_1000 must be >= 0"),
    ('{"put_per_1000": "cheap"}', "put_per_1000 must be a finite number"),
    ('[0.005]', "JSON object"),
    ('{not json', "not valid JSON"),
])
def test_bad_price_files_are_refused_by_name(tmp_path, content, match):
    path = tmp_path / "prices.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_prices(path)


def test_price_table_validates_eagerly():
    with pytest.raises(ValueError, match="storage_per_gb_month"):
        PriceTable(storage_per_gb_month=float("nan"))
    with pytest.raises(ValueError, match="unknown price field"):
        prices_from_dict({"bogus": 1})
    with pytest.raises(ValueError, match="cannot read the price file"):
        load_prices("/nonexistent/prices.json")


def test_the_wrapper_shows_where_its_store_is_but_forwards_no_uncounted_calls(tmp_path):
    inner = LocalStore(str(tmp_path / "run"))
    store = CountingStore(inner)
    assert store.root == inner.root                           # storage/regions.py locates stores by these
    assert not hasattr(store, "endpoint")                     # a LocalStore has none: neither has its wrapper
    inner.get_range = lambda key, start, end: b""             # a method the wrapper does not count
    with pytest.raises(AttributeError, match="get_range"):
        store.get_range("k", 0, 1)
