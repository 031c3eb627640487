"""storage/local.py: creating a key's parent directories while a concurrent delete prunes them.
A busy clean-clone CI run (issue 25) once failed a put with "a parent of this key is an object":
``os.makedirs(exist_ok=True)`` raises FileExistsError when its mkdir meets the directory and a
concurrent delete removes it before makedirs checks it. Only a real object in the way is bad input."""
from __future__ import annotations

import os

import pytest

from storage.errors import BadLocation
from storage.store import open_store


def test_a_parent_pruned_between_mkdir_and_its_check_is_made_again(tmp_path, monkeypatch):
    store = open_store(str(tmp_path / "s"))
    real, calls = os.makedirs, []

    def racing(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 1:       # what makedirs raises when the directory vanished under it
            raise FileExistsError(17, "File exists", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", racing)
    store.put_if_absent("spill/l0/i1/s6", b"delta")
    store.put("spill/l0/i1/s7", b"delta")
    assert len(calls) >= 2
    monkeypatch.undo()
    assert store.get("spill/l0/i1/s6") == b"delta" and store.get("spill/l0/i1/s7") == b"delta"


def test_an_object_where_a_parent_belongs_is_still_refused(tmp_path):
    store = open_store(str(tmp_path / "s"))
    store.put_if_absent("a/b", b"object")
    for call in (lambda: store.put_if_absent("a/b/c", b"x"), lambda: store.put("a/b/c/d", b"x")):
        with pytest.raises(BadLocation, match="cannot hold both"):
            call()
    assert store.get("a/b") == b"object"        # nothing lost
