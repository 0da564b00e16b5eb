"""tidalpoold: the per-GPU tidalpool daemon."""

__version__ = "0.1.0"
