"""Module entries of the registry; importing this package registers them all."""

from . import attnres, kda, mla, moe  # noqa: F401
