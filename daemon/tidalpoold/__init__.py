"""tidalpoold: the per-GPU tidalpool daemon."""

from tidalcore import __version__

__all__ = ["__version__"]
