"""A client of the loom platform's REST API for scripts and the `loom` command line; it imports nothing of the
platform, so it runs wherever the platform's URL can be reached."""

from .client import ApiError, LoomClient, LoomError, Unreachable

__all__ = ["ApiError", "LoomClient", "LoomError", "Unreachable"]
