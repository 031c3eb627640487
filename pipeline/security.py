"""The run's public key list: the ``security`` section of the run descriptor (docs/security.md).

Public keys only, never a secret. Typed here, beside the descriptor that carries it, because
pipeline/ must not import workers/; key files, signatures and the membership records that extend
the list live in workers/bus/keys.py and workers/bus/signing.py, which re-export these types.

Map (descriptor v1 ``extra["security"]``, descriptor v2 ``security``; the same bytes in both):
``{"mode": "signed", "version": 1, "syncer": {name, role, curve, sign}, "learners": {id: {...}}}``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .errors import FormatError
from .types import check_learner_id

SYNCER = "syncer"
ROLES = ("syncer", "learner")
SECURITY_VERSION = 1
Z85_RE = re.compile(r"^[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
HEX_RE = re.compile(r"^[0-9a-f]{64}$")


def check_key_name(name: str) -> str:
    """Key names are learner ids (or 'syncer'): they name files and object keys."""
    try:
        return check_learner_id(name)
    except ValueError:
        raise ValueError(f"key name {name!r} must be a learner id (letters, digits, _ . -) or 'syncer'") from None


@dataclass(frozen=True)
class PublicIdentity:
    """The public half of an identity: what a run lists and peers pin."""

    name: str
    role: str
    curve: str           # CURVE public key, z85 (40 characters)
    sign: str            # Ed25519 public key, hex (64 characters)

    def __post_init__(self) -> None:
        check_key_name(self.name)
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} not one of {ROLES}")
        if not isinstance(self.curve, str) or not Z85_RE.match(self.curve):
            raise ValueError(f"{self.name}: CURVE public key must be 40 z85 characters")
        if not isinstance(self.sign, str) or not HEX_RE.match(self.sign):
            raise ValueError(f"{self.name}: Ed25519 public key must be 64 lowercase hex characters")

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "role": self.role, "curve": self.curve, "sign": self.sign}

    @classmethod
    def from_dict(cls, d: Any, what: str) -> "PublicIdentity":
        if not isinstance(d, dict) or set(d) != {"name", "role", "curve", "sign"}:
            raise FormatError(f"{what}: a public identity is a map of exactly name, role, curve, sign")
        try:
            return cls(d["name"], d["role"], d["curve"], d["sign"])
        except (ValueError, TypeError) as exc:
            raise FormatError(f"{what}: {exc}") from None


@dataclass(frozen=True)
class RunSecurity:
    """The public key list of a signed run (the descriptor's ``security``; None: an unsigned run)."""

    syncer: PublicIdentity
    learners: Mapping[str, PublicIdentity]

    @classmethod
    def listing(cls, syncer: PublicIdentity, learners: Iterable[PublicIdentity]) -> "RunSecurity":
        """The key list of a new signed run (checked as a stored one is)."""
        sec = cls(syncer, {p.name: p for p in learners})
        return cls.from_dict(sec.to_dict(), "new run security")

    def to_dict(self) -> dict[str, Any]:
        return {"mode": "signed", "version": SECURITY_VERSION, "syncer": self.syncer.to_dict(),
                "learners": {n: p.to_dict() for n, p in sorted(self.learners.items())}}

    @classmethod
    def from_dict(cls, d: Any, what: str = "run descriptor security") -> "RunSecurity":
        if not isinstance(d, dict) or d.get("mode") != "signed" or d.get("version") != SECURITY_VERSION:
            raise FormatError(f"{what}: expected mode 'signed' version {SECURITY_VERSION}, got "
                              f"{(d.get('mode'), d.get('version')) if isinstance(d, dict) else type(d).__name__}")
        if set(d) != {"mode", "version", "syncer", "learners"}:
            raise FormatError(f"{what}: unknown fields {sorted(set(d) - {'mode', 'version', 'syncer', 'learners'})}")
        learners = d.get("learners")
        if not isinstance(learners, dict):
            raise FormatError(f"{what}.learners must be a map")
        syncer = PublicIdentity.from_dict(d.get("syncer"), f"{what}.syncer")
        listed = {n: PublicIdentity.from_dict(v, f"{what}.learners.{n}") for n, v in learners.items()}
        if any(p.name != n or p.role != "learner" for n, p in listed.items()) or syncer.role != SYNCER:
            raise FormatError(f"{what}: names and roles of the listed keys do not match")
        return cls(syncer, listed)
