"""The socket directory: made or checked before any socket is bound, and claimed by one daemon.

Whoever can replace a file in the directory can put their own socket where clients look for
the daemon's and receive their uid, pid and job, so the daemon serves only from a directory
that no other uid can write into:

    owner   the daemon's uid, or root
    mode    not writable by group or others, unless the sticky bit is set (then only a file's
            owner may remove or rename it)

A directory the daemon makes itself is made that way (0755: anyone may reach the sockets,
whose own modes say who may connect).

One daemon per directory: the daemon holds an exclusive `flock` on `tidalpoold.lock` in it for
its lifetime. The kernel drops the lock when the process dies however it dies, so a daemon
killed with SIGKILL never blocks the next one, and two started together cannot both serve.

The plan cache's directory is checked here too, at start: a file where it should be is
refused before the first plan would find it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from tidalcore.wire import LOCK_FILE

_DIRECTORY_MODE = 0o755


class SettingRefused(SystemExit):
    """The daemon will not start with its settings, as it found at start-up (the file system
    or a process limit said so, not the value alone): the command line exits 2 with the
    message, as for a `SettingsError`."""


def prepare(directory: Path, uid: int | None = None) -> None:
    """Make `directory` (and its parents) if missing, then check that no uid but `uid` (the
    daemon's, by default) or root can replace what is in it; SystemExit says why not."""
    uid = os.getuid() if uid is None else uid
    _refuse_file("socket_dir", directory)
    try:
        if not directory.exists():
            directory.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):  # made meanwhile: checked below as any
                os.mkdir(directory, _DIRECTORY_MODE)
        st = os.stat(directory)
    except OSError as e:
        raise SettingRefused(f"socket_dir {directory} cannot be used: {e.strerror}") from e
    if not stat.S_ISDIR(st.st_mode):  # made a file meanwhile
        raise SettingRefused(f"socket_dir {directory} is not a directory")
    if st.st_uid not in (uid, 0):
        raise SystemExit(
            f"socket directory {directory} belongs to uid {st.st_uid}, not to this daemon's uid"
            f" {uid} or root: its owner could replace the daemon's sockets. Use a directory of"
            " the daemon's own (systemd: RuntimeDirectory=)"
        )
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and not st.st_mode & stat.S_ISVTX:
        who = "others" if st.st_mode & stat.S_IWOTH else "its group"
        raise SystemExit(
            f"socket directory {directory} (mode {stat.S_IMODE(st.st_mode):04o}) is writable by"
            f" {who} without the sticky bit: they could replace the daemon's sockets. Use a"
            " directory only the daemon's uid can write (chmod go-w), or a subdirectory the"
            " daemon makes itself"
        )


def check_plan_cache(directory: Path) -> None:
    """SettingRefused when `directory` cannot become the plan cache: it, or the nearest of its
    parents that exists, is not a directory. One the daemon may not write is not refused
    (plans are then not kept, and each write says so)."""
    _refuse_file("plan_cache_dir", directory)


def _refuse_file(setting: str, directory: Path) -> None:
    """SettingRefused naming `setting` when `directory`, or the nearest of its parents that
    exists, is not a directory (so it cannot be one, or be made)."""
    there = directory
    while not there.exists() and not there.is_symlink() and there != there.parent:
        there = there.parent
    if not there.is_dir():
        what = "is not" if there == directory else f"is under {there}, which is not"
        raise SettingRefused(f"{setting} {directory} {what} a directory")


@dataclass
class Claim:
    """The daemon's hold on its directory; `release()` (or the process's end) lets it go."""

    path: Path
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the only fd of the open file drops the flock
            self.fd = -1


def claim(directory: Path) -> Claim:
    """Take the directory's lock file, or SystemExit naming the daemon that holds it."""
    path = directory / LOCK_FILE
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        raise SystemExit(f"cannot open the lock file {path}: {e.strerror}") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SystemExit(f"the lock file {path} is not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SystemExit(f"cannot lock {path}: {e.strerror}") from e
            holder = _holder(fd)
            raise SystemExit(
                f"another daemon (pid {holder}) serves {directory}: stop it, or use another"
                " --socket-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return Claim(path, fd)


def _holder(fd: int) -> str:
    """The pid in a held lock file; its holder writes it just after taking the lock, so an
    empty file is read again for a moment."""
    for _ in range(40):
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.025)
    return "unknown"
