"""The object-storage price table, a monthly cost estimate from the store counters, and what a
data-parallel all-reduce would move (docs/regions.md "The price table").

Here, not in infra/, because ``ddiloco run`` and ``ddiloco log`` report the estimate and workers/
never imports infra/ (infra/prices.py re-exports this module for older callers).

Default prices: Amazon S3 Standard in US East (N. Virginia), public list prices from
https://aws.amazon.com/s3/pricing/ (tabs "Storage", "Requests & data retrievals", "Data
transfer"), as published there (unchanged for years); written down 2026-11-30 from the
published figures without access to the page from this machine, so check them before relying on
them (they agree with the figures this author knew; AWS changes prices, so the report always
prints "unverified, check before budgeting" next to a default-priced figure):

- PUT, COPY, POST, LIST requests: $0.005 per 1,000; GET, SELECT and all other requests (HEAD):
  $0.0004 per 1,000; DELETE: free;
- data transfer out of S3 to another AWS region: $0.02 per GB (into S3: free); this is the US
  East (N. Virginia) rate - it is billed by the *source* region and is higher out of some (Asia
  Pacific, South America): ``inter_region_per_gb_from`` sets it per source region;
- storage: $0.023 per GB-month (first 50 TB per month).

AWS bills a "GB" as 2^30 bytes, so this module does too. Override any of them with a JSON object
of the same field names (``load_prices(path)``, or ``parse_prices(spec)``: a path or inline JSON,
as ``--prices`` takes it); unknown names and negative or non-numeric values are refused by name.

Data parallelism for comparison (``dp_allreduce_bytes``): a ring all-reduce of S bytes over M
replicas sends, and receives, 2·(M-1)/M·S bytes per replica per step (reduce-scatter then
all-gather, each (M-1)/M·S); S = parameters x 2 (bf16 gradients) or x 4 (fp32).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Mapping

from storage.accounting import StoreCounters

GB = 1 << 30
MONTH_S = 30 * 24 * 3600.0      # a 30-day month (AWS prorates storage by hours in the month)
DEFAULT_SOURCE = ("AWS S3 Standard, us-east-1, https://aws.amazon.com/s3/pricing/ "
                  "(list prices recorded 2026-11-30, not checked online)")


@dataclass(frozen=True)
class PriceTable:
    """USD prices. Request classes follow S3's: PUT-class (PUT, conditional PUT, multipart parts,
    LIST), GET-class (GET, HEAD), DELETE (free on S3)."""

    put_per_1000: float = 0.005
    get_per_1000: float = 0.0004
    delete_per_1000: float = 0.0
    inter_region_per_gb: float = 0.02
    storage_per_gb_month: float = 0.023
    # Transfer is billed by the region the bytes leave: (region name, USD per GB) pairs that
    # override ``inter_region_per_gb`` for bytes leaving that region (a JSON object in a file).
    inter_region_per_gb_from: tuple[tuple[str, float], ...] = ()
    source: str = DEFAULT_SOURCE

    def __post_init__(self) -> None:
        if isinstance(self.inter_region_per_gb_from, Mapping):
            object.__setattr__(self, "inter_region_per_gb_from", tuple(sorted(self.inter_region_per_gb_from.items())))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "source":
                if not isinstance(value, str):
                    raise ValueError(f"PriceTable.source must be a string, got {value!r}")
            elif f.name == "inter_region_per_gb_from":
                _check_per_region(value)
            else:
                _check_usd(f"PriceTable.{f.name}", value)

    @property
    def unverified(self) -> bool:
        """Whether the table still names the built-in source (some figure may be the default,
        not checked online from here); a price file that sets ``source`` clears it."""
        return self.source.startswith(DEFAULT_SOURCE)

    def transfer_per_gb(self, source_region: str) -> float:
        """USD per GB leaving ``source_region`` for another region."""
        return dict(self.inter_region_per_gb_from).get(source_region, self.inter_region_per_gb)


def _check_usd(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of USD, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 USD, got {value!r}")


def _check_per_region(pairs) -> None:
    if not isinstance(pairs, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
        raise ValueError("PriceTable.inter_region_per_gb_from must map region names to USD per GB, got "
                         f"{pairs!r}")
    for region, usd in pairs:
        if not isinstance(region, str) or not region:
            raise ValueError(f"PriceTable.inter_region_per_gb_from: region names must be strings, got {region!r}")
        _check_usd(f"PriceTable.inter_region_per_gb_from[{region!r}]", usd)


DEFAULT_PRICES = PriceTable()


def prices_from_dict(overrides: dict, base: PriceTable = DEFAULT_PRICES) -> PriceTable:
    """``base`` with the fields named in ``overrides`` replaced; ``ValueError`` names a bad one."""
    if not isinstance(overrides, dict):
        raise ValueError(f"price overrides must be a JSON object of field -> value, got {type(overrides).__name__}")
    known = {f.name for f in fields(PriceTable)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown price field(s) {', '.join(map(repr, unknown))} (known: {', '.join(sorted(known))})")
    return replace(base, **overrides)


def parse_prices(spec: str | None, base: PriceTable = DEFAULT_PRICES) -> PriceTable:
    """``--prices``: None -> ``base``; a JSON object written inline (starts with ``{``) or the
    path of a JSON file -> ``base`` with those fields replaced. ``ValueError`` names a bad field."""
    if spec is None:
        return base
    if spec.lstrip().startswith("{"):
        try:
            overrides = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--prices is not valid JSON: {exc}") from None
        table = prices_from_dict(overrides, base)
        return table if "source" in overrides else replace(table, source=f"{base.source}, overridden by --prices")
    return load_prices(spec, base)


def load_prices(path: str | Path, base: PriceTable = DEFAULT_PRICES) -> PriceTable:
    """The price table with the overrides in the JSON file ``path`` (e.g. ``{"inter_region_per_gb": 0.09}``)."""
    path = Path(path)
    try:
        overrides = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read the price file {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"price file {path} is not valid JSON: {exc}") from None
    try:
        table = prices_from_dict(overrides, base)
    except ValueError as exc:
        raise ValueError(f"price file {path}: {exc}") from None
    if "source" not in overrides:
        table = replace(table, source=f"{base.source}, overridden by {path}")
    return table


@dataclass(frozen=True)
class CostEstimate:
    """A month's cost, USD, extrapolated from counters over ``duration_s`` at the same rate."""

    duration_s: float
    scale: float                  # months per measured duration: MONTH_S / duration_s
    put_requests_usd: float
    get_requests_usd: float
    delete_requests_usd: float
    transfer_usd: float
    storage_usd: float
    source: str

    @property
    def requests_usd(self) -> float:
        return self.put_requests_usd + self.get_requests_usd + self.delete_requests_usd

    @property
    def total_usd(self) -> float:
        return self.requests_usd + self.transfer_usd + self.storage_usd


def estimate_monthly_cost(counters: StoreCounters, duration_s: float, prices: PriceTable = DEFAULT_PRICES, *,
                          cross_region_bytes: int = 0, stored_bytes: int = 0,
                          cross_region_bytes_from: Mapping[str, int] | None = None) -> CostEstimate:
    """The monthly bill if the traffic in ``counters`` (measured over ``duration_s`` seconds)
    went on for a 30-day month. ``cross_region_bytes`` (over the same duration) are the bytes
    that left their region (the caller knows which stores are remote: e.g. the ``bytes_read`` of a
    store in another region), priced at ``inter_region_per_gb``; ``cross_region_bytes_from``
    (source region -> bytes) are more of them, priced by their source region
    (``PriceTable.transfer_per_gb``); ``stored_bytes`` is the steady amount kept, billed per
    GB-month and not scaled by the duration."""
    if not isinstance(counters, StoreCounters):
        raise ValueError(f"counters must be a StoreCounters snapshot, got {type(counters).__name__}")
    if isinstance(duration_s, bool) or not isinstance(duration_s, (int, float)) or not duration_s > 0 \
            or not math.isfinite(duration_s):
        raise ValueError(f"duration_s must be a positive number of seconds, got {duration_s!r}")
    by_source = dict(cross_region_bytes_from or {})
    for name, value in (("cross_region_bytes", cross_region_bytes), ("stored_bytes", stored_bytes),
                        *((f"cross_region_bytes_from[{k!r}]", v) for k, v in by_source.items())):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    scale = MONTH_S / duration_s
    transfer = cross_region_bytes / GB * prices.inter_region_per_gb \
        + sum(n / GB * prices.transfer_per_gb(src) for src, n in by_source.items())
    put_class = counters.put + counters.put_if_absent + counters.multipart_puts + counters.list
    get_class = counters.get + counters.head
    return CostEstimate(
        duration_s=float(duration_s), scale=scale,
        put_requests_usd=put_class / 1000 * prices.put_per_1000 * scale,
        get_requests_usd=get_class / 1000 * prices.get_per_1000 * scale,
        delete_requests_usd=counters.delete / 1000 * prices.delete_per_1000 * scale,
        transfer_usd=transfer * scale,
        storage_usd=stored_bytes / GB * prices.storage_per_gb_month,
        source=prices.source)


BYTES_PER_PARAM = {"bf16": 2, "fp32": 4}


def dp_allreduce_bytes(params: int, learners: int, dtype: str = "bf16") -> int:
    """Bytes one replica sends (and as many it receives) per step in a ring all-reduce of the
    gradients of ``params`` parameters over ``learners`` replicas: 2·(M-1)/M · params · bytes
    per parameter (0 for one replica)."""
    if isinstance(params, bool) or not isinstance(params, int) or params < 0:
        raise ValueError(f"params must be a non-negative int, got {params!r}")
    if isinstance(learners, bool) or not isinstance(learners, int) or learners < 1:
        raise ValueError(f"learners must be an int >= 1, got {learners!r}")
    if dtype not in BYTES_PER_PARAM:
        raise ValueError(f"dtype must be one of {sorted(BYTES_PER_PARAM)}, got {dtype!r}")
    return 2 * (learners - 1) * params * BYTES_PER_PARAM[dtype] // learners
