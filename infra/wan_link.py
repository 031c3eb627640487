"""The WAN shaper's link description: ``LinkSpec``, parsed from strings such as
"rtt=100ms,bw=100mbit,jitter=5ms,loss=0.001", with errors that name the bad field. The proxy that
applies it is infra/wan.py; docs/regions.md says what it models.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

MSS = 1448                 # payload bytes of one TCP segment on a 1500-byte MTU: the unit of loss
MIN_RTO_S = 0.2            # Linux's minimum retransmission timeout: what one lost segment costs at least
MAX_CHUNK = 64 << 10
MIN_BUFFER = 1 << 20
UNSHAPED_BUFFER = 16 << 20

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}          # bits per second
_SIZE_UNITS = {"B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 1024, "MiB": 1 << 20, "GiB": 1 << 30}
_AMBIGUOUS_RATES = {"bps", "kbps", "mbps", "gbps", "kb", "mb", "gb", "b"}


# -- the link ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LinkSpec:
    """One direction of an emulated link. ``LinkSpec.parse("rtt=100ms,bw=100mbit,jitter=5ms,loss=0.001")``.

    String keys (comma-separated ``key=value``, each at most once): ``rtt`` (sets a one-way
    ``delay`` of rtt/2) or ``delay`` (one-way), ``jitter`` (durations: ``us``, ``ms``, ``s``);
    ``bw`` (``bit``/``kbit``/``mbit``/``gbit`` per second, or ``B``/``KB``/``MB``/``GB``/``KiB``/
    ``MiB``/``GiB`` per second); ``burst`` and ``buffer`` (sizes, same byte units or a plain
    integer); ``loss`` and ``reset`` (per-segment probabilities, ``0.001`` or ``0.1%``); ``stall``
    (a duration)."""

    delay_s: float = 0.0                 # one-way propagation delay
    jitter_s: float = 0.0                # each chunk's delay is delay +- uniform(jitter), order kept
    bandwidth: float | None = None       # bytes per second; None: unlimited
    burst: int = 0                       # token bucket size in bytes (0: a plain link of that rate)
    loss: float = 0.0                    # per-segment probability of a retransmission stall
    reset: float = 0.0                   # per-segment probability of a connection reset
    stall_s: float | None = None         # one stall; None: max(MIN_RTO_S, 2 * delay + 4 * jitter)
    buffer: int | None = None            # bytes held per direction; None: see buffer_bytes

    def __post_init__(self) -> None:
        for name in ("delay_s", "jitter_s"):
            _check_number(name, getattr(self, name), minimum=0.0)
        if self.stall_s is not None:
            _check_number("stall_s", self.stall_s, minimum=0.0)
        if self.bandwidth is not None:
            _check_number("bandwidth", self.bandwidth, minimum=0.0)
            if self.bandwidth == 0:
                raise ValueError("LinkSpec.bandwidth must be positive bytes/s (None: unlimited), got 0")
        for name in ("loss", "reset"):
            value = _check_number(name, getattr(self, name), minimum=0.0)
            if value > 1:
                raise ValueError(f"LinkSpec.{name} is a probability in [0, 1], got {value!r}")
        _check_int("burst", self.burst, minimum=0)
        if self.buffer is not None:
            _check_int("buffer", self.buffer, minimum=MSS)

    @classmethod
    def parse(cls, text: str) -> "LinkSpec":
        """The spec written as ``"rtt=100ms,bw=100mbit"``; ``ValueError`` names the bad field."""
        if not isinstance(text, str):
            raise ValueError(f"link spec must be a string like 'rtt=100ms,bw=100mbit', got {type(text).__name__}")
        if not text.strip():
            raise ValueError("empty link spec: write e.g. 'rtt=100ms,bw=100mbit' ('rtt=0ms' for an unshaped link)")
        values: dict[str, object] = {}
        seen: set[str] = set()
        for item in text.split(","):
            key, eq, raw = (part.strip() for part in item.partition("="))
            if not eq or not key or not raw:
                raise ValueError(f"link spec {text!r}: {item.strip()!r} is not key=value")
            if key in seen:
                raise ValueError(f"link spec {text!r}: field {key!r} given twice")
            seen.add(key)
            if key not in _PARSERS:
                raise ValueError(f"link spec {text!r}: unknown field {key!r} (known: {', '.join(_PARSERS)})")
            attr, parse = _PARSERS[key]
            try:
                value = parse(raw)
            except ValueError as exc:
                raise ValueError(f"link spec {text!r}: field {key!r}: {exc}") from None
            values[attr] = value / 2 if key == "rtt" else value
        if {"rtt", "delay"} <= seen:
            raise ValueError(f"link spec {text!r}: give 'rtt' or 'delay' (one-way), not both")
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"link spec {text!r}: {exc}") from None

    @property
    def stall_seconds(self) -> float:
        """What one lost segment costs: ``stall_s``, or an RTO estimate for this link."""
        if self.stall_s is not None:
            return self.stall_s
        return max(MIN_RTO_S, 2 * self.delay_s + 4 * self.jitter_s)

    @property
    def buffer_bytes(self) -> int:
        """Bytes the proxy holds per direction before it stops reading (TCP then pushes back)."""
        if self.buffer is not None:
            return self.buffer
        if self.bandwidth is None:
            return UNSHAPED_BUFFER
        in_flight = self.bandwidth * (self.delay_s + self.jitter_s)   # the bandwidth-delay product
        return max(MIN_BUFFER, int(2 * in_flight) + self.burst)

    @property
    def read_size(self) -> int:
        """Chunk size: ~5 ms of the link's bandwidth, so that chunk granularity adds little delay."""
        if self.bandwidth is None:
            return MAX_CHUNK
        return min(MAX_CHUNK, max(MSS, int(self.bandwidth * 0.005)))

    def __str__(self) -> str:
        parts = [f"delay={self.delay_s * 1e3:g}ms"]
        if self.jitter_s:
            parts.append(f"jitter={self.jitter_s * 1e3:g}ms")
        if self.bandwidth is not None:
            parts.append(f"bw={self.bandwidth * 8 / 1e6:g}mbit")
        for name in ("burst", "loss", "reset"):
            if getattr(self, name):
                parts.append(f"{name}={getattr(self, name):g}")
        if self.stall_s is not None:
            parts.append(f"stall={self.stall_s * 1e3:g}ms")
        if self.buffer is not None:
            parts.append(f"buffer={self.buffer}")
        return ",".join(parts)


def _check_number(name: str, value: object, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"LinkSpec.{name} must be a finite number, got {value!r}")
    if value < minimum:
        raise ValueError(f"LinkSpec.{name} must be >= {minimum:g}, got {value!r}")
    return float(value)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"LinkSpec.{name} must be an int (bytes), got {value!r}")
    if value < minimum:
        raise ValueError(f"LinkSpec.{name} must be >= {minimum} bytes, got {value!r}")
    return value


def _split(raw: str, what: str) -> tuple[float, str]:
    match = re.fullmatch(_NUMBER + r"\s*([A-Za-z%]*)", raw)
    if not match:
        raise ValueError(f"{raw!r} is not a {what}")
    return float(match.group(1)), match.group(2)


def parse_duration(raw: str) -> float:
    """``"100ms"`` -> 0.1 (seconds). A unit (``us``, ``ms``, ``s``) is required."""
    number, unit = _split(raw, "duration like 100ms")
    if unit not in _DURATION_UNITS:
        raise ValueError(f"{raw!r} needs a duration unit: us, ms or s")
    return number * _DURATION_UNITS[unit]


def parse_rate(raw: str) -> float:
    """``"100mbit"`` -> 12.5e6 (bytes per second); ``"12.5MB"`` -> 12.5e6 too."""
    number, unit = _split(raw, "rate like 100mbit")
    if unit.lower() in _RATE_UNITS:
        value = number * _RATE_UNITS[unit.lower()]
    elif unit in _SIZE_UNITS:
        value = number * _SIZE_UNITS[unit]
    elif unit.lower() in _AMBIGUOUS_RATES:
        raise ValueError(f"{raw!r}: unit {unit!r} is ambiguous; write mbit (megabits/s) or MB (megabytes/s)")
    else:
        raise ValueError(f"{raw!r} needs a rate unit: bit, kbit, mbit, gbit (per second) or B, KB, MB, GB, "
                         "KiB, MiB, GiB (per second)")
    if value <= 0:
        raise ValueError(f"{raw!r}: bandwidth must be positive (leave bw out for an unlimited link)")
    return value


def parse_size(raw: str) -> int:
    """``"64KiB"`` -> 65536; a plain integer is bytes."""
    number, unit = _split(raw, "size like 64KiB")
    if unit and unit not in _SIZE_UNITS:
        raise ValueError(f"{raw!r}: unknown size unit {unit!r} (B, KB, MB, GB, KiB, MiB, GiB)")
    value = number * _SIZE_UNITS.get(unit or "B", 1)
    if value != int(value):
        raise ValueError(f"{raw!r} is not a whole number of bytes")
    return int(value)


def parse_probability(raw: str) -> float:
    """``"0.001"`` or ``"0.1%"`` -> 0.001."""
    number, unit = _split(raw, "probability like 0.001 or 0.1%")
    if unit not in ("", "%"):
        raise ValueError(f"{raw!r}: a probability is a plain number or a percentage")
    value = number / 100 if unit == "%" else number
    if value > 1:
        raise ValueError(f"{raw!r}: a probability lies in [0, 1]")
    return value


_PARSERS = {"rtt": ("delay_s", parse_duration), "delay": ("delay_s", parse_duration),
            "jitter": ("jitter_s", parse_duration), "bw": ("bandwidth", parse_rate), "burst": ("burst", parse_size),
            "loss": ("loss", parse_probability), "reset": ("reset", parse_probability),
            "stall": ("stall_s", parse_duration), "buffer": ("buffer", parse_size)}


def as_spec(spec: LinkSpec | str) -> LinkSpec:
    """A ``LinkSpec`` given as itself or as its string form."""
    if isinstance(spec, LinkSpec):
        return spec
    return LinkSpec.parse(spec)
