"""`ddiloco dashboard` (issue 17): the state it builds from the commit log and the event logs, its
HTTP server, and the page in a real headless Chromium while a real run trains.

The browser test starts `ddiloco run` (2 learners, metrics on free ports) and the dashboard as
processes, loads the page in Chromium twice while the run trains (the learners are listed and the
numbers move), stops the run as Ctrl-C does, keeps screenshots in tests/artifacts/ (ignored by
git), and checks that the dashboard's commits, merges and drops equal ``ddiloco log --json``'s
totals for the same run.
Without Chromium it is skipped with a reason that says how to install it (docs/running.md "Dashboard").
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from pipeline.types import DroppedRecord
from storage.log import CommitLog
from storage.store import open_store
from workers.launch import RunSettings, Schedule, create_run
from workers.run import metrics_flags
from workers.tools.dashboard import DashboardServer, dashboard_command, default_events_dir, state_body
from workers.tools.dashboard_state import STATE_FORMAT, STATE_VERSION, RunView, Series, ViewConfig
from workers.tools.logview import LogTotals

from runhelpers import free_port

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
INSTALL = ("Chromium not found: install it with `apt-get update && apt-get install -y chromium` "
           "(Debian/Ubuntu; .ci/run does it; README \"Dashboard\")")
ARTIFACTS = Path(__file__).parent / "artifacts"
# Far more steps than the test waits for: it stops the run (Ctrl-C) after its two looks, so that on
# a fast machine the run cannot end before the second look and on a slow one the test stays short.
STEPS = 20_000


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def write_events(path: Path, events: list[dict]) -> None:
    with open(path, "a") as fh:
        for e in events:
            fh.write(json.dumps(e) + "\n")


def small_run(store, fragments: int = 2):
    """An unsigned run with a 2-tensor model: descriptor, version 0 and one init commit per fragment."""
    init = {"a": np.zeros((4, 4), np.float32), "b": np.ones((8,), np.float32)}
    return create_run(store, init, RunSettings(schedule=Schedule(fragments=fragments, sync_every=2 * fragments)))


# -- the state -------------------------------------------------------------------------------------

def test_view_config_refuses_bad_values():
    for bad in (dict(refresh_s=0), dict(silent_s=-1), dict(rate_window_s="x"), dict(series_points=1),
                dict(max_commits_per_refresh=0)):
        with pytest.raises(ValueError, match="ViewConfig"):
            ViewConfig(**bad)


def test_series_stays_bounded_and_ends_at_the_newest_point():
    s = Series(cap=10)
    for i in range(1000):
        s.add(i, -i)
    pts = s.to_list()
    assert len(pts) <= 12 and pts[0] == [0, 0] and pts[-1] == [999, -999]
    assert [p[0] for p in pts] == sorted(p[0] for p in pts)


def test_learners_from_events_alive_silent_stopped_and_tokens_per_second(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    wall = Clock(1000.0)
    view = RunView(str(tmp_path / "no-store"), logs, config=ViewConfig(refresh_s=1, silent_s=15), wall=wall)
    write_events(logs / "l0.jsonl", [
        {"t": 990.0, "role": "learner", "id": "l0", "event": "learner-start", "incarnation": 1, "versions": {"0": 0}},
        *({"t": 990.0 + k, "role": "learner", "id": "l0", "event": "step", "step": 10 * k, "loss": 5.0 - k / 10,
           "tokens": 1280 * k, "versions": {"0": 0}, "acked": k, "spilled": 0, "bytes_sent": 100 * k}
          for k in range(1, 6))])
    write_events(logs / "launcher.jsonl", [{"t": 991.0, "role": "launcher", "id": "launcher", "event": "eval",
                                            "tokens": 0, "loss": 5.5}])
    s = view.state()
    assert "no run readable" in s["error"] and s["format"] == STATE_FORMAT and s["version"] == STATE_VERSION
    (l0,) = s["learners"]
    assert (l0["id"], l0["status"], l0["alive"], l0["step"], l0["tokens"]) == ("l0", "training", True, 50, 6400)
    assert l0["tokens_per_s"] == pytest.approx(1280.0) and l0["loss"] == pytest.approx(4.5)
    assert s["eval"] == [[0.0, 5.5]] and len(l0["loss_series"]) == 5
    wall.t = 1030.0                                  # no event for 35 s > silent_s
    assert view.state()["learners"][0]["status"] == "silent"
    write_events(logs / "l0.jsonl", [{"t": 1031.0, "role": "learner", "id": "l0", "event": "learner-stop",
                                      "step": 55, "tokens": 7040, "bytes_received": 999}])
    wall.t = 1032.0
    l0 = view.state()["learners"][0]
    assert (l0["status"], l0["alive"], l0["step"], l0["bytes_received"]) == ("stopped", False, 55, 999)


def test_state_is_read_at_most_once_per_refresh_interval(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    wall = Clock()
    view = RunView(str(tmp_path / "none"), logs, config=ViewConfig(refresh_s=5), wall=wall)
    assert view.state()["learners"] == []
    write_events(logs / "l1.jsonl", [{"t": wall.t, "role": "learner", "id": "l1", "event": "learner-start"}])
    wall.t += 4.9
    assert view.state()["learners"] == []            # cached: nobody reads the logs more often
    wall.t += 0.2
    assert [l["id"] for l in view.state()["learners"]] == ["l1"]


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_commits_are_read_incrementally_and_match_the_log_totals(store, tmp_path, make_commit):
    desc = small_run(store)
    logs = tmp_path / "logs"
    logs.mkdir()
    wall = Clock()
    view = RunView(store.uri, logs, config=ViewConfig(refresh_s=1), wall=wall, opener=lambda uri: store)
    log = CommitLog(store)
    # a commit that names a delta before the learner's event of it is read (either order counts once)
    log.append(make_commit(2, fragment=0, version=1, inputs=("deltas/x/0/0",), quorum=1, committed_at=wall.t))
    s = view.state()
    assert s["error"] == "" and s["run"]["run_id"] == desc.run_id and s["run"]["commits_read"] == 3
    assert [f["version"] for f in s["fragments"]] == [1, 0]
    write_events(logs / "x.jsonl", [{"t": wall.t, "role": "learner", "id": "x", "event": "delta", "delta": d}
                                    for d in ("x/0/0", "x/0/1", "x/0/2")])
    drop = DroppedRecord("x/0/2", "x", "", "", "superseded", 1)
    log.append(make_commit(3, fragment=1, version=1, inputs=("k0", "k1"), dropped=(drop,), committed_at=wall.t))
    wall.t += 1
    s = view.state()
    assert s["run"]["commits_read"] == 4 and [f["version"] for f in s["fragments"]] == [1, 1]
    assert s["fragments"][1]["last_inputs"] == 2 and s["fragments"][1]["merges"] == 1
    assert s["learners"][0]["deltas_published"] == 3 and s["syncer"]["backlog"] == 0
    expected = LogTotals(fragments=desc.num_fragments)
    for rec in log.read_range(0, 4):
        expected.add(rec)
    assert s["totals"] == json.loads(json.dumps(expected.to_dict()))
    assert (s["syncer"]["commits"], s["syncer"]["deltas_merged"], s["syncer"]["deltas_dropped"],
            s["syncer"]["drop_reasons"]) == (4, 3, 1, {"superseded": 1})


def test_finished_waits_until_the_log_is_read_to_its_end(tmp_path, make_commit):
    """A stopped run with a backlog longer than one refresh reads: not finished (its totals are not
    final yet) until the last commit is read."""
    store = open_store(str(tmp_path / "store"))
    small_run(store)
    log = CommitLog(store)
    for seq in range(2, 7):
        log.append(make_commit(seq, fragment=seq % 2, version=seq))
    logs = tmp_path / "logs"
    logs.mkdir()
    wall = Clock()
    write_events(logs / "l0.jsonl", [{"t": wall.t, "role": "learner", "id": "l0", "event": "learner-start"},
                                     {"t": wall.t, "role": "learner", "id": "l0", "event": "learner-stop"}])
    write_events(logs / "syncer.jsonl", [{"t": wall.t, "role": "syncer", "id": "s", "event": "syncer-stop"}])
    view = RunView(store.uri, logs, config=ViewConfig(refresh_s=1, max_commits_per_refresh=3), wall=wall,
                   opener=lambda uri: store)
    seen = []
    for _ in range(4):
        s = view.state()
        seen.append((s["run"]["commits_read"], s["run"]["finished"]))
        wall.t += 1
    assert seen == [(3, False), (6, False), (7, True), (7, True)]


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_cli_once_prints_the_state_of_a_run_on_either_backend(store, tmp_path, capsys):
    desc = small_run(store)

    class Args:
        run_uri, events, host, port, s3_endpoint = store.uri, None, "127.0.0.1", 0, None
        refresh, silent_after, once = 1.0, 15.0, True
    assert dashboard_command(Args, sys.stdout, sys.stderr) == 0
    state = json.loads(capsys.readouterr().out)
    assert state["error"] == "" and state["run"]["run_id"] == desc.run_id
    assert [f["version"] for f in state["fragments"]] == [0, 0] and state["totals"]["commits_by_kind"] == {"init": 2}


def test_default_events_dir_is_logs_beside_a_local_store(tmp_path):
    assert default_events_dir(str(tmp_path / "out" / "store")) == (tmp_path / "out" / "logs").resolve()
    assert default_events_dir(f"file://{tmp_path}/out/store") == (tmp_path / "out" / "logs").resolve()
    assert default_events_dir("s3://bucket/run") is None


def test_metrics_flags_of_ddiloco_run():
    assert metrics_flags(None, 0) == []
    assert metrics_flags(9400, 0) == ["--metrics-port", "9400"]
    assert metrics_flags(9400, 3) == ["--metrics-port", "9403"]
    assert metrics_flags(0, 2) == ["--metrics-port", "0"]


# -- the server ------------------------------------------------------------------------------------

def get(url: str) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_server_serves_the_page_and_the_state_with_its_digest(tmp_path):
    view = RunView(str(tmp_path / "none"), None, config=ViewConfig())
    server = DashboardServer(view, "127.0.0.1", 0).start()
    try:
        assert server.httpd.server_address[0] == "127.0.0.1" and server.port > 0
        code, headers, body = get(server.url)
        assert code == 200 and headers["Content-Type"].startswith("text/html")
        assert "default-src 'none'" in headers["Content-Security-Policy"]
        assert b"api/state" in body and b"http://" not in body and b"https://" not in body   # nothing from elsewhere
        code, headers, body = get(server.url + "api/state")
        assert code == 200 and headers["Digest"] == "sha-256=" + base64.b64encode(hashlib.sha256(body).digest()).decode()
        state = json.loads(body)
        assert (state["format"], state["version"]) == (STATE_FORMAT, STATE_VERSION) and "no run" in state["error"]
        assert get(server.url + "elsewhere")[0] == 404
    finally:
        server.close()


def test_state_body_refuses_nan():
    with pytest.raises(ValueError):
        state_body({"x": float("nan")})


def test_cli_refuses_a_missing_events_directory(tmp_path, capsys):
    class Args:
        run_uri, events, host, port, s3_endpoint = str(tmp_path), str(tmp_path / "nope"), "127.0.0.1", 0, None
        refresh, silent_after, once = 1.0, 15.0, True
    assert dashboard_command(Args, sys.stdout, sys.stderr) == 2
    assert "no such directory" in capsys.readouterr().err


# -- the page in a real browser during a real run --------------------------------------------------

def chromium(url: str, profile: Path, *extra: str) -> str:
    """Chromium headless on ``url`` with ``extra`` (--dump-dom, --screenshot=PATH); its stdout."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-pings", "--hide-scrollbars",
           f"--user-data-dir={profile}", "--window-size=1440,1500", "--virtual-time-budget=4000", *extra, url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def api(url: str) -> dict:
    return json.loads(get(url + "api/state")[2])


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None and not cond():
            pytest.fail(f"the run ended (rc {proc.returncode}) before {what}")
        time.sleep(0.3)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def dom_commits(dom: str) -> int:
    m = re.search(r'<body[^>]*data-commits="(\d+)"', dom)
    assert m, "the page did not render a state (no data-commits on <body>)"
    return int(m.group(1))


def _without_lost_tokens(totals: dict) -> dict:
    out = {k: v for k, v in totals.items() if k not in ("tokens_dropped", "per_learner")}
    out["per_learner"] = {lid: {k: v for k, v in row.items() if k != "tokens_dropped"}
                          for lid, row in totals.get("per_learner", {}).items()}
    return out


def log_totals(store: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "workers.cli", "log", str(store), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(CHROMIUM is None, reason=INSTALL)
@pytest.mark.timeout(300)
def test_dashboard_in_chromium_during_a_real_run(tmp_path):
    out, profile = tmp_path / "run", tmp_path / "chromium"
    (out / "logs").mkdir(parents=True)
    ARTIFACTS.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.Popen([sys.executable, "-m", "workers.cli", "run", "--learners", "2", "--steps", str(STEPS),
                            "--fragments", "3", "--sync-every", "6", "--layers", "1", "--width", "32",
                            "--batch-size", "4", "--plain", "--eval-every", "3", "--metrics-port", "0",
                            "--out", str(out)], env=env, stdout=open(tmp_path / "run.out", "w"), stderr=subprocess.STDOUT)
    port = free_port()
    dash = subprocess.Popen([sys.executable, "-m", "workers.cli", "dashboard", str(out / "store"), "--events",
                             str(out / "logs"), "--port", str(port), "--refresh", "0.5"], env=env,
                            stdout=open(tmp_path / "dashboard.out", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for(lambda: _up(url), 30, "the dashboard to listen")
        first = wait_for(lambda: (lambda s: s if sum(l["alive"] for l in s["learners"]) == 2
                                  and s["syncer"]["commits"] >= 5 else None)(api(url)), 120,
                         "both learners training and 5 commits", run)
        dom1 = chromium(url, profile, "--dump-dom")
        chromium(url, profile, f"--screenshot={ARTIFACTS / 'dashboard-running.png'}")
        assert re.search(r"<b>l0</b>", dom1) and re.search(r"<b>l1</b>", dom1), "the page does not list the learners"
        assert 'data-status="training"' in dom1 and first["run"]["run_id"] in dom1
        c1 = dom_commits(dom1)
        wait_for(lambda: api(url)["syncer"]["commits"] >= c1 + 5, 60, "5 more commits", run)
        dom2 = chromium(url, profile, "--dump-dom")
        c2 = dom_commits(dom2)
        assert c2 >= c1 + 5, f"the page did not update: {c1} then {c2} commits"
        steps = [int(x.replace(",", "")) for x in re.findall(rf"</span>([\d,]+) / {STEPS:,}</span>", dom2)]
        assert len(steps) == 2 and min(steps) > 0
        mid = api(url)
        urls = [mid["syncer"]["metrics_url"], *(l["metrics_url"] for l in mid["learners"])]
        assert all(u and u.startswith("http://127.0.0.1:") for u in urls), urls   # ddiloco run --metrics-port 0
        assert get(urls[0])[0] == 200 and b"ddiloco_syncer_commits_total" in get(urls[0])[2]

        run.send_signal(signal.SIGINT)      # the run ends as on Ctrl-C: every role stops cleanly, summary written
        run.wait(timeout=120)
        assert (out / "summary.json").exists(), (tmp_path / "run.out").read_text()[-3000:]
        final = wait_for(lambda: (lambda s: s if s["run"]["finished"] else None)(api(url)), 30,
                         "the dashboard to see the run finished")
        totals = log_totals(out / "store")
        assert final["run"]["commits_read"] == totals["last_seq"] + 1
        # The same commits, the same arithmetic - except the tokens of lost deltas: their lineage reads a
        # dropped delta's base from its stored blob while it exists (workers/tools/logview.py LogTotals),
        # and the inbox's clean-up may delete it between the dashboard's reading and this one.
        assert _without_lost_tokens(final["totals"]) == _without_lost_tokens(totals)
        assert 0 <= final["totals"]["tokens_dropped"] and 0 <= totals["tokens_dropped"]
        y = final["syncer"]
        assert (y["commits"], y["commits_by_kind"], y["deltas_merged"], y["deltas_dropped"], y["drop_reasons"]) == \
            (totals["commits"], totals["commits_by_kind"], totals["deltas_merged"], totals["deltas_dropped"],
             totals["drop_reasons"])
        assert len(final["eval"]) >= 2 and final["eval"][-1][1] < final["eval"][0][1]   # the held-out loss fell
        dom3 = chromium(url, profile, "--dump-dom")
        chromium(url, profile, f"--screenshot={ARTIFACTS / 'dashboard-finished.png'}")
        assert dom_commits(dom3) == totals["commits"] and ">finished<" in dom3
        kpi = re.search(r'data-kpi="commits">([\d,]+)<', dom3)
        assert kpi and int(kpi.group(1).replace(",", "")) == totals["commits"]
        print(f"dashboard screenshots: {ARTIFACTS / 'dashboard-running.png'}, {ARTIFACTS / 'dashboard-finished.png'}")
    finally:
        for p in (run, dash):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()


def _up(url: str) -> bool:
    try:
        return get(url)[0] == 200
    except OSError:
        return False
