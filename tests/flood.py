"""A flooding process, for the tests and the soak benchmark: connections opened to a daemon's
socket and kept open, each opened again when the daemon closes it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# A flooding process: keeps `n` connections to a Unix socket path or a TCP host:port open,
# each sending `hello` (hex; "" for nothing) and opened again when the daemon closes it, until
# its stdin closes; then prints what it did (JSON). As uid `uid` if not -1. It says "ready" once
# it has first opened as many as it could.
_FLOOD = """
import json, os, select, socket, sys, threading
target, n, hello, uid = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]), int(sys.argv[4])
if uid >= 0:
    os.setgid(uid); os.setgroups([]); os.setuid(uid)
stop, counts, conns = threading.Event(), {"kept": n, "opened": 0, "closed_by_daemon": 0}, []
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
def connect():
    if target.startswith("/"):
        c = socket.socket(socket.AF_UNIX); c.settimeout(5); c.connect(target)
    else:
        host, port = target.rsplit(":", 1)
        c = socket.create_connection((host, int(port)), timeout=5)
    if hello:
        c.sendall(hello)
    c.setblocking(False)
    return c
ready = False
while not stop.is_set():
    while len(conns) < n and not stop.is_set():
        try:
            conns.append(connect()); counts["opened"] += 1
        except OSError:
            break
    if not ready:
        print("ready", flush=True); ready = True
    for c in select.select(conns, [], [], 0)[0]:
        try:
            gone = c.recv(65536) == b""
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        if gone:
            conns.remove(c); c.close(); counts["closed_by_daemon"] += 1
    stop.wait(0.1)
print(json.dumps(counts), flush=True)
"""

SETTINGS_FRAME = bytes(3) + b"\x04" + bytes(5)  # an empty HTTP/2 SETTINGS frame

# As uid argv[2]: opens argv[3] connections to the socket argv[1], each sending argv[4] (hex),
# keeps those answered (a daemon's SETTINGS, an echo), says how many, and holds them until its
# stdin closes.
_HOLD = """
import os, socket, sys
uid = int(sys.argv[2])
os.setgid(uid); os.setgroups([]); os.setuid(uid)
kept = []
for _ in range(int(sys.argv[3])):
    c = socket.socket(socket.AF_UNIX)
    c.settimeout(30)
    c.connect(sys.argv[1])
    c.sendall(bytes.fromhex(sys.argv[4]))
    try:
        if c.recv(9):
            kept.append(c)
            continue
    except OSError:
        pass
    c.close()
print(len(kept), flush=True)
sys.stdin.read()
"""


def hold(path: str, uid: int, n: int, hello: bytes) -> tuple[subprocess.Popen[str], int]:
    """A process of `uid` (needs root) holding what it kept of `n` connections to `path`, each
    sending `hello` and answered, and how many that is; it holds them until killed."""
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLD, path, str(uid), str(n), hello.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    return process, int(process.stdout.readline())


NOBODY = 65534


@contextmanager
def flood(target: str, n: int, hello: bytes = b"", uid: int = -1) -> Iterator[dict[str, Any]]:
    """`n` connections to `target` (a socket path or host:port) kept open by another process
    (as `uid`, -1: ours), each sending `hello` and opened again when the daemon closes it;
    entered once the process has opened its first round. What it did is added to the dict
    yielded when the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _FLOOD, target, str(n), hello.hex(), str(uid)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    about: dict[str, Any] = {"pid": proc.pid, **({"uid": uid} if uid >= 0 else {})}
    try:
        assert proc.stdout is not None
        if proc.stdout.readline() != "ready\n":
            raise RuntimeError(f"the flooding process ended: rc {proc.wait()}")
        yield about
    finally:
        out, _ = proc.communicate(timeout=60)  # closes its stdin: it stops and says what it did
        ok = proc.returncode == 0 and out
        about.update(json.loads(out) if ok else {"rc": proc.returncode})
