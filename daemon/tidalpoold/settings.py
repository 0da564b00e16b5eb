"""The daemon's settings: parsed once, at the edge, into one frozen and documented object.

Each setting may come from four places; the first that gives it wins:

    --device-pool 8GiB             command line  (add_arguments, settings_from_args)
    TIDALPOOLD_DEVICE_POOL=8GiB    environment   (handed in as a mapping; never read here)
    device_pool = "8GiB"           TOML file     (--config PATH, or TIDALPOOLD_CONFIG)
    4 GiB                          the field's default

Every failure is a `SettingsError` naming the setting, the source of its value and the value.
"""

from __future__ import annotations

import argparse
import dataclasses
import grp
import math
import os
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidalcore.units import Bytes, format_size, parse_size
from tidalcore.wire import ADMIN_SOCKET, GRPC_SOCKET, HANDLES_SOCKET

ENV_PREFIX = "TIDALPOOLD_"
CONFIG_ENV = "TIDALPOOLD_CONFIG"
DEFAULT_SOURCE = "default"
DIRECT_SOURCE = "Settings()"
CONFIG_ARG_SOURCE = "config_path argument"

_KiB = 1024
_MiB = 1024 * _KiB
_GiB = 1024 * _MiB


class SettingsError(ValueError):
    """A setting is malformed or out of range.

    `setting`, `source` and `value` say which, from where and what; `related` names the other
    setting (name, source, value) when the problem is between two of them.
    """

    def __init__(
        self,
        setting: str,
        source: str,
        value: object,
        problem: str,
        *,
        related: tuple[str, str, object] | None = None,
    ) -> None:
        self.setting = setting
        self.source = source
        self.value = value
        self.problem = problem
        self.related = related
        message = f"{setting}: {problem} (got {value!r} from {source})"
        if related is not None:
            message += f"; {related[0]} is {related[2]!r} from {related[1]}"
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class _Kind:
    """How one type of setting is parsed from text/TOML, checked, shown and logged."""

    parse: Callable[[object], Any]  # raw value (str, int, list...) -> typed value; ValueError
    check: Callable[[object], bool]  # is a constructed value of the right type?
    expect: str  # what `check` wants, for the error message
    show: Callable[[Any], object]  # typed value -> JSON-friendly value
    text: Callable[[Any], str]  # typed value -> human text (help defaults)
    metavar: str
    choices: tuple[str, ...] = ()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_int(raw: object) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, str):
        try:
            return int(raw.strip(), 10)
        except ValueError:
            pass
    raise ValueError("expected a whole number")


def _parse_size(raw: object) -> Bytes:
    if isinstance(raw, str) and raw.strip().startswith("-"):
        raise ValueError("a size must not be negative")
    if isinstance(raw, str | int) and not isinstance(raw, bool):
        return parse_size(raw)
    raise ValueError("expected a size such as 4GiB, 512MB or a number of bytes")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _parse_float(raw: object) -> float:
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        return float(raw)
    if isinstance(raw, str):
        try:
            return float(raw.strip())
        except ValueError:
            pass
    raise ValueError("expected a number of seconds")


def _parse_str(raw: object) -> str:
    if isinstance(raw, str):
        return raw.strip()
    raise ValueError("expected a string")


def _parse_word(raw: object) -> str:
    return _parse_str(raw).lower()


def _parse_path(raw: object) -> Path:
    if isinstance(raw, str | os.PathLike) and str(raw).strip():
        return Path(str(raw).strip())
    raise ValueError("expected a non-empty path")


def _parse_mode(raw: object) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, str):
        digits = raw.strip().lower().removeprefix("0o")
        if digits and all(c in "01234567" for c in digits):
            return int(digits, 8)
    raise ValueError("expected an octal permission mode such as 0660")


def _parse_group(item: object) -> int:
    if isinstance(item, int) and not isinstance(item, bool):
        return item
    if isinstance(item, str):
        name = item.strip()
        if name.isascii() and name.isdigit():
            return int(name)
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            raise ValueError(f"unknown group {name!r}") from None
    raise ValueError(f"expected a group name or gid, not {item!r}")


def _parse_gids(raw: object) -> tuple[int, ...]:
    if isinstance(raw, str):
        items: list[object] = [part for part in raw.split(",") if part.strip()]
    elif isinstance(raw, list | tuple):
        items = list(raw)
    else:
        raise ValueError("expected group names or gids, comma-separated or as a list")
    return tuple(_parse_group(item) for item in items)


def _is_gids(value: object) -> bool:
    return isinstance(value, tuple) and all(_is_int(gid) for gid in value)


_SIZE = _Kind(_parse_size, _is_int, "a whole number of bytes", int, format_size, "SIZE")
_INT = _Kind(_parse_int, _is_int, "a whole number", int, str, "N")
_SECONDS = _Kind(_parse_float, _is_number, "a number", float, lambda v: f"{v:g}", "SECONDS")
_PATH = _Kind(_parse_path, lambda v: isinstance(v, Path), "a Path", str, str, "DIR")
_MODE = _Kind(_parse_mode, _is_int, "a whole number", lambda v: f"{v:04o}", "{:04o}".format, "MODE")
_GIDS = _Kind(
    _parse_gids,
    _is_gids,
    "a tuple of gids",
    list,
    lambda v: ",".join(map(str, v)) or "none",
    "GROUPS",
)
_ADDRESS = _Kind(_parse_str, lambda v: isinstance(v, str), "a string", str, repr, "HOST:PORT")


def _choice(*choices: str) -> _Kind:
    metavar = "{" + ",".join(choices) + "}"
    return _Kind(_parse_word, lambda v: isinstance(v, str), "a string", str, str, metavar, choices)


def _about(kind: _Kind, doc: str) -> dict[str, object]:
    """A field's metadata: how it parses, and its one-line doc (also its --help text)."""
    return {"kind": kind, "doc": doc}


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the daemon is told at start. Built by `load_settings`; passed down explicitly."""

    backend: str = field(
        default="sim",
        metadata=_about(_choice("sim", "cuda"), "memory backend: sim (memfd, no GPU) or cuda"),
    )
    device_pool: Bytes = field(
        default=Bytes(4 * _GiB), metadata=_about(_SIZE, "size of the preallocated device pool")
    )
    host_pool: Bytes = field(
        default=Bytes(8 * _GiB), metadata=_about(_SIZE, "size of the pinned host pool")
    )
    default_device_lease: Bytes = field(
        default=Bytes(1 * _GiB),
        metadata=_about(
            _SIZE,
            "device lease given to a session that asks for 0 (when not set: at most the device"
            " pool, in whole chunks, so that a small pool needs no lease setting; set larger"
            " than the pool: refused)",
        ),
    )
    default_host_lease: Bytes = field(
        default=Bytes(2 * _GiB),
        metadata=_about(
            _SIZE,
            "host lease given to a session that asks for 0 (when not set: at most the host"
            " pool, in whole chunks, so that a small pool needs no lease setting; set larger"
            " than the pool: refused)",
        ),
    )
    default_device_floor: Bytes = field(
        default=Bytes(0),
        metadata=_about(
            _SIZE,
            "floor of an elastic lease that asks for none: device bytes guaranteed to it while"
            " it lives (0: one chunk); its ceiling, when it asks for none, is the whole pool",
        ),
    )
    quota_deadline_s: float = field(
        default=5.0,
        metadata=_about(
            _SECONDS,
            "an elastic session asked to hold fewer chunks (a QuotaChange) gives them back"
            " within this, or is ended; a newcomer's floor waits as long for them",
        ),
    )
    socket_dir: Path = field(
        default=Path("/run/tidalpool"),
        metadata=_about(_PATH, "directory of tidalpool.sock (gRPC) and handles.sock"),
    )
    socket_mode: int = field(
        default=0o660, metadata=_about(_MODE, "permission mode of both sockets, in octal")
    )
    admin_socket_mode: int = field(
        default=0o600,
        metadata=_about(
            _MODE,
            "permission mode of admin.sock (ListSessions, EvictSession, PoolStatus), in octal:"
            " 0600 lets only the daemon's uid (and root) list and evict sessions",
        ),
    )
    allowed_gids: tuple[int, ...] = field(
        default=(),
        metadata=_about(
            _GIDS,
            "groups (names or gids, comma-separated) whose members are admitted although their uid"
            " differs from the daemon's (checked against the peer's primary gid from SO_PEERCRED)",
        ),
    )
    max_sessions: int = field(default=64, metadata=_about(_INT, "most sessions attached at once"))
    max_pending_per_uid: int = field(
        default=8,
        metadata=_about(
            _INT, "most leases one uid may hold handed out on the handles socket but not attached"
        ),
    )
    handles_timeout_s: float = field(
        default=2.0,
        metadata=_about(
            _SECONDS,
            "a handles-socket peer must send its whole request within this; slower ones are"
            " dropped (each connection is served apart: none delays another)",
        ),
    )
    max_handles_connections: int = field(
        default=64,
        metadata=_about(
            _INT, "handles-socket connections served at once; more wait to be accepted"
        ),
    )
    lease_alignment: Bytes = field(
        default=Bytes(2 * _MiB), metadata=_about(_SIZE, "alignment of every lease (a power of two)")
    )
    chunk_size: Bytes = field(
        default=Bytes(64 * _MiB),
        metadata=_about(
            _SIZE,
            "size of one chunk of either pool (a multiple of lease_alignment): a lease is whole"
            " chunks, and each chunk is one fd; pool sizes are rounded down to whole chunks",
        ),
    )
    attach_timeout_s: float = field(
        default=5.0,
        metadata=_about(
            _SECONDS, "a lease handed out but not Attached over gRPC within this is reclaimed"
        ),
    )
    heartbeat_interval_s: float = field(
        default=1.0, metadata=_about(_SECONDS, "interval between heartbeats on a session stream")
    )
    heartbeat_timeout_s: float = field(
        default=15.0,
        metadata=_about(
            _SECONDS, "a session silent for this long is ended and its lease reclaimed"
        ),
    )
    trace_chunk_events: int = field(
        default=4096, metadata=_about(_INT, "events per trace chunk on the session stream")
    )
    max_trace_events: int = field(
        default=1_000_000,
        metadata=_about(_INT, "trace events kept per session; older ones are dropped beyond it"),
    )
    max_trace_name_bytes: Bytes = field(
        default=Bytes(4 * _MiB),
        metadata=_about(
            _SIZE,
            "bytes of op names kept per session; a trace chunk whose names pass it is refused",
        ),
    )
    shutdown_grace_s: float = field(
        default=2.0, metadata=_about(_SECONDS, "time sessions get to finish when the daemon stops")
    )
    log_format: str = field(
        default="text", metadata=_about(_choice("text", "json"), "log line format")
    )
    log_level: str = field(
        default="info",
        metadata=_about(_choice("debug", "info", "warning", "error"), "lowest level logged"),
    )
    metrics_address: str = field(
        default="127.0.0.1:9477",
        metadata=_about(
            _ADDRESS,
            "host:port of the Prometheus endpoint (/metrics); port 0 takes any free port (the"
            ' daemon.ready log line says which); "" disables it',
        ),
    )
    metrics_sessions: str = field(
        default="on",
        metadata=_about(
            _choice("on", "off"),
            "on: the metrics endpoint has series per session, labelled with its id and job"
            " name; off: only the daemon's totals, no session's id, job or usage",
        ),
    )
    gpu: int = field(default=0, metadata=_about(_INT, "index of the GPU this daemon manages"))
    cuda_mode: str = field(
        default="auto",
        metadata=_about(
            _choice("auto", "vmm", "ipc"),
            "how the cuda backend shares device memory: vmm = an fd per chunk, sessions isolated;"
            " ipc = legacy IPC handles, NO isolation between sessions; auto = vmm when the GPU"
            " can export fds, else ipc",
        ),
    )
    plan_after_iterations: int = field(
        default=3,
        metadata=_about(
            _INT, "plan a session once it has marked this many iterations (step); 0 never plans"
        ),
    )
    plan_time_limit_s: float = field(
        default=5.0, metadata=_about(_SECONDS, "time budget of one placement solve")
    )
    plan_deadline_s: float = field(
        default=30.0,
        metadata=_about(
            _SECONDS,
            "time budget of a whole plan, from the trace to the stream: no new round of"
            " refitting or paged layout starts past it, and the schedule search and placement"
            " solve under way stop there (the latter after its first greedy run); the trace's"
            " extraction and the plan's check are bounded by max_plan_allocations instead",
        ),
    )
    max_plan_allocations: int = field(
        default=30_000,
        metadata=_about(
            _INT,
            "the most allocations an iteration may make to be planned (planning time grows"
            " with them); a session whose iteration makes more is told so and runs unplanned",
        ),
    )
    planner_processes: int = field(
        default=3,
        metadata=_about(
            _INT,
            "plans made at once, each in a process of its own (the first started at the first"
            " step a session marks, the second once a plan on the first, its first excepted,"
            " has run a quarter of a second, the others when a plan needs them); one uid's plans"
            " use all but one of them at most, so another uid's plan does not wait for them",
        ),
    )
    max_plan_shapes: int = field(
        default=8,
        metadata=_about(
            _INT,
            "the most iteration shapes (step(shape=)) a session gets a plan for at once; a"
            " shape stepped into past them forgets the least recently stepped one",
        ),
    )
    plan_cache_dir: Path = field(
        default=Path("/var/cache/tidalpool"),
        metadata=_about(
            _PATH, "plans are kept here by iteration signature (a warm start for the next run)"
        ),
    )
    plan_cache_bytes: Bytes = field(
        default=Bytes(256 * _MiB),
        metadata=_about(
            _SIZE,
            "the most the plans in plan_cache_dir take on disk: past it, the least recently"
            " used go",
        ),
    )

    def __post_init__(self) -> None:
        problem = next(_problems(self), None)
        if problem is not None:
            name, text, other = problem
            related = None if other is None else (other, DIRECT_SOURCE, getattr(self, other))
            raise SettingsError(name, DIRECT_SOURCE, getattr(self, name), text, related=related)

    @property
    def device_chunks(self) -> int:
        """Chunks of the device pool: device_pool rounded down to whole chunks."""
        return self.device_pool // self.chunk_size

    @property
    def host_chunks(self) -> int:
        """Chunks of the host pool: host_pool rounded down to whole chunks."""
        return self.host_pool // self.chunk_size

    @property
    def grpc_socket(self) -> Path:
        """The gRPC (Attach, Session stream, Admin) Unix socket."""
        return self.socket_dir / GRPC_SOCKET

    @property
    def handles_socket(self) -> Path:
        """The Unix socket that checks the peer and passes lease fds."""
        return self.socket_dir / HANDLES_SOCKET

    @property
    def admin_socket(self) -> Path:
        """The gRPC socket of the Admin service (and health), for operators."""
        return self.socket_dir / ADMIN_SOCKET


_FIELDS = dataclasses.fields(Settings)
_NAMES = tuple(f.name for f in _FIELDS)


def _kind(f: dataclasses.Field[Any]) -> _Kind:
    kind = f.metadata["kind"]
    assert isinstance(kind, _Kind)
    return kind


def _address_ok(address: str) -> bool:
    if address == "":
        return True
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        return False
    return ":" not in host or (host.startswith("[") and host.endswith("]"))


def _problems(s: Settings) -> Iterator[tuple[str, str, str | None]]:
    """Yield (setting, problem, related setting or None) for every rule `s` breaks.

    A problem between two settings names both in its text, so either may be blamed for it.
    """
    for f in _FIELDS:
        kind, value = _kind(f), getattr(s, f.name)
        if not kind.check(value):
            yield f.name, f"must be {kind.expect}", None
            return
        if kind.choices and value not in kind.choices:
            yield f.name, f"must be one of {', '.join(kind.choices)}", None
    alignment_ok = s.lease_alignment > 0 and not s.lease_alignment & (s.lease_alignment - 1)
    chunk_ok = s.chunk_size > 0 and (not alignment_ok or s.chunk_size % s.lease_alignment == 0)
    if not chunk_ok:
        yield (
            "chunk_size",
            "chunk_size must be a positive multiple of lease_alignment",
            "lease_alignment",
        )
    for pool in ("device_pool", "host_pool"):
        if getattr(s, pool) <= 0:
            yield pool, "must be greater than 0", None
        elif chunk_ok and getattr(s, pool) < s.chunk_size:
            yield pool, f"{pool} must hold at least one chunk of chunk_size", "chunk_size"
    for lease, pool in (
        ("default_device_lease", "device_pool"),
        ("default_host_lease", "host_pool"),
    ):
        if getattr(s, lease) <= 0:
            yield lease, "must be greater than 0", None
        elif getattr(s, lease) > getattr(s, pool):
            yield lease, f"{lease} must not exceed {pool}", pool
        elif chunk_ok and -(-getattr(s, lease) // s.chunk_size) > getattr(s, pool) // s.chunk_size:
            yield lease, f"{lease} in whole chunks must not exceed {pool} in whole chunks", pool
    if not 0 <= s.socket_mode <= 0o777:
        yield "socket_mode", 'must be a mode from 0000 to 0777 (write it as a string: "0660")', None
    if any(gid < 0 for gid in s.allowed_gids):
        yield "allowed_gids", "gids must not be negative", None
    if s.max_sessions < 1:
        yield "max_sessions", "must be at least 1", None
    if not 0 <= s.admin_socket_mode <= 0o777:
        yield "admin_socket_mode", 'must be a mode from 0000 to 0777 (as a string: "0600")', None
    if s.lease_alignment <= 0 or s.lease_alignment & (s.lease_alignment - 1):
        yield "lease_alignment", "must be a power of two", None
    for name in ("max_pending_per_uid", "max_handles_connections"):
        if getattr(s, name) < 1:
            yield name, "must be at least 1", None
    if not (math.isfinite(s.handles_timeout_s) and s.handles_timeout_s > 0):
        yield "handles_timeout_s", "must be a finite number of seconds greater than 0", None
    if s.max_trace_name_bytes < 0:
        yield "max_trace_name_bytes", "must not be negative", None
    if s.default_device_floor < 0:
        yield "default_device_floor", "must not be negative", None
    elif s.default_device_floor > s.device_pool:
        yield (
            "default_device_floor",
            "default_device_floor must not exceed device_pool",
            "device_pool",
        )
    for name in (
        "attach_timeout_s",
        "heartbeat_interval_s",
        "heartbeat_timeout_s",
        "quota_deadline_s",
    ):
        if not (math.isfinite(getattr(s, name)) and getattr(s, name) > 0):
            yield name, "must be a finite number of seconds greater than 0", None
    if s.heartbeat_timeout_s <= s.heartbeat_interval_s:
        yield (
            "heartbeat_timeout_s",
            "heartbeat_timeout_s must exceed heartbeat_interval_s",
            "heartbeat_interval_s",
        )
    if not (math.isfinite(s.shutdown_grace_s) and s.shutdown_grace_s >= 0):
        yield "shutdown_grace_s", "must be a finite number of seconds, 0 or more", None
    if s.plan_after_iterations < 0:
        yield "plan_after_iterations", "must be 0 (never plan) or more", None
    if not (math.isfinite(s.plan_time_limit_s) and s.plan_time_limit_s > 0):
        yield "plan_time_limit_s", "must be a finite number of seconds greater than 0", None
    if not (math.isfinite(s.plan_deadline_s) and s.plan_deadline_s >= s.plan_time_limit_s):
        yield (
            "plan_deadline_s",
            "plan_deadline_s must be a finite number of seconds, at least plan_time_limit_s",
            "plan_time_limit_s",
        )
    if s.max_plan_allocations < 1:
        yield "max_plan_allocations", "must be at least 1", None
    if not 1 <= s.planner_processes <= 64:
        yield "planner_processes", "must be between 1 and 64", None
    if not 1 <= s.max_plan_shapes <= 1024:
        yield "max_plan_shapes", "must be between 1 and 1024", None
    if s.plan_cache_bytes <= 0:
        yield "plan_cache_bytes", "must be positive", None
    if not 1 <= s.trace_chunk_events <= 1_000_000:
        yield "trace_chunk_events", "must be between 1 and 1000000", None
    if s.max_trace_events < s.trace_chunk_events:
        yield (
            "max_trace_events",
            "max_trace_events must be at least trace_chunk_events",
            "trace_chunk_events",
        )
    if not _address_ok(s.metrics_address):
        yield "metrics_address", 'must be host:port (IPv6 as [::1]:9477) or "" to disable', None
    if s.gpu < 0:
        yield "gpu", "must not be negative", None


def _read_toml(path: Path, source: str) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise SettingsError("config", source, str(path), "config file does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise SettingsError("config", source, str(path), f"not valid TOML: {err}") from None
    except OSError as err:
        problem = f"cannot read config file: {err.strerror or err}"
        raise SettingsError("config", source, str(path), problem) from None
    for key, value in data.items():
        if key not in _NAMES:
            problem = f"unknown key; valid keys: {', '.join(_NAMES)}"
            raise SettingsError(key, f"config file {path} key {key}", value, problem)
    return data


def _default_lease(default: Bytes, pool: Any, chunk: Any) -> Bytes:
    """A default lease nobody set: the default, or the pool's whole chunks where that is less
    (a 512 MiB pool gets a 512 MiB default lease, not a refusal). A pool or chunk size that is
    not a size, or a pool without one whole chunk, is left for `Settings` to refuse by name."""
    if not (_is_int(pool) and _is_int(chunk)) or chunk <= 0 or pool < chunk:
        return default
    return Bytes(min(default, pool // chunk * chunk))


def _load(
    cli: Mapping[str, object], env: Mapping[str, str], config_path: Path | None, config_source: str
) -> Settings:
    values: dict[str, Any] = {f.name: f.default for f in _FIELDS}
    origin: dict[str, tuple[str, object]] = {f.name: (DEFAULT_SOURCE, f.default) for f in _FIELDS}

    def put(name: str, raw: object, source: str) -> None:
        try:
            values[name] = _kind(_FIELDS[_NAMES.index(name)]).parse(raw)
        except ValueError as err:
            raise SettingsError(name, source, raw, str(err)) from None
        origin[name] = (source, raw)

    known_env = {ENV_PREFIX + name.upper() for name in _NAMES} | {CONFIG_ENV}
    for var in sorted(env):
        if var.startswith(ENV_PREFIX) and var not in known_env:
            problem = f"unknown setting; valid variables: {', '.join(sorted(known_env))}"
            raise SettingsError(var, "environment", env[var], problem)
    for key in cli:
        if key not in _NAMES:
            raise SettingsError(key, "command line", cli[key], "unknown setting")

    if config_path is None and env.get(CONFIG_ENV, "").strip():
        config_path, config_source = Path(env[CONFIG_ENV].strip()), CONFIG_ENV
    if config_path is not None:
        for key, raw in _read_toml(Path(config_path), config_source).items():
            put(key, raw, f"config file {config_path} key {key}")
    for name in _NAMES:
        if ENV_PREFIX + name.upper() in env:
            put(name, env[ENV_PREFIX + name.upper()], ENV_PREFIX + name.upper())
    for name in _NAMES:
        if cli.get(name) is not None:
            put(name, cli[name], "--" + name.replace("_", "-"))

    for lease, pool in (
        ("default_device_lease", "device_pool"),
        ("default_host_lease", "host_pool"),
    ):
        if origin[lease][0] == DEFAULT_SOURCE:
            values[lease] = _default_lease(values[lease], values[pool], values["chunk_size"])
    try:
        return Settings(**values)
    except SettingsError as err:
        blamed, other = err.setting, None if err.related is None else err.related[0]
        if other is not None and origin[blamed][0] == DEFAULT_SOURCE != origin[other][0]:
            blamed, other = other, blamed  # blame the setting someone actually gave
        related = None if other is None else (other, *origin[other])
        raise SettingsError(blamed, *origin[blamed], err.problem, related=related) from None


def load_settings(
    cli: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    config_path: Path | None = None,
) -> Settings:
    """Merge CLI > environment > TOML file > defaults into a validated `Settings`.

    `cli` maps field names to values (None: not given); `env` is the environment to read
    (the caller passes os.environ); `config_path`, or else $TIDALPOOLD_CONFIG, names the TOML file.
    """
    return _load(cli or {}, env or {}, config_path, CONFIG_ARG_SOURCE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one --kebab-case option per setting (default None: not given) and --config PATH."""
    for f in _FIELDS:
        kind = _kind(f)
        doc = f"{f.metadata['doc']} (default: {kind.text(f.default)})"
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            default=None,
            metavar=kind.metavar,
            help=doc.replace("%", "%%"),
        )
    parser.add_argument(
        "--config",
        dest="config",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"TOML file whose top-level keys are setting names (default: ${CONFIG_ENV} if set)",
    )


def setting_options() -> frozenset[str]:
    """The command line's options that take a setting's value (`add_arguments`)."""
    return frozenset(["--config", *("--" + name.replace("_", "-") for name in _NAMES)])


def settings_from_args(ns: argparse.Namespace, env: Mapping[str, str]) -> Settings:
    """The `Settings` for options parsed by a parser that `add_arguments` set up."""
    cli = {name: getattr(ns, name, None) for name in _NAMES}
    config = getattr(ns, "config", None)
    return _load(cli, env, None if config is None else Path(config), "--config")


def describe(settings: Settings) -> dict[str, object]:
    """JSON-friendly settings (sizes as ints, paths as str, mode as "0660") for the startup log."""
    out = {f.name: _kind(f).show(getattr(settings, f.name)) for f in _FIELDS}
    out["grpc_socket"] = str(settings.grpc_socket)
    out["handles_socket"] = str(settings.handles_socket)
    out["admin_socket"] = str(settings.admin_socket)
    return out
