"""Errors a user can act on, raised by every layer above."""

from __future__ import annotations


class ModelError(ValueError):
    """A model (or a split of it) that cannot be used, with a message that says what to do."""
