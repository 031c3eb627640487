"""Issue 29: /healthz and /readyz beside /metrics on every role, for the engines' probes."""
from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from workers.common.metrics import Metrics


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize("role,ready_event,end_event,end_reason", [
    ("syncer", "syncer-recovered", "syncer-fenced", "fenced"),
    ("learner", "learner-start", "learner-stop", "stopped")])
def test_ready_follows_the_roles_events_and_alive_is_always_200(role, ready_event, end_event, end_reason):
    m = Metrics(role, "x", "run1")
    url = m.serve("127.0.0.1", 0)
    base = url.rsplit("/", 1)[0]
    try:
        assert _get(base + "/healthz") == (200, "ok\n")
        code, body = _get(base + "/readyz")
        assert code == 503 and body.strip() in ("recovering", "starting")
        m.observe({"event": ready_event, "versions": {}, "epoch": 1})
        assert _get(base + "/readyz") == (200, ("committing" if role == "syncer" else "training") + "\n")
        m.observe({"event": end_event})
        assert _get(base + "/readyz") == (503, end_reason + "\n")
        code, text = _get(url)
        assert code == 200 and 'ddiloco_info{id="x",role="%s",run_id="run1"} 1.0' % role in text
        assert _get(base + "/nothing")[0] == 404
    finally:
        m.close()
