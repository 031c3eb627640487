"""Prometheus metrics (issue 17): events become the documented counters, gauges and histograms; the
endpoint binds loopback on a free port with a registry of its own; and on a real run (syncer and
two learners with ``--metrics-port 0``) the counters move between two scrapes, and the syncer's
commits and merged/dropped deltas agree with ``ddiloco log --json`` for the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from storage.accounting import CountingStore
from storage.store import open_store
from workers.tools import logview
from workers.commands import configure_learner, configure_syncer
from workers.common.events import EventLog
from workers.common.metrics import Metrics, start_metrics

from runhelpers import TinyRun

pytestmark = pytest.mark.timeout(240)


def scrape(url: str) -> dict[tuple, float]:
    """{(sample name, sorted label items): value} of one scrape."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def poll(what: str, fn, timeout: float = 60.0, every: float = 0.2):
    """fn() until it returns something truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


# -- events -> metrics (one process, synthetic events) --------------------------------------------

def test_syncer_events_become_metrics():
    m = Metrics("syncer", "s0", "run-1")
    get = m.registry.get_sample_value
    m.observe({"event": "commit", "t": 1.0, "seq": 3, "kind": "merge", "fragment": 1, "version": 1,
               "inputs": ["l0/0/1", "l1/0/1"], "staleness": [0, 2], "dropped": [], "quorum": 2, "grace_s": 0.04,
               "sync_s": 0.02})
    m.observe({"event": "commit", "t": 2.0, "seq": 4, "kind": "drop", "fragment": 0, "version": 0, "inputs": [],
               "staleness": [], "dropped": [["l0/0/2", "too-stale: 6 > 4"], ["l1/0/2", "superseded"]], "quorum": 0,
               "grace_s": 0.0, "sync_s": 0.01})
    m.observe({"event": "delta-rejected", "t": 2.5, "delta": "x", "reason": "bad-signature"})
    m.observe({"event": "store-error", "t": 3.0, "op": "commit", "error": "down"})
    assert get("ddiloco_syncer_commits_total", {"kind": "merge"}) == 1
    assert get("ddiloco_syncer_commits_total", {"kind": "drop"}) == 1
    assert get("ddiloco_syncer_deltas_merged_total") == 2
    assert get("ddiloco_syncer_deltas_dropped_total", {"reason": "too-stale"}) == 1
    assert get("ddiloco_syncer_deltas_dropped_total", {"reason": "superseded"}) == 1
    assert get("ddiloco_syncer_deltas_rejected_total", {"reason": "bad-signature"}) == 1
    assert get("ddiloco_syncer_round_size_count") == 1 and get("ddiloco_syncer_round_size_sum") == 2
    assert get("ddiloco_syncer_grace_wait_seconds_sum") == pytest.approx(0.04)
    assert get("ddiloco_syncer_input_staleness_count", {"fragment": "1"}) == 2
    assert get("ddiloco_syncer_input_staleness_bucket", {"fragment": "1", "le": "1.0"}) == 1
    assert get("ddiloco_syncer_last_commit_seq") == 4
    assert get("ddiloco_store_errors_total", {"op": "commit"}) == 1
    assert get("ddiloco_info", {"role": "syncer", "id": "s0", "run_id": "run-1"}) == 1
    assert get("ddiloco_events_total", {"event": "commit"}) == 2


def test_learner_events_become_metrics():
    m = Metrics("learner", "l0")
    get = m.registry.get_sample_value
    m.observe({"event": "learner-start", "t": 0.0, "versions": {"0": 3, "1": 2}})
    m.observe({"event": "step", "t": 10.0, "step": 10, "tokens": 1000, "loss": 4.0, "step_time_s": 0.1,
               "versions": {"0": 3, "1": 2}, "bytes_sent": 500})
    m.observe({"event": "step", "t": 12.0, "step": 20, "tokens": 2000, "loss": 3.5, "step_time_s": 0.2,
               "versions": {"0": 4, "1": 2}, "bytes_sent": 800})
    assert get("ddiloco_learner_steps_total") == 20 and get("ddiloco_learner_tokens_total") == 2000
    assert get("ddiloco_learner_tokens_per_second") == 500.0          # 1000 tokens in 2 s
    assert get("ddiloco_learner_delta_bytes_total") == 800 and get("ddiloco_learner_loss") == 3.5
    assert get("ddiloco_learner_fragment_version", {"fragment": "0"}) == 4
    m.observe({"event": "version-applied", "t": 12.5, "fragment": 1, "version": 3, "latency_s": 0.07})
    assert get("ddiloco_learner_fragment_version", {"fragment": "1"}) == 3
    assert get("ddiloco_learner_version_latency_seconds_count") == 1
    # The backlog: submitted deltas not yet acked, spilled or otherwise ended.
    for d in ("a", "b", "c", "d"):
        m.observe({"event": "delta", "t": 13.0, "delta": d})
    m.observe({"event": "delta-acked", "t": 13.1, "delta": "a"})
    m.observe({"event": "delta-spilled", "t": 13.2, "delta": "b", "bytes": 100})
    m.observe({"event": "delta-superseded", "t": 13.3, "delta": "c"})
    assert get("ddiloco_learner_undelivered_deltas") == 1
    assert get("ddiloco_learner_deltas_total", {"outcome": "submitted"}) == 4
    assert get("ddiloco_learner_deltas_total", {"outcome": "spilled"}) == 1
    assert get("ddiloco_learner_spilled_bytes_total") == 100
    # Spill failures: the sender reports the 1st, 2nd, 4th ... of a streak and the count at recovery.
    for n in (1, 2, 4):
        m.observe({"event": "spill-failed", "t": 14.0, "delta": "d", "consecutive": n})
    assert get("ddiloco_learner_spill_failures_total") == 4
    m.observe({"event": "spill-recovered", "t": 15.0, "after_failures": 6})
    assert get("ddiloco_learner_spill_failures_total") == 6
    # A new life (a restarted Learner in the same process) counts on from its own zero.
    m.observe({"event": "learner-start", "t": 20.0, "versions": {"0": 5}})
    m.observe({"event": "step", "t": 21.0, "step": 10, "tokens": 300, "bytes_sent": 0})
    assert get("ddiloco_learner_steps_total") == 30 and get("ddiloco_learner_tokens_total") == 2300


def test_a_malformed_event_is_counted_never_raised():
    events = EventLog(None, "learner", "l0")
    m = Metrics("learner", "l0")
    events.subscribe(m.observe)
    events.emit("step", step=10)                       # no tokens: cannot be read
    assert m.registry.get_sample_value("ddiloco_metrics_errors_total") == 1
    assert "step" in m.last_error and "tokens" in m.last_error
    with pytest.raises(ValueError, match="role"):
        Metrics("dashboard", "x")


# -- the endpoint -----------------------------------------------------------------------------------

def test_two_endpoints_in_one_process_bind_loopback_free_ports_and_stay_apart():
    a, b = Metrics("learner", "l0"), Metrics("learner", "l1")
    try:
        ua, ub = a.serve(port=0), b.serve(port=0)
        assert ua.startswith("http://127.0.0.1:") and ua.endswith("/metrics") and a.port != b.port > 0
        a.observe({"event": "step", "t": 1.0, "step": 5, "tokens": 50})
        sa, sb = scrape(ua), scrape(ub)
        assert value(sa, "ddiloco_info", role="learner", id="l0", run_id="") == 1
        assert value(sb, "ddiloco_info", role="learner", id="l1", run_id="") == 1
        assert value(sa, "ddiloco_learner_tokens_total") == 50 and value(sb, "ddiloco_learner_tokens_total") == 0
    finally:
        a.close()
        b.close()
    with pytest.raises(urllib.error.URLError):
        scrape(ua)


def test_a_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        m = Metrics("syncer", "s")
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{s.getsockname()[1]}.*--metrics-port"):
            m.serve("127.0.0.1", s.getsockname()[1])
    with pytest.raises(ValueError, match="0..65535"):
        Metrics("syncer", "s").serve(port=70000)


def test_flags_are_off_by_default_and_loopback(tmp_path):
    for configure in (configure_syncer, configure_learner):
        parser = argparse.ArgumentParser()
        configure(parser)
        args = parser.parse_args(["--store", "x", "--id", "l0"])
        assert args.metrics_port is None and args.metrics_host == "127.0.0.1"
    store = open_store(str(tmp_path / "s"))
    assert start_metrics(args, EventLog(None, "learner", "l0"), "learner", "l0", store) == (store, None)


def test_store_traffic_is_scraped(tmp_path):
    m = Metrics("learner", "l0")
    store = CountingStore(open_store(str(tmp_path / "s")))
    m.watch_store(store)
    store.put("a", b"12345")
    store.get("a")
    try:
        s = scrape(m.serve())
    finally:
        m.close()
    assert value(s, "ddiloco_store_bytes_total", direction="written") == 5
    assert value(s, "ddiloco_store_bytes_total", direction="read") == 5
    assert value(s, "ddiloco_store_requests_total", kind="put") == 1


def test_the_grafana_dashboard_uses_only_metrics_that_exist(tmp_path):
    """infra/grafana/ddiloco.json: valid JSON whose queries name only metrics the two roles expose."""
    from pathlib import Path
    from types import SimpleNamespace
    from prometheus_client import generate_latest
    dash = json.loads((Path(__file__).parent.parent / "infra" / "grafana" / "ddiloco.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20 and dash["uid"] == "ddiloco"
    exposed = set()
    fake_syncer = SimpleNamespace(pending=[{}, {}], state=SimpleNamespace(
        last_seq=3, fragments=[SimpleNamespace(version=1), SimpleNamespace(version=2)]))
    for role in ("syncer", "learner"):
        m = Metrics(role, "x")
        m.watch_store(CountingStore(open_store(str(tmp_path / role))))
        if role == "syncer":
            m.watch_syncer(fake_syncer)
        for line in generate_latest(m.registry).decode().splitlines():
            if line.startswith("# TYPE "):
                name, kind = line.split()[2:4]
                exposed |= {name + suffix for suffix in
                            {"histogram": ["_bucket", "_sum", "_count"]}.get(kind, [""])}
    used = {n for e in exprs for n in re.findall(r"\bddiloco_[a-z_]+", e)}
    assert used and used <= exposed, sorted(used - exposed)


# -- a real run ---------------------------------------------------------------------------------------

def _url(run: TinyRun, name: str) -> str:
    def found():
        got = [e["url"] for e in run.events(name) if e.get("event") == "metrics-listening"]
        if not got and run.procs[name].poll() is not None:
            pytest.fail(f"{name} exited ({run.procs[name].returncode}): {run.stderr(name)}")
        return got[-1] if got else None
    return poll(f"{name}'s metrics-listening event", found)


def _log_totals(uri: str, capsys) -> dict:
    parser = argparse.ArgumentParser()
    handler = logview.configure(parser)
    capsys.readouterr()
    assert handler(parser.parse_args([uri, "--json"])) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines[-1]["type"] == "totals"
    return lines[-1]


def test_scraping_a_real_run(tmp_path, capsys):
    run = TinyRun(str(tmp_path / "store"), tmp_path, dict(os.environ, OMP_NUM_THREADS="1"), steps=3000,
                  learners=2, secure=False)
    run.create()
    try:
        run._spawn("syncer", ["syncer", "--id", "syncer", "--insecure", "--metrics-port", "0"])
        for m in range(run.learners):
            run.learner(f"l{m}", extra=["--metrics-port", "0"])
        syncer_url, learner_url = _url(run, "syncer"), _url(run, "l0")
        merges = lambda s: value(s, "ddiloco_syncer_commits_total", kind="merge")      # noqa: E731
        tokens = lambda s: value(s, "ddiloco_learner_tokens_total")                    # noqa: E731
        s1 = poll("a first merge commit", lambda: (s := scrape(syncer_url)) and merges(s) >= 1 and s)
        l1 = poll("l0's first tokens", lambda: (s := scrape(learner_url)) and tokens(s) > 0 and s)
        s2 = poll("more merges", lambda: (s := scrape(syncer_url)) and merges(s) > merges(s1) and s)
        # delta bytes reach the metrics with the next progress event after the sender counted them:
        # on a loaded machine the first delta may still be on the sender's thread at "more tokens"
        l2 = poll("more tokens and delta bytes", lambda: (s := scrape(learner_url)) and tokens(s) > tokens(l1)
                  and value(s, "ddiloco_learner_delta_bytes_total") > 0 and s)
        assert all(p.poll() is None for p in run.procs.values()), "the run ended before the second scrape"
        # The syncer: merges, deltas, a round size and a grace wait per merge, staleness, versions, bytes.
        assert total(s2, "ddiloco_syncer_deltas_merged_total") > total(s1, "ddiloco_syncer_deltas_merged_total")
        assert value(s2, "ddiloco_syncer_round_size_count") >= merges(s2) - 1     # a merge may land between
        assert total(s2, "ddiloco_syncer_input_staleness_count") > 0
        assert max(v for (n, _), v in s2.items() if n == "ddiloco_syncer_fragment_version") >= 1
        assert value(s2, "ddiloco_store_bytes_total", direction="written") > \
            value(s1, "ddiloco_store_bytes_total", direction="written")
        # A learner: steps, tokens/s, step time, deltas out, versions in (read from the store).
        assert value(l2, "ddiloco_learner_steps_total") > value(l1, "ddiloco_learner_steps_total")
        assert value(l2, "ddiloco_learner_tokens_per_second") > 0 and value(l2, "ddiloco_learner_step_seconds") > 0
        assert value(l2, "ddiloco_learner_deltas_total", outcome="submitted") >= 1
        assert value(l2, "ddiloco_learner_delta_bytes_total") > 0
        assert value(l2, "ddiloco_store_bytes_total", direction="read") > 0
        for m in range(run.learners):
            run.procs[f"l{m}"].send_signal(signal.SIGTERM)
        for m in range(run.learners):
            assert run.wait(f"l{m}", 60) == 0, run.stderr(f"l{m}")
        done = [e for e in run.events("l0") if e.get("event") == "learner-done"][-1]
        assert done["tokens"] >= tokens(l2)
        assert run.wait_inbox_empty(60)
        # At the end the syncer's counters are the log's: same commits, merged and dropped deltas.
        def settled():
            s = scrape(syncer_url)
            t = _log_totals(run.uri, capsys)
            return (s, t) if value(s, "ddiloco_syncer_last_commit_seq") == t["last_seq"] else None
        s, t = poll("the syncer's metrics to reach the log's tail", settled, timeout=30, every=0.5)
    finally:
        run.stop_all()
    kinds = t["commits_by_kind"]
    assert merges(s) == kinds["merge"] >= 2
    assert value(s, "ddiloco_syncer_commits_total", kind="drop") == kinds.get("drop", 0)
    assert value(s, "ddiloco_syncer_recoveries_total") == kinds["fence"] == 1
    assert total(s, "ddiloco_syncer_commits_total") + kinds["init"] + kinds["fence"] == t["commits"]
    assert total(s, "ddiloco_syncer_deltas_merged_total") == t["deltas_merged"]
    assert total(s, "ddiloco_syncer_deltas_dropped_total") == t["deltas_dropped"]
    for reason, n in t["drop_reasons"].items():
        assert value(s, "ddiloco_syncer_deltas_dropped_total", reason=reason) == n
    assert value(s, "ddiloco_syncer_round_size_count") == kinds["merge"]
    assert value(s, "ddiloco_syncer_last_seq") == t["last_seq"]
    assert run.procs["syncer"].returncode == 0, run.stderr("syncer")
