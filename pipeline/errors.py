"""The few error types of the project. Each says whether retrying can help.

- ``FormatError``: a blob or record is damaged, truncated, of an unknown version, or too large.
  Fatal for that object: retrying the decode of the same bytes gives the same answer.
- Validation of configuration and arguments raises plain ``ValueError`` naming the bad value.
Storage adds its own (retryable or not) in storage/errors.py.
"""
from __future__ import annotations


class DilocoError(Exception):
    """Base of the project's errors. ``retryable`` says whether the same call may succeed later."""

    retryable: bool = False


class FormatError(DilocoError, ValueError):
    """Bytes that do not decode to a valid object of the expected kind and version (fatal)."""

    retryable = False
