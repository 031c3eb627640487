"""Who is who in a run: key files, the run's public key list, later members, and `ddiloco keys`.

Issue "Security"; docs/security.md explains the choices. Every process has one identity: a
ZeroMQ CURVE key pair (transport encryption and authentication) and an Ed25519 key pair
(signatures on data at rest, workers/bus/signing.py). Both live in ZeroMQ certificate files, the
format ``zmq.auth.create_certificates`` writes and ``zmq.auth.load_certificate`` reads:
``NAME.key`` (public, 0644) and ``NAME.key_secret`` (0600, refused when group/world readable).
The Ed25519 keys ride in the certificate's ``metadata`` section (``ddiloco-sign-public``, and in
the secret file only ``ddiloco-sign-secret``), so ZeroMQ's own tools still read the files.

A signed run lists PUBLIC keys only, in the descriptor's ``security`` section (pipeline/security.py
``RunSecurity``, re-exported here with ``PublicIdentity``):
``{"mode": "signed", "version": 1, "syncer": {name, role, curve, sign}, "learners": {id: {...}}}``.
Its mode is fixed at creation. Learners that join later are added by *membership records*
``members/<id>`` (kind ``member`` v1, create-if-absent, never replaced) signed by the syncer's key;
:class:`Roster` is the descriptor's list plus every valid membership record.
"""
from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import zmq

from pipeline.envelope import pack_record, unpack_record
from pipeline.errors import FormatError
from pipeline.descriptor import RunDescriptor
from pipeline.security import (HEX_RE as _HEX_RE, SYNCER, Z85_RE as _Z85_RE, PublicIdentity, RunSecurity,
                               check_key_name as _check_name)
from storage.errors import AlreadyExists, NotFound, StoreError
from storage.layout import MEMBER_PREFIX, member_key as layout_member_key
from storage.store import ObjectStore
from workers.bus.bus import CurveKeys
from workers.bus.signing import Signer, canonical, verify

MEMBER_KIND, MEMBER_VERSION = "member", 1
_BANNER = {
    "public": "#   ****  Generated on {now} by ddiloco (pyzmq certificate format)  ****\n"
              "#   ZeroMQ CURVE Public Certificate\n"
              "#   Exchange securely, or use a secure mechanism to verify the contents\n"
              "#   of this file after exchange.\n\n",
    "secret": "#   ****  Generated on {now} by ddiloco (pyzmq certificate format)  ****\n"
              "#   ZeroMQ CURVE **Secret** Certificate\n"
              "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.\n\n",
}


@dataclass(frozen=True)
class Identity:
    """A process's own key material. Secrets are excluded from repr and never logged."""

    public: PublicIdentity
    curve_secret: str = field(repr=False)
    sign_secret: bytes = field(repr=False)

    @property
    def name(self) -> str:
        return self.public.name

    def signer(self) -> Signer:
        return Signer(self.sign_secret)

    def curve_keys(self, server: PublicIdentity | None = None) -> CurveKeys:
        """CURVE keys for a socket: a server (``server=None``) or a client pinning ``server``."""
        return CurveKeys(self.public.curve.encode(), self.curve_secret.encode(),
                         server.curve.encode() if server is not None else None)


@dataclass(frozen=True)
class KeyRing:
    """What a process needs: its own identity and the syncer's pinned public identity (for the
    syncer itself, its own)."""

    own: Identity
    syncer: PublicIdentity


def generate_identity(name: str, role: str | None = None) -> Identity:
    """A fresh identity; the role defaults to ``syncer`` for the name 'syncer', else ``learner``."""
    role = role or (SYNCER if name == SYNCER else "learner")
    curve_public, curve_secret = zmq.curve_keypair()
    signer = Signer.generate()
    return Identity(PublicIdentity(name, role, curve_public.decode(), signer.public), curve_secret.decode(),
                    signer.secret_bytes())


# -- key files -----------------------------------------------------------------------------------

def _cert_text(ident: Identity, secret: bool) -> str:
    p = ident.public
    meta = {"ddiloco-name": p.name, "ddiloco-role": p.role, "ddiloco-sign-public": p.sign}
    if secret:
        meta["ddiloco-sign-secret"] = ident.sign_secret.hex()
    lines = [_BANNER["secret" if secret else "public"].format(now=time.strftime("%Y-%m-%d %H:%M:%S")), "metadata\n"]
    lines += [f'    {k} = "{v}"\n' for k, v in meta.items()]
    lines += ["curve\n", f'    public-key = "{p.curve}"\n']
    if secret:
        lines.append(f'    secret-key = "{ident.curve_secret}"\n')
    return "".join(lines)


def _create(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)   # never replaces a key, never world-readable
    try:
        os.fchmod(fd, mode)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def key_paths(directory: str | Path, name: str) -> tuple[Path, Path]:
    """``(NAME.key, NAME.key_secret)`` in ``directory``."""
    d = Path(directory)
    return d / f"{_check_name(name)}.key", d / f"{name}.key_secret"


def write_identity(directory: str | Path, ident: Identity) -> tuple[Path, Path]:
    """Write ``NAME.key`` (0644) and ``NAME.key_secret`` (0600); refuses to overwrite either."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    public, secret = key_paths(d, ident.name)
    for p in (public, secret):
        if p.exists():
            raise FileExistsError(f"{p} exists: keys are never overwritten (remove it first)")
    _create(secret, _cert_text(ident, True), 0o600)
    _create(public, _cert_text(ident, False), 0o644)
    return public, secret


def _parse_cert(path: Path) -> dict[str, str]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"key file {path} does not exist (create keys with `ddiloco keys`)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"key file {path}: unreadable ({exc.__class__.__name__})") from None
    out: dict[str, str] = {}
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#") or "=" not in s or not line.startswith((" ", "\t")):
            continue
        k, v = s.split("=", 1)
        out[k.strip()] = v.strip().strip("'\"")
    return out


def load_public(path: str | Path) -> PublicIdentity:
    """The public identity in a ``.key`` (or ``.key_secret``) file."""
    p = Path(path)
    f = _parse_cert(p)
    try:
        return PublicIdentity(f.get("ddiloco-name", ""), f.get("ddiloco-role", ""), f.get("public-key", ""),
                              f.get("ddiloco-sign-public", ""))
    except ValueError as exc:
        raise ValueError(f"key file {p}: not a ddiloco certificate ({exc})") from None


def load_identity(path: str | Path) -> Identity:
    """A process's identity from its ``.key_secret`` file (ValueError if readable by others)."""
    p = Path(path)
    public = load_public(p)
    f = _parse_cert(p)
    curve_secret, sign_hex = f.get("secret-key", ""), f.get("ddiloco-sign-secret", "")
    if not _Z85_RE.match(curve_secret) or not _HEX_RE.match(sign_hex):
        raise ValueError(f"key file {p} holds no secret keys (did you pass the public .key file?)")
    if stat.S_IMODE(p.stat().st_mode) & 0o077:
        raise ValueError(f"key file {p} has permissions {oct(stat.S_IMODE(p.stat().st_mode))}: a secret key must "
                         f"not be readable by group or others (chmod 600 {p})")
    if zmq.curve_public(curve_secret.encode()).decode() != public.curve:
        raise ValueError(f"key file {p}: the CURVE secret key does not match its public key")
    ident = Identity(public, curve_secret, bytes.fromhex(sign_hex))
    if ident.signer().public != public.sign:
        raise ValueError(f"key file {p}: the signing secret key does not match its public key")
    return ident


def ensure_identities(directory: str | Path, names: Iterable[str]) -> dict[str, Identity]:
    """Load ``NAME.key_secret`` for each name, creating the ones that do not exist yet."""
    out = {}
    for name in names:
        _, secret = key_paths(directory, name)
        if not secret.exists():
            write_identity(directory, generate_identity(name))
        out[name] = load_identity(secret)
    return out


# -- the run's list ------------------------------------------------------------------------------

# -- members who join later ----------------------------------------------------------------------

def member_key(name: str) -> str:
    return layout_member_key(_check_name(name))


def member_record(descriptor: RunDescriptor, authority: Identity, member: PublicIdentity) -> bytes:
    """A membership record for ``member``, signed by the run's syncer key (``authority``)."""
    body = {"run_id": descriptor.run_id, **member.to_dict()}
    sig = authority.signer().sign("member", descriptor.run_id, canonical(body))
    return pack_record(MEMBER_KIND, MEMBER_VERSION, {**body, "sig": sig})


def add_member(store: ObjectStore, descriptor: RunDescriptor, authority: Identity, member: PublicIdentity) -> str:
    """List ``member`` in a running signed run (create-if-absent: a listed key is never replaced)."""
    sec = descriptor.security
    if sec is None:
        raise ValueError(f"run {descriptor.run_id} is unsigned: it has no key list to join")
    if authority.public.sign != sec.syncer.sign:
        raise ValueError("only the run's syncer key may add members; this key is not it")
    if member.role != "learner" or member.name in sec.learners:
        raise ValueError(f"{member.name!r} is not a new learner of run {descriptor.run_id}")
    key, blob = member_key(member.name), member_record(descriptor, authority, member)
    try:
        store.put_if_absent(key, blob)
    except AlreadyExists:
        if store.get(key) != blob:
            raise ValueError(f"learner {member.name!r} is already listed in run {descriptor.run_id} with other keys") \
                from None
    return key


def parse_member(blob: bytes, descriptor: RunDescriptor, sec: RunSecurity, what: str) -> PublicIdentity:
    """A verified membership record (FormatError if malformed, for another run or not signed by the syncer)."""
    _, d = unpack_record(blob, MEMBER_KIND, MEMBER_VERSION, max_bytes=4096, what=what)
    sig = d.pop("sig", None)
    if d.get("run_id") != descriptor.run_id or not isinstance(sig, bytes):
        raise FormatError(f"{what}: membership record of another run or without a signature")
    if not verify(sec.syncer.sign, "member", descriptor.run_id, canonical(d), sig):
        raise FormatError(f"{what}: bad syncer signature on the membership record (refused)")
    d.pop("run_id")
    return PublicIdentity.from_dict(d, what)


class Roster:
    """The learners a signed run accepts: the descriptor's list plus valid membership records.

    Lookups may come from any thread (the ZAP authenticator's); ``refresh`` replaces the maps
    whole, so readers always see a consistent snapshot. Records never leave the roster.
    """

    def __init__(self, descriptor: RunDescriptor, sec: RunSecurity):
        self.descriptor, self.security = descriptor, sec
        self._learners: dict[str, PublicIdentity] = dict(sec.learners)
        self._by_curve = {p.curve: n for n, p in self._learners.items()}
        self._checked: set[str] = set()          # member keys already read (valid or not)
        self._lock = threading.Lock()
        self.problems: list[str] = []            # invalid membership records, for the log

    @classmethod
    def for_run(cls, descriptor: RunDescriptor) -> "Roster | None":
        return None if descriptor.security is None else cls(descriptor, descriptor.security)

    def sign_key(self, learner: str) -> str | None:
        p = self._learners.get(learner)
        return p.sign if p is not None else None

    def learner_of_curve(self, curve_z85: str) -> str | None:
        return self._by_curve.get(curve_z85)

    def __contains__(self, learner: str) -> bool:
        return learner in self._learners

    def refresh(self, store: ObjectStore) -> list[str]:
        """Read membership records not seen before; returns the learners added."""
        with self._lock:
            try:
                keys = [k for k in store.list(MEMBER_PREFIX) if k not in self._checked]
            except StoreError as exc:
                self.problems.append(f"list {MEMBER_PREFIX}: {exc}")
                return []
            learners, added = dict(self._learners), []
            for key in keys:
                try:
                    member = parse_member(store.get(key), self.descriptor, self.security, key)
                    if key != member_key(member.name) or member.role != "learner" or member.name in learners:
                        raise FormatError(f"{key}: names learner {member.name!r}, which is not a new learner")
                except NotFound:
                    continue
                except StoreError as exc:
                    self.problems.append(f"{key}: {exc}")
                    continue        # retried next time
                except FormatError as exc:
                    self.problems.append(str(exc))
                    self._checked.add(key)
                    continue
                self._checked.add(key)
                learners[member.name] = member
                added.append(member.name)
            if added:
                self._by_curve = {p.curve: n for n, p in learners.items()}
                self._learners = learners
            return added


def check_syncer_keys(descriptor: RunDescriptor, keys: KeyRing | None) -> RunSecurity | None:
    """The run's key list, after checking that ``keys`` fit the run's mode (ValueError saying the fix)."""
    sec, run = descriptor.security, descriptor.run_id
    if sec is None:
        if keys is not None:
            raise ValueError(f"run {run} is unsigned (created with --insecure): a signed syncer cannot join it")
        return None
    if keys is None:
        raise ValueError(f"run {run} is signed: the syncer needs the run's syncer key (--key or --keys)")
    if (keys.own.public.sign, keys.own.public.curve) != (sec.syncer.sign, sec.syncer.curve):
        raise ValueError(f"key {keys.own.name!r} is not the syncer key listed in run {run}")
    return sec


class Gate:
    """The syncer's door: the roster, the CURVE keys refused at it, and when to re-read the
    membership records (every ``poll_s``, or within a second when someone unknown knocks).
    ``denied`` runs on the ZAP thread, everything else on the syncer's."""

    def __init__(self, roster: Roster, poll_s: float, clock: Callable[[], float]):
        self.roster, self.poll_s, self.clock = roster, poll_s, clock
        self._denied: Counter = Counter()
        self._lock = threading.Lock()
        self._next = 0.0

    def denied(self, curve_key: str) -> int:
        """Count a refused key; returns how often it was refused."""
        with self._lock:
            self._denied[curve_key] += 1
            n = self._denied[curve_key]
        self.soon()        # maybe it was just added
        return n

    def denied_total(self) -> int:
        with self._lock:
            return sum(self._denied.values())

    def soon(self) -> None:
        self._next = min(self._next, self.clock() + 1.0)

    def refresh(self, store: ObjectStore, force: bool = False) -> tuple[list[str], list[str]]:
        """``(learners added, problems)`` if a refresh was due (or ``force``), else two empty lists."""
        if not force and self.clock() < self._next:
            return [], []
        added = self.roster.refresh(store)
        problems, self.roster.problems = self.roster.problems, []
        self._next = self.clock() + self.poll_s
        return added, problems


# -- `ddiloco keys` ------------------------------------------------------------------------------

def configure(parser):
    """Create key pairs (CURVE + Ed25519, ZeroMQ certificate files, secrets 0600); optionally list a new learner in a running run."""
    parser.add_argument("dir", help="directory for NAME.key (public) and NAME.key_secret (secret, 0600)")
    parser.add_argument("names", nargs="+", help="key names: 'syncer' and/or learner ids (existing keys are kept)")
    parser.add_argument("--join", metavar="STORE", default=None,
                        help="also list these learners in the signed run at STORE (needs --authority)")
    parser.add_argument("--authority", metavar="PATH", default=None,
                        help="the run's syncer secret key file (signs the membership records)")
    parser.add_argument("--s3-endpoint", default=None, help="S3 endpoint URL for --join")

    def handler(args) -> int:
        if args.join and not args.authority:
            raise SystemExit("--join needs --authority PATH (the run's syncer .key_secret file)")
        idents = ensure_identities(args.dir, args.names)
        out = {n: {"public": str(key_paths(args.dir, n)[0]), "secret": str(key_paths(args.dir, n)[1]),
                   **i.public.to_dict()} for n, i in idents.items()}
        if args.join:
            from storage.layout import read_descriptor
            from storage.store import open_store
            store = open_store(args.join, s3_endpoint=args.s3_endpoint)
            desc = read_descriptor(store)
            authority = load_identity(args.authority)
            for n, i in idents.items():
                out[n]["member"] = add_member(store, desc, authority, i.public)
        print(json.dumps(out, indent=2))      # public keys and paths only: never a secret
        return 0
    return handler
