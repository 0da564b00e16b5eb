"""Telling the service manager how the daemon is doing: systemd's notify protocol.

One datagram of newline-separated `KEY=VALUE` fields (`READY=1`, `STOPPING=1`, `STATUS=...`)
to the Unix socket named by $NOTIFY_SOCKET: a path, or `@name` in the abstract namespace.
See sd_notify(3). Without a manager (no $NOTIFY_SOCKET), every call does nothing.
"""

from __future__ import annotations

import logging
import socket

log = logging.getLogger("tidalpoold.notify")


class Notifier:
    """Sends state changes to the socket `address` ($NOTIFY_SOCKET, which the caller reads)."""

    def __init__(self, address: str | None) -> None:
        self.target: str | None = None
        if not address:
            return
        if address.startswith("@"):
            self.target = "\0" + address[1:]
        elif address.startswith("/"):
            self.target = address
        else:  # e.g. vsock: addresses, which only a virtual machine's manager hands out
            log.warning(
                "notify.unsupported",
                extra={"why": f"NOTIFY_SOCKET {address!r} is neither a path nor @name: not sent"},
            )

    def send(self, *fields: str) -> bool:
        """Send `fields` (KEY=VALUE; a newline in one becomes a space) in one datagram; True if
        it was sent. A failure is logged, not raised: the daemon serves all the same."""
        if self.target is None:
            return False
        message = "\n".join(f.replace("\n", " ") for f in fields)
        # A path that is not UTF-8 (surrogate escapes) still makes a readable STATUS line.
        data = message.encode(errors="backslashreplace")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(data, self.target)
        except OSError as e:
            log.warning("notify.failed", extra={"why": f"{fields[0]}: {e}"})
            return False
        return True
