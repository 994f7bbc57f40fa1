"""Module entries of the registry; importing this package registers them all."""

from . import kda, mla  # noqa: F401
