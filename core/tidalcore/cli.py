"""What both command lines (`tidalpool`, `tidalpoold`) share: one-line usage errors and the
switch that shows a traceback."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import NoReturn

DEBUG_ENV = "TIDALPOOL_DEBUG"


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, `prog: error: message (see prog
    --help)`, exit status 2, instead of the usage block; its subparsers are Parsers too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def debug_from_env(env: Mapping[str, str]) -> bool:
    """TIDALPOOL_DEBUG set to anything but "", 0, false, no or off."""
    return env.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
