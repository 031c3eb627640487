"""Traffic accounting end to end in one process (issue 14): the bus counters (workers/bus/bus.py),
the learner's and syncer's ``accounting`` events (workers/common/traffic.py), the report that sums
them (workers/tools/accounting.py) with its cost estimate against a hand calculation, and refused
price tables (workers/tools/cost.py) through `ddiloco run` and `ddiloco log`."""
from __future__ import annotations

import io
import json
import time
from types import SimpleNamespace

import pytest
import torch

from runhelpers import Recorder
from storage.accounting import CountingStore
from storage.local import LocalStore
from storage.store import open_store
from workers import cli
from workers.bus.bus import AnnounceListener, BusConfig, BusCounters, LearnerLink, Message, SyncerBus, encode_message
from workers.common.traffic import SyncerTraffic, TrafficMeter
from workers.launch import RunSettings, Schedule, create_run
from workers.learner.learner import Learner, LearnerConfig
from workers.tools.accounting import traffic_report
from workers.tools.cost import GB, MONTH_S, dp_allreduce_bytes, load_prices, parse_prices
from workers.tools.logview import log_command


def _size(msg: Message) -> int:
    return sum(len(f) for f in encode_message(msg))


def _wait(recv, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = recv(0.1)
        if got is not None:
            return got
    raise AssertionError("no message")


def test_bus_sockets_count_every_message_and_frame_byte_both_ways():
    mine, theirs = BusCounters(), BusCounters()
    syncer = SyncerBus(BusConfig("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", counters=theirs))
    cfg = BusConfig(syncer.ingest_endpoint, syncer.announce_endpoint, counters=mine)
    link, listener = LearnerLink(cfg, b"l0"), AnnounceListener(cfg)
    try:
        delta = Message("delta", {"delta": "l0/1/0"}, blob=b"x" * 1000)
        deadline = time.monotonic() + 5
        while not link.send(delta):              # IMMEDIATE: refused (and not counted) until connected
            assert time.monotonic() < deadline
            time.sleep(0.02)
        ident, got = _wait(syncer.recv)
        ack = Message("ack", {"delta": "l0/1/0"})
        syncer.send_to(ident, ack)
        assert _wait(link.recv).type == "ack"
        version = Message("version", {"fragment": 0, "version": 1})
        deadline = time.monotonic() + 5
        heard = None
        while heard is None and time.monotonic() < deadline:   # a SUB joins late: announce until heard
            syncer.announce(version)
            heard = listener.recv(0.1)
        announced = theirs.snapshot()["sent_msgs"] - 1          # every announce counts, heard or not
    finally:
        link.close()
        listener.close()
        syncer.close()
    assert got.blob == delta.blob
    assert mine.snapshot() == {"sent_msgs": 1, "sent_bytes": _size(delta),
                               "recv_msgs": 2, "recv_bytes": _size(ack) + _size(version)}
    assert theirs.snapshot() == {"sent_msgs": 1 + announced, "sent_bytes": _size(ack) + announced * _size(version),
                                 "recv_msgs": 1, "recv_bytes": _size(delta)}     # the routing id is not traffic


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def test_a_learner_reports_every_outer_step_and_its_last_report_is_its_store_counters(tmp_path):
    store = open_store(str(tmp_path / "run"))
    model = tiny_model()
    create_run(store, {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
               RunSettings(schedule=Schedule(fragments=2, sync_every=4)))
    events = Recorder()
    learner = Learner(model, torch.optim.AdamW(model.parameters(), lr=1e-3), store, "l0",
                      LearnerConfig(poll_s=0.02, drain_s=5), events=events).start()
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    for _ in range(10):
        learner.step(lambda: torch.nn.functional.mse_loss(model(x), y), tokens=16)
    learner.close()
    reports = events.named("accounting")
    assert [(r["step"], r["outer_step"], r["final"]) for r in reports] == [(4, 1, False), (8, 2, False),
                                                                             (10, 2, True)]
    assert isinstance(learner.store, CountingStore)
    last = reports[-1]
    assert (last["format"], last["region"], last["home"], last["bus"]) == (1, "home", "home", None)
    assert last["stores"] == {"home": learner.store.snapshot().as_dict()}     # nothing after the last report
    assert last["stores"]["home"]["get"] > 0 and last["stores"]["home"]["put_if_absent"] >= 1   # versions, its claim
    firsts = [r["stores"]["home"]["get"] for r in reports]
    assert firsts == sorted(firsts)                                             # cumulative


def test_the_syncer_listener_reports_every_p_merges_and_at_stop(tmp_path):
    counted = CountingStore(LocalStore(str(tmp_path / "s")))
    events = Recorder()
    now = [0.0]
    meter = TrafficMeter(events, "r0", "r0", {"r0": counted}, BusCounters(), clock=lambda: now[0])
    listen = SyncerTraffic(meter, fragments=2, state=lambda: {"life": 3, "commits": 7}, every_s=10.0,
                           clock=lambda: now[0])
    for kind in ("merge", "drop", "merge", "merge"):
        listen({"event": "commit", "kind": kind})
    now[0] = 11.0
    listen({"event": "commit", "kind": "drop"})           # 10 s since the last report
    counted.put("k", b"12345")
    listen({"event": "syncer-stop"})
    reports = events.named("accounting")
    assert [(r["final"], r["elapsed_s"]) for r in reports] == [(False, 0.0), (False, 11.0), (True, 11.0)]
    assert reports[-1]["stores"]["r0"]["bytes_written"] == 5 and reports[-1]["life"] == 3


def _ev(t, role, ident, life, region, elapsed, stores, bus=None, home="r0", **kw):
    return {"t": t, "role": role, "id": ident, "event": "accounting", "format": 1, "life": life, "region": region,
            "home": home, "elapsed_s": elapsed, "stores": stores, "bus": bus, **kw}


def _bus(sent, recv):
    return {"peer": "r0", "sent_msgs": 1, "sent_bytes": sent, "recv_msgs": 1, "recv_bytes": recv}


EVENTS = [
    _ev(10, "learner", "a", 1, "r0", 10, {"r0": dict(put_if_absent=10, get=20, list=5, bytes_written=1000,
                                                     bytes_read=5000)}, _bus(300, 700), step=4, outer_step=1,
        final=False),
    _ev(20, "learner", "a", 1, "r0", 20, {"r0": dict(put_if_absent=18, get=30, list=9, head=2, bytes_written=2000,
                                                     bytes_read=9000)}, _bus(600, 1200), step=10, outer_step=2,
        final=True),
    _ev(20, "learner", "b", 1, "r1", 15, {"r1": dict(put=4, get=10, list=2, bytes_written=400, bytes_read=4000)},
        _bus(1000, 2000), step=8, outer_step=2, final=True),
    _ev(20, "syncer", "syncer", 0, "r0", 20, {"r0": dict(put=50, get=40, delete=5, bytes_written=10000,
                                                         bytes_read=3000),
                                              "r1": dict(put=6, put_if_absent=4, list=10, get=3, head=3, delete=3,
                                                         bytes_written=5000, bytes_read=400)},
        _bus(9, 9), commits=12, final=True),
    {"t": 5, "role": "learner", "id": "a", "event": "step", "step": 4},        # other events are ignored
]


def test_the_report_sums_regions_links_learners_and_outer_steps():
    rep = traffic_report(EVENTS, params=1000, sync_every=4)
    r0, r1 = rep["regions"]["r0"], rep["regions"]["r1"]
    assert r0["by_kind"] == dict(put=50, put_if_absent=18, multipart_puts=0, get=70, head=2, list=9, delete=5,
                                 failed=0, bytes_written=12000, bytes_read=12000)
    assert (r1["put_class"], r1["get_class"], r1["delete"], r1["bytes_written"], r1["bytes_read"]) == \
        (10 + 4 + 12, 13 + 3, 3, 5400, 4400)
    links = rep["links"]
    assert (links["r0->r1"]["store_bytes"], links["r0->r1"]["bus_bytes"]) == (5000, 2000)   # replication; b's downlink
    assert (links["r1->r0"]["store_bytes"], links["r1->r0"]["bus_bytes"]) == (400, 1000)    # ingest; b's uplink
    assert links["r0->r0"]["cross_region"] is False and links["r1->r1"]["store_bytes"] == 4400
    assert rep["totals"]["cross_region_bytes"] == 7000 + 1400
    a = rep["learners"]["a"]
    assert [(s["outer_step"], s["steps"], s["requests"], s["bytes_up"], s["bytes_down"]) for s in a["per_outer_step"]] \
        == [(1, 4, 35, 1300, 5700), (2, 6, 24, 1300, 4500)]
    assert a["mean_per_outer_step"]["bytes_up"] == 1300 and a["outer_steps"] == 2
    b = rep["learners"]["b"]
    assert b["cross_region_bytes"] == 3000 and b["per_outer_step"][0]["cross_region_bytes"] == 3000
    assert b["mean_per_outer_step"] is None                      # only a final (partial) report
    assert rep["span_s"] == 20.0                                  # the syncer's meter started at t=0
    dp = rep["data_parallel"]
    assert dp["dp_per_learner_per_step"] == {"bf16": 2 * 1 * 1000 * 2 // 2, "fp32": 2 * 1 * 1000 * 4 // 2}
    assert dp["decoupled_per_learner_per_step"]["bytes_up"] == round((2600 + 1400) / 18, 1)
    assert dp["decoupled_per_learner_per_step"]["cross_region_bytes"] == round((7000 + 1400) / 18, 1)  # syncer's too
    assert dp["dp_over_decoupled_cross_region"]["bf16"] == round(2000 / round(8400 / 18, 1), 1)
    assert dp["dp_per_learner_per_outer_step"]["fp32"] == 4000 * 4


def test_the_cost_matches_a_hand_calculation_from_a_small_price_file(tmp_path):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"put_per_1000": 1.0, "get_per_1000": 0.1, "delete_per_1000": 0.5,
                                "inter_region_per_gb": 7.0, "inter_region_per_gb_from": {"r0": 2.0, "r1": 4.0},
                                "source": "a test table"}))
    cost = traffic_report(EVENTS, prices=load_prices(path))["cost"]
    month = MONTH_S / 20                                          # 20 s accounted
    put_class = (50 + 4 + 6) + (18 + 4) + (9 + 2 + 10)            # PUT + conditional PUT + LIST
    get_class = (30 + 10 + 40 + 3) + (2 + 3)                      # GET + HEAD
    assert cost["put_requests_usd"] == pytest.approx(put_class / 1000 * 1.0 * month, abs=1e-4)
    assert cost["get_requests_usd"] == pytest.approx(get_class / 1000 * 0.1 * month, abs=1e-4)
    assert cost["delete_requests_usd"] == pytest.approx(8 / 1000 * 0.5 * month, abs=1e-4)
    assert cost["transfer_usd"] == pytest.approx((7000 * 2.0 + 1400 * 4.0) / GB * month, abs=1e-4)  # by source
    assert cost["monthly_usd"] == pytest.approx(13348.8 + 1140.48 + 518.4 + 2.3657, abs=1e-3)
    assert cost["unverified"] is False and cost["prices"]["source"] == "a test table"
    assert traffic_report(EVENTS)["cost"]["unverified"] is True            # the built-in table says so


def test_no_accounting_is_none_and_another_format_is_refused():
    assert traffic_report([{"t": 1, "role": "learner", "id": "a", "event": "step"}]) is None
    with pytest.raises(ValueError, match="format 2"):
        traffic_report([{**EVENTS[0], "format": 2}])


def test_dp_allreduce_formula():
    assert dp_allreduce_bytes(1_000_000, 4, "bf16") == 2 * 3 * 1_000_000 * 2 // 4     # 3 MB
    assert dp_allreduce_bytes(1_000_000, 1, "fp32") == 0
    with pytest.raises(ValueError, match="dtype"):
        dp_allreduce_bytes(10, 2, "int4")
    with pytest.raises(ValueError, match="learners"):
        dp_allreduce_bytes(10, 0)


@pytest.mark.parametrize("spec, match", [
    ('{"inter_region_per_gb_from": {"r1": -0.5}}', r"inter_region_per_gb_from\['r1'\] must be >= 0"),
    ('{"inter_region_per_gb_from": [0.09]}', "inter_region_per_gb_from must map region names"),
    ('{"get_per_1000": null}', "get_per_1000 must be a finite number"),
    ('{"egress": 1}', "unknown price field.*'egress'"),
    ('{oops', "--prices is not valid JSON"),
])
def test_bad_inline_prices_are_refused_by_field(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_prices(spec)


def test_ddiloco_run_refuses_a_bad_price_file_before_starting_anything(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text('{"delete_per_1000": "free"}')
    rc = cli.main(["run", "--prices", str(path), "--out", str(tmp_path / "out"), "--plain"])
    err = capsys.readouterr().err
    assert rc != 0 and "delete_per_1000 must be a finite number" in err and str(path) in err
    assert not (tmp_path / "out" / "store").exists()


def test_ddiloco_log_accounting_is_opt_in_and_refuses_bad_prices_or_events(tmp_path):
    store = open_store(str(tmp_path / "run"))
    model = tiny_model()
    create_run(store, {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
               RunSettings(schedule=Schedule(fragments=2, sync_every=4)))
    base = dict(run_uri=str(tmp_path / "run"), s3_endpoint=None, fragment=None, learner=None, start=0, end=None,
                json=False, accounting=False)
    for extra, match in (({"prices": '{"put_per_1000": -1}', "events": None}, "put_per_1000 must be >= 0"),
                         ({"prices": None, "events": str(tmp_path / "nope")}, "not a directory")):
        out, err = io.StringIO(), io.StringIO()
        assert log_command(SimpleNamespace(**base, **extra), out, err) == 2
        assert match in err.getvalue()
    out, err = io.StringIO(), io.StringIO()           # asked for, and no logs next to the run
    assert log_command(SimpleNamespace(**{**base, "accounting": True}, prices=None, events=None), out, err) == 2
    assert "no event logs found" in err.getvalue()
    events = tmp_path / "logs"
    events.mkdir()
    out, err = io.StringIO(), io.StringIO()           # not asked for: the totals stay the last line
    assert log_command(SimpleNamespace(**{**base, "json": True}, prices=None, events=None), out, err) == 0
    assert json.loads(out.getvalue().splitlines()[-1])["type"] == "totals"
    (events / "l0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
    out, err = io.StringIO(), io.StringIO()
    assert log_command(SimpleNamespace(**{**base, "json": True}, prices=None, events=str(events)), out, err) == 0
    last = json.loads(out.getvalue().splitlines()[-1])
    params = sum(p.numel() for p in model.parameters())
    expected = traffic_report(EVENTS, params=params, sync_every=4)
    assert last == {"type": "accounting", "events": str(events), **json.loads(json.dumps(expected))}
    assert last["totals"]["cross_region_bytes"] == 8400 and last["data_parallel"]["params"] == params


def test_infra_prices_is_a_thin_re_export():
    import infra.prices
    import workers.tools.cost
    assert infra.prices.PriceTable is workers.tools.cost.PriceTable
    assert infra.prices.estimate_monthly_cost is workers.tools.cost.estimate_monthly_cost
