"""The traffic report of a run: requests and bytes per region, link, learner and outer step, the
estimated monthly cost, and what data parallelism would move (issue 14; docs/regions.md
"The accounting report"). ``ddiloco run`` puts it in its summary; ``ddiloco log`` prints it.

Input: the ``accounting`` events of the run's event logs (format 1, workers/common/traffic.py),
cumulative per life (a learner incarnation, a syncer epoch). A life's last event is its total;
consecutive events of a learner life give its outer steps. Sums:

- a **region**'s requests and bytes: every process's counts on that region's store;
- a **link** ``A->B``: bytes that left region A for region B - a process in A writing to B's
  store or sending on the bus to the syncer (B home), and a process in B reading A's store or
  receiving from the syncer's bus (A home). Bus bytes are counted at the learner end (the
  syncer's publisher counts a message once whatever the number of subscribers); links with A = B
  stay inside a region and cost no transfer;
- the **cost**: every request at its class's price and every cross-region byte at its source
  region's transfer price (workers/tools/cost.py), scaled from the accounted span to a 30-day
  month; storage is not included (it depends on retention, not on traffic);
- **data parallelism**: a ring all-reduce sends 2·(M-1)/M·S bytes per learner per step (and
  receives as many), S the model's bytes in bf16 or fp32 (``dp_allreduce_bytes``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from storage.accounting import StoreCounters
from workers.common.events import read_events
from workers.common.traffic import ACCOUNTING_EVENT, ACCOUNTING_FORMAT
from workers.tools.cost import DEFAULT_PRICES, PriceTable, dp_allreduce_bytes, estimate_monthly_cost

REPORT_FORMAT = 1
BUS_FIELDS = ("sent_msgs", "sent_bytes", "recv_msgs", "recv_bytes")
PUT_CLASS = ("put", "put_if_absent", "multipart_puts", "list")
GET_CLASS = ("get", "head")


def lives(events: Iterable[dict]) -> dict[tuple[str, str, Any], list[dict]]:
    """``accounting`` events by life ((role, id, life)), in time order; other formats refused."""
    out: dict[tuple[str, str, Any], list[dict]] = {}
    for e in events:
        if e.get("event") != ACCOUNTING_EVENT:
            continue
        if e.get("format") != ACCOUNTING_FORMAT:
            raise ValueError(f"accounting event of {e.get('id')!r} has format {e.get('format')!r}; this "
                             f"version reads format {ACCOUNTING_FORMAT}")
        out.setdefault((e["role"], e["id"], e.get("life")), []).append(e)
    for evs in out.values():
        evs.sort(key=lambda e: (e["t"], e.get("elapsed_s", 0.0)))
    return out


def _counters(d: dict | None) -> StoreCounters:
    return StoreCounters(**(d or {}))


def _bus(d: dict | None) -> dict[str, int]:
    return {k: int((d or {}).get(k, 0)) for k in BUS_FIELDS}


def _traffic(e: dict) -> tuple[dict[str, StoreCounters], dict[str, int]]:
    return {r: _counters(c) for r, c in e.get("stores", {}).items()}, _bus(e.get("bus"))


def _interval(prev: dict | None, cur: dict) -> dict[str, Any]:
    """One learner outer step: the counts between two consecutive events of a life."""
    stores, bus = _traffic(cur)
    if prev is not None:
        before, bus0 = _traffic(prev)
        stores = {r: c - before.get(r, StoreCounters()) for r, c in stores.items()}
        bus = {k: bus[k] - bus0[k] for k in BUS_FIELDS}
    store = sum(stores.values(), StoreCounters())
    here, home = cur["region"], cur["home"]
    remote_store = sum((c.bytes_written + c.bytes_read for r, c in stores.items() if r != here), 0)
    return {"outer_step": cur.get("outer_step"), "steps": cur.get("step", 0) - (prev or {}).get("step", 0),
            "final": bool(cur.get("final")), "requests": store.requests,
            "bytes_up": store.bytes_written + bus["sent_bytes"], "bytes_down": store.bytes_read + bus["recv_bytes"],
            "cross_region_bytes": remote_store + (bus["sent_bytes"] + bus["recv_bytes"] if here != home else 0),
            "store": store.as_dict(), "bus": bus}


def _links(links: dict, here: str, home: str, stores: dict[str, StoreCounters], bus: dict[str, int]) -> None:
    def add(src: str, dst: str, channel: str, n: int) -> None:
        row = links.setdefault(f"{src}->{dst}", {"from": src, "to": dst, "store_bytes": 0, "bus_bytes": 0,
                                                 "cross_region": src != dst})
        row[f"{channel}_bytes"] += n
    for region, c in stores.items():
        add(here, region, "store", c.bytes_written)
        add(region, here, "store", c.bytes_read)
    if bus["sent_msgs"] or bus["recv_msgs"]:
        add(here, home, "bus", bus["sent_bytes"])
        add(home, here, "bus", bus["recv_bytes"])


def traffic_report(events: Iterable[dict], *, params: int | None = None, sync_every: int | None = None,
                   prices: PriceTable = DEFAULT_PRICES) -> dict[str, Any] | None:
    """The report (module docstring) from a run's events; None when they hold no accounting.
    ``params``: the model's parameter count and ``sync_every``: H, for the data-parallel figures."""
    by_life = lives(events)
    if not by_life:
        return None
    regions: dict[str, StoreCounters] = {}
    links: dict[str, dict] = {}
    learners: dict[str, dict] = {}
    syncers: dict[str, dict] = {}
    for (role, ident, _life), evs in sorted(by_life.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2]))):
        last = evs[-1]
        stores, bus = _traffic(last)
        for region, c in stores.items():
            regions[region] = regions.get(region, StoreCounters()) + c
        if role == "learner":
            _links(links, last["region"], last["home"], stores, bus)
            _add_learner(learners.setdefault(ident, _new_learner(last["region"])), evs)
        else:
            _links(links, last["region"], last["home"], stores, {k: 0 for k in BUS_FIELDS})   # bus: at the learners
            row = syncers.setdefault(ident, {"region": last["region"], "lives": 0, "commits": 0,
                                             "stores": {}, "bus": {k: 0 for k in BUS_FIELDS}})
            row["lives"] += 1
            row["commits"] += int(last.get("commits") or 0)
            for region, c in stores.items():
                row["stores"][region] = (_counters(row["stores"].get(region)) + c).as_dict()
            row["bus"] = {k: row["bus"][k] + bus[k] for k in BUS_FIELDS}
    span = _span(by_life)
    total = sum(regions.values(), StoreCounters())
    cross_from: dict[str, int] = {}
    for row in links.values():
        if row["cross_region"]:
            cross_from[row["from"]] = cross_from.get(row["from"], 0) + row["store_bytes"] + row["bus_bytes"]
    for row in learners.values():
        _learner_means(row)
    cost = estimate_monthly_cost(total, max(span, 1e-3), prices, cross_region_bytes_from=cross_from)
    return {"format": REPORT_FORMAT, "span_s": round(span, 3),
            "regions": {r: _region_row(c) for r, c in sorted(regions.items())},
            "links": dict(sorted(links.items())), "learners": dict(sorted(learners.items())), "syncers": syncers,
            "totals": {**_region_row(total),
                       "cross_region_bytes": sum(cross_from.values())},
            "cost": {"monthly_usd": round(cost.total_usd, 4), "put_requests_usd": round(cost.put_requests_usd, 4),
                     "get_requests_usd": round(cost.get_requests_usd, 4),
                     "delete_requests_usd": round(cost.delete_requests_usd, 4),
                     "transfer_usd": round(cost.transfer_usd, 4), "scale": round(cost.scale, 3),
                     "storage": "not included", "prices": _prices_dict(prices), "unverified": prices.unverified},
            "data_parallel": _data_parallel(learners, params, sync_every, sum(cross_from.values()))}


def _new_learner(region: str) -> dict[str, Any]:
    return {"region": region, "lives": 0, "steps": 0, "outer_steps": 0, "requests": 0, "bytes_up": 0,
            "bytes_down": 0, "cross_region_bytes": 0, "store": StoreCounters().as_dict(),
            "bus": {k: 0 for k in BUS_FIELDS}, "per_outer_step": []}


def _add_learner(row: dict, evs: list[dict]) -> None:
    row["lives"] += 1
    prev = None
    for e in evs:
        step = _interval(prev, e)
        row["per_outer_step"].append({"life": e.get("life"), **step})
        for k in ("steps", "requests", "bytes_up", "bytes_down", "cross_region_bytes"):
            row[k] += step[k]
        row["store"] = (_counters(row["store"]) + _counters(step["store"])).as_dict()
        row["bus"] = {k: row["bus"][k] + step["bus"][k] for k in BUS_FIELDS}
        prev = e
    row["outer_steps"] += int(evs[-1].get("outer_step") or 0)


def _learner_means(row: dict) -> None:
    """Means per full outer step (the rows ending one; a final partial step is not one)."""
    full = [r for r in row["per_outer_step"] if not r["final"]]
    n = len(full)
    row["mean_per_outer_step"] = None if not n else {
        k: round(sum(r[k] for r in full) / n, 1) for k in ("steps", "requests", "bytes_up", "bytes_down",
                                                         "cross_region_bytes")}


def _region_row(c: StoreCounters) -> dict[str, int]:
    return {"put_class": sum(getattr(c, k) for k in PUT_CLASS), "get_class": sum(getattr(c, k) for k in GET_CLASS),
            "list": c.list, "delete": c.delete, "failed": c.failed, "bytes_written": c.bytes_written,
            "bytes_read": c.bytes_read, "requests": c.requests, "by_kind": c.as_dict()}


def _span(by_life: dict) -> float:
    """Seconds from the first meter's start to the last report (wall clock of the events)."""
    start = min(e["t"] - e.get("elapsed_s", 0.0) for evs in by_life.values() for e in evs)
    end = max(e["t"] for evs in by_life.values() for e in evs)
    return max(0.0, end - start)


def _prices_dict(p: PriceTable) -> dict[str, Any]:
    return {"put_per_1000": p.put_per_1000, "get_per_1000": p.get_per_1000, "delete_per_1000": p.delete_per_1000,
            "inter_region_per_gb": p.inter_region_per_gb, "inter_region_per_gb_from": dict(p.inter_region_per_gb_from),
            "source": p.source}


def _data_parallel(learners: dict[str, dict], params: int | None, sync_every: int | None,
                   cross_region: int) -> dict[str, Any] | None:
    """Per learner per inner step: what a learner sent and received (mean over every learner step),
    and every byte that crossed regions in the run - the syncer's ingest and replication too, which
    carry the learners' work in a bucket-only run - over the learners' steps."""
    steps = sum(r["steps"] for r in learners.values())
    if params is None or not learners or not steps:
        return None
    m = len(learners)
    mine = {k: round(sum(r[k] for r in learners.values()) / steps, 1) for k in ("bytes_up", "bytes_down")}
    mine["cross_region_bytes"] = round(cross_region / steps, 1)
    dp = {dtype: dp_allreduce_bytes(params, m, dtype) for dtype in ("bf16", "fp32")}
    return {"formula": "ring all-reduce: 2*(M-1)/M * params * bytes per param, sent (and received) per learner "
                       "per inner step", "learners": m, "params": params, "sync_every": sync_every,
            "dp_per_learner_per_step": dp,
            "dp_per_learner_per_outer_step": {k: v * sync_every for k, v in dp.items()} if sync_every else None,
            "decoupled_per_learner_per_step": mine,
            # how many times more DP sends than a decoupled learner sends (None: nothing to compare)
            "dp_over_decoupled_sent": {k: round(v / mine["bytes_up"], 1) if mine["bytes_up"] else None
                                       for k, v in dp.items()},
            "dp_over_decoupled_cross_region": {k: round(v / mine["cross_region_bytes"], 1)
                                               if mine["cross_region_bytes"] else None for k, v in dp.items()}}


def read_event_dir(path: str | Path) -> list[dict]:
    """Every event of every ``*.jsonl`` log in ``path``."""
    return [e for f in sorted(Path(path).glob("*.jsonl")) for e in read_events(f)]


def default_event_dir(run_uri: str) -> Path | None:
    """``ddiloco run``'s layout: a run stored in ``OUT/store`` has its event logs in ``OUT/logs``."""
    if "://" in run_uri and not run_uri.startswith("file://"):
        return None
    logs = Path(run_uri.removeprefix("file://")).expanduser().resolve().parent / "logs"
    return logs if logs.is_dir() and any(logs.glob("*.jsonl")) else None


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n} GB"


def report_lines(rep: dict[str, Any], cost: bool = True) -> list[str]:
    """The report as text (``ddiloco run``, ``ddiloco log``): regions, links, learners, the cost
    (``cost``: False leaves it out, for a run on local directories) and the data-parallel comparison."""
    out = [f"accounting: {rep['span_s']:.1f} s of traffic, {rep['totals']['requests']:,} store requests, "
           f"{_size(rep['totals']['cross_region_bytes'])} across regions",
           f"  {'region':<10} {'PUT-class':>9} {'GET-class':>9} {'LIST':>6} {'DELETE':>6} {'written':>10} {'read':>10}"]
    for name, r in rep["regions"].items():
        out.append(f"  {name:<10} {r['put_class']:>9,} {r['get_class']:>9,} {r['list']:>6,} {r['delete']:>6,} "
                   f"{_size(r['bytes_written']):>10} {_size(r['bytes_read']):>10}")
    out.append(f"  {'link':<14} {'store':>10} {'bus':>10}  crosses regions")
    for name, r in rep["links"].items():
        if r["store_bytes"] or r["bus_bytes"]:
            out.append(f"  {name:<14} {_size(r['store_bytes']):>10} {_size(r['bus_bytes']):>10}  "
                       f"{'yes' if r['cross_region'] else 'no'}")
    out.append(f"  {'learner':<10} {'region':<8} {'outer steps':>11}   per outer step: {'requests':>8} {'up':>10} "
               f"{'down':>10} {'cross-region':>12}")
    for name, r in rep["learners"].items():
        m = r["mean_per_outer_step"]
        per = (f"{m['requests']:>8,.0f} {_size(m['bytes_up']):>10} {_size(m['bytes_down']):>10} "
               f"{_size(m['cross_region_bytes']):>12}") if m else "(no full outer step)"
        out.append(f"  {name:<10} {r['region']:<8} {r['outer_steps']:>11}   {'':>15} {per}")
    dp = rep.get("data_parallel")
    if dp:
        mine = dp["decoupled_per_learner_per_step"]
        ratio, cross = dp["dp_over_decoupled_sent"], dp["dp_over_decoupled_cross_region"]
        out.append(f"  data parallel, {dp['formula']} (M={dp['learners']}, {dp['params']:,} params): "
                   f"bf16 {_size(dp['dp_per_learner_per_step']['bf16'])}, fp32 "
                   f"{_size(dp['dp_per_learner_per_step']['fp32'])} per step; a decoupled learner sent "
                   f"{_size(mine['bytes_up'])} per step"
                   + (f" ({ratio['bf16']}x less than bf16 DP)" if ratio["bf16"] else "")
                   + f"; across regions {_size(mine['cross_region_bytes'])} per learner step"
                   + (f" ({cross['bf16']}x less)" if cross["bf16"] else ""))
    if not cost:
        return out
    c = rep["cost"]
    warn = " - default prices, unverified: check before budgeting" if c["unverified"] else ""
    out.append(f"  estimated monthly cost at this rate (x{c['scale']:,.0f}): ${c['monthly_usd']:,.2f} (PUT-class "
               f"${c['put_requests_usd']:,.2f}, GET-class ${c['get_requests_usd']:,.2f}, transfer "
               f"${c['transfer_usd']:,.2f}; storage not included){warn}")
    out.append(f"  prices: {c['prices']['source']}")
    return out
