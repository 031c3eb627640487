"""The learner's I/O is one declared interface (workers/learner/io.py): every sender and receiver
the learner can hold - its own threads, one per syncer shard, the sync agent - has every member
of it, and the learner asks the interface, never probes with getattr."""
from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from pathlib import Path

import pytest

from workers.learner import agent, io, receiver, sender, shards

from runhelpers import FakeReceiver

ROOT = Path(__file__).resolve().parent.parent


def _members(proto: type) -> set[str]:
    """The members a Protocol declares: its methods, properties and annotated attributes."""
    own = {n for n, v in vars(proto).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return own | set(typing.get_type_hints(proto))


def _has(cls: type) -> set[str]:
    """Names a class provides: on the class (or a base), or assigned to ``self`` in its __init__."""
    names = {n for k in cls.__mro__ if k is not object for n in vars(k)}
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(e, ast.Attribute) and getattr(e.value, "id", "") == "self":
                        names.add(e.attr)
    return names


@pytest.mark.parametrize("proto, cls", [
    (io.DeltaSender, sender.Sender), (io.DeltaSender, shards.ShardedSender), (io.DeltaSender, agent.AgentSender),
    (io.VersionReceiver, receiver.Receiver), (io.VersionReceiver, shards.ShardedReceiver),
    (io.VersionReceiver, agent.AgentReceiver), (io.VersionReceiver, FakeReceiver)])
def test_every_sender_and_receiver_has_every_member_of_the_interface(proto, cls):
    assert {"submit", "failed", "logs_deltas"} <= _members(io.DeltaSender)      # the reading finds members
    missing = _members(proto) - _has(cls)
    assert not missing, f"{cls.__name__} lacks {sorted(missing)} of {proto.__name__}"


def test_only_the_agent_writes_differences_and_the_others_refuse_one():
    assert agent.AgentSender.writes_difference and agent.AgentSender.logs_deltas
    for cls in (sender.Sender, shards.ShardedSender):
        assert not cls.writes_difference and not cls.logs_deltas
        with pytest.raises(TypeError, match="only the sync agent writes differences"):
            cls.submit_difference(object.__new__(cls), None, {}, {})


def test_the_learner_never_probes_its_sender_or_receiver():
    tree = ast.parse((ROOT / "workers" / "learner" / "learner.py").read_text())
    probes = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call)
              and getattr(n.func, "id", "") in ("getattr", "hasattr")
              and (any(w in ast.unparse(n.args[0]) for w in ("sender", "receiver"))
                   or ast.unparse(n.args[0]) in ("r", "s"))]
    assert not probes, probes
