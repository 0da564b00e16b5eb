"""Settings: defaults, the four sources and their precedence, conversion, and every error's text."""

from __future__ import annotations

import argparse
import dataclasses
import grp
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from tidalcore.units import Bytes
from tidalpoold.settings import (
    Settings,
    SettingsError,
    add_arguments,
    describe,
    load_settings,
    settings_from_args,
)

GiB = 1024**3
MiB = 1024**2
ROOT_GROUP = grp.getgrgid(0).gr_name


def write_toml(tmp_path: Path, text: str, name: str = "tidalpoold.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def parse_cli(argv: list[str], env: dict[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(prog="tidalpoold")
    add_arguments(parser)
    return settings_from_args(parser.parse_args(argv), env or {})


# -- defaults --------------------------------------------------------------------------------------


def test_defaults() -> None:
    s = load_settings()
    assert s == Settings()
    assert s.backend == "sim"
    assert s.device_pool == 4 * GiB
    assert s.host_pool == 8 * GiB
    assert s.default_device_lease == 1 * GiB
    assert s.default_host_lease == 2 * GiB
    assert s.socket_dir == Path("/run/tidalpool")
    assert s.socket_mode == 0o660
    assert s.allowed_gids == ()
    assert s.max_sessions == 64
    assert s.lease_alignment == 2 * MiB
    assert s.chunk_size == 64 * MiB
    assert (s.device_chunks, s.host_chunks) == (64, 128)
    assert s.attach_timeout_s == 5.0
    assert s.heartbeat_interval_s == 1.0
    assert s.heartbeat_timeout_s == 15.0
    assert s.trace_chunk_events == 4096
    assert s.max_trace_events == 1_000_000
    assert s.shutdown_grace_s == 2.0
    assert s.log_format == "text"
    assert s.log_level == "info"
    assert s.metrics_address == "127.0.0.1:9477"
    assert s.gpu == 0
    assert s.cuda_mode == "auto"
    assert s.grpc_socket == Path("/run/tidalpool/tidalpool.sock")
    assert s.handles_socket == Path("/run/tidalpool/handles.sock")


def test_describe_is_json_friendly() -> None:
    d = describe(Settings(allowed_gids=(0, 5), socket_dir=Path("/tmp/tp")))
    assert d == {
        "backend": "sim",
        "device_pool": 4 * GiB,
        "host_pool": 8 * GiB,
        "default_device_lease": 1 * GiB,
        "default_host_lease": 2 * GiB,
        "default_device_floor": 0,
        "quota_deadline_s": 5.0,
        "socket_dir": "/tmp/tp",
        "socket_mode": "0660",
        "admin_socket_mode": "0600",
        "allowed_gids": [0, 5],
        "max_sessions": 64,
        "max_pending_per_uid": 8,
        "handles_timeout_s": 2.0,
        "max_handles_connections": 64,
        "lease_alignment": 2 * MiB,
        "chunk_size": 64 * MiB,
        "attach_timeout_s": 5.0,
        "heartbeat_interval_s": 1.0,
        "heartbeat_timeout_s": 15.0,
        "trace_chunk_events": 4096,
        "max_trace_events": 1_000_000,
        "max_trace_name_bytes": 4 * MiB,
        "shutdown_grace_s": 2.0,
        "log_format": "text",
        "log_level": "info",
        "metrics_address": "127.0.0.1:9477",
        "metrics_sessions": "on",
        "gpu": 0,
        "cuda_mode": "auto",
        "plan_after_iterations": 3,
        "plan_time_limit_s": 5.0,
        "plan_deadline_s": 30.0,
        "planner_processes": 3,
        "max_plan_allocations": 30_000,
        "max_plan_shapes": 8,
        "plan_cache_dir": "/var/cache/tidalpool",
        "plan_cache_bytes": 256 * MiB,
        "grpc_socket": "/tmp/tp/tidalpool.sock",
        "handles_socket": "/tmp/tp/handles.sock",
        "admin_socket": "/tmp/tp/admin.sock",
    }
    assert json.loads(json.dumps(d)) == d


def test_frozen() -> None:
    s = Settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.device_pool = Bytes(1)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.gpu = 1  # type: ignore[misc]
    assert s.device_pool == 4 * GiB and s.gpu == 0


def test_every_field_is_documented_in_help() -> None:
    parser = argparse.ArgumentParser(prog="tidalpoold")
    add_arguments(parser)
    actions = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(Settings):
        action = actions[f.name]
        assert action.option_strings == ["--" + f.name.replace("_", "-")]
        assert action.default is None
        assert action.help is not None and "(default: " in action.help
    assert actions["device_pool"].help == "size of the preallocated device pool (default: 4 GiB)"
    assert (
        actions["socket_mode"].help == "permission mode of both sockets, in octal (default: 0660)"
    )
    assert actions["config"].option_strings == ["--config"]
    parser.format_help()  # every help string survives argparse's % formatting


# -- each source alone -----------------------------------------------------------------------------


def test_environment_alone() -> None:
    s = load_settings(
        env={
            "TIDALPOOLD_BACKEND": "cuda",
            "TIDALPOOLD_DEVICE_POOL": "8GiB",
            "TIDALPOOLD_SOCKET_DIR": "/tmp/tp",
            "TIDALPOOLD_MAX_SESSIONS": "3",
            "TIDALPOOLD_ATTACH_TIMEOUT_S": "0.25",
            "TIDALPOOLD_METRICS_ADDRESS": "",
            "TIDALPOOLD_LOG_LEVEL": "DEBUG",
            "HOME": "/root",  # other variables are none of our business
        }
    )
    assert s == Settings(
        backend="cuda",
        device_pool=Bytes(8 * GiB),
        socket_dir=Path("/tmp/tp"),
        max_sessions=3,
        attach_timeout_s=0.25,
        metrics_address="",
        log_level="debug",
    )
    assert s.grpc_socket == Path("/tmp/tp/tidalpool.sock")


def test_toml_alone(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        'device_pool = "2GiB"\n'
        "host_pool = 3221225472\n"
        'socket_dir = "/srv/tp"\n'
        "heartbeat_timeout_s = 30\n"
        "trace_chunk_events = 512\n"
        'log_format = "json"\n'
        "gpu = 3\n",
    )
    s = load_settings(config_path=path)
    assert s == Settings(
        device_pool=Bytes(2 * GiB),
        host_pool=Bytes(3 * GiB),
        socket_dir=Path("/srv/tp"),
        heartbeat_timeout_s=30.0,
        trace_chunk_events=512,
        log_format="json",
        gpu=3,
    )
    assert isinstance(s.heartbeat_timeout_s, float)


def test_cli_mapping_alone() -> None:
    s = load_settings(
        cli={"device_pool": "1GiB", "max_sessions": 2, "gpu": "1", "host_pool": None},
    )
    assert s == Settings(device_pool=Bytes(1 * GiB), max_sessions=2, gpu=1)


def test_config_from_environment(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "max_sessions = 7\n")
    assert load_settings(env={"TIDALPOOLD_CONFIG": str(path)}).max_sessions == 7


def test_config_path_argument_beats_environment_config(tmp_path: Path) -> None:
    chosen = write_toml(tmp_path, "max_sessions = 7\n", "chosen.toml")
    ignored = write_toml(tmp_path, "max_sessions = 9\n", "ignored.toml")
    s = load_settings(env={"TIDALPOOLD_CONFIG": str(ignored)}, config_path=chosen)
    assert s.max_sessions == 7


def test_empty_config_env_means_no_file() -> None:
    assert load_settings(env={"TIDALPOOLD_CONFIG": ""}) == Settings()


# -- precedence ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "values", "expected"),
    [
        ("device_pool", ("1GiB", "2GiB", "3GiB"), (1 * GiB, 2 * GiB, 3 * GiB, 4 * GiB)),
        (
            "socket_dir",
            ("/a", "/b", "/c"),
            (Path("/a"), Path("/b"), Path("/c"), Path("/run/tidalpool")),
        ),
        ("log_level", ("error", "warning", "debug"), ("error", "warning", "debug", "info")),
        ("attach_timeout_s", ("1.5", "2.5", "3.5"), (1.5, 2.5, 3.5, 5.0)),
    ],
)
def test_precedence_cli_env_toml_default(
    tmp_path: Path, name: str, values: tuple[str, str, str], expected: tuple[object, ...]
) -> None:
    cli_value, env_value, toml_value = values
    want_cli, want_env, want_toml, want_default = expected
    path = write_toml(tmp_path, f"{name} = {json.dumps(toml_value)}\n")
    env = {"TIDALPOOLD_" + name.upper(): env_value}
    cli: dict[str, object] = {name: cli_value}
    assert getattr(load_settings(cli=cli, env=env, config_path=path), name) == want_cli
    assert getattr(load_settings(cli={name: None}, env=env, config_path=path), name) == want_env
    assert getattr(load_settings(env={}, config_path=path), name) == want_toml
    assert getattr(load_settings(), name) == want_default


def test_precedence_mixes_fields(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'device_pool = "1GiB"\nhost_pool = "1GiB"\ngpu = 1\n')
    env = {"TIDALPOOLD_HOST_POOL": "4GiB", "TIDALPOOLD_GPU": "2", "TIDALPOOLD_CONFIG": str(path)}
    s = load_settings(cli={"gpu": "5"}, env=env)
    assert (s.device_pool, s.host_pool, s.gpu, s.max_sessions) == (1 * GiB, 4 * GiB, 5, 64)


# -- conversions -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("4GiB", 4 * GiB),
        ("512MB", 512_000_000),
        ("512 MiB", 512 * MiB),
        ("1.5GiB", 3 * GiB // 2),
        ("67108864", 64 * MiB),
    ],
)
def test_human_sizes(text: str, nbytes: int) -> None:
    env = {"TIDALPOOLD_DEVICE_POOL": text, "TIDALPOOLD_DEFAULT_DEVICE_LEASE": "1MiB"}
    assert load_settings(env=env).device_pool == nbytes


@pytest.mark.parametrize(
    ("raw", "mode"), [("0660", 0o660), ("660", 0o660), ("0o640", 0o640), ("0600", 0o600)]
)
def test_octal_socket_mode_from_text(raw: str, mode: int) -> None:
    assert load_settings(env={"TIDALPOOLD_SOCKET_MODE": raw}).socket_mode == mode
    assert load_settings(cli={"socket_mode": raw}).socket_mode == mode


def test_socket_mode_as_int(tmp_path: Path) -> None:
    assert load_settings(config_path=write_toml(tmp_path, "socket_mode = 0o600\n")).socket_mode == (
        0o600
    )
    assert load_settings(
        config_path=write_toml(tmp_path, 'socket_mode = "0640"\n')
    ).socket_mode == (0o640)
    assert load_settings(cli={"socket_mode": 0o644}).socket_mode == 0o644


def test_group_names_resolved(tmp_path: Path) -> None:
    env = {"TIDALPOOLD_ALLOWED_GIDS": f"{ROOT_GROUP}, 1000,"}
    assert load_settings(env=env).allowed_gids == (0, 1000)
    path = write_toml(tmp_path, f'allowed_gids = ["{ROOT_GROUP}", 44]\n')
    assert load_settings(config_path=path).allowed_gids == (0, 44)
    assert load_settings(cli={"allowed_gids": ROOT_GROUP}).allowed_gids == (0,)
    assert load_settings(env={"TIDALPOOLD_ALLOWED_GIDS": ""}).allowed_gids == ()


def test_unknown_group() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(env={"TIDALPOOLD_ALLOWED_GIDS": f"{ROOT_GROUP},no-such-group-xyz"})
    assert str(info.value) == (
        "allowed_gids: unknown group 'no-such-group-xyz' "
        f"(got '{ROOT_GROUP},no-such-group-xyz' from TIDALPOOLD_ALLOWED_GIDS)"
    )
    assert info.value.setting == "allowed_gids"
    assert info.value.source == "TIDALPOOLD_ALLOWED_GIDS"
    assert info.value.value == f"{ROOT_GROUP},no-such-group-xyz"


def test_metrics_address_forms() -> None:
    for address in ("", "0.0.0.0:0", "[::1]:9477", "localhost:65535"):
        assert load_settings(cli={"metrics_address": address}).metrics_address == address


def test_cuda_mode_from_each_source(tmp_path: Path) -> None:
    assert load_settings(env={"TIDALPOOLD_CUDA_MODE": " VMM "}).cuda_mode == "vmm"
    path = write_toml(tmp_path, 'cuda_mode = "ipc"\n')
    assert load_settings(config_path=path).cuda_mode == "ipc"
    assert parse_cli(["--cuda-mode", "auto"], {"TIDALPOOLD_CUDA_MODE": "ipc"}).cuda_mode == "auto"


def test_cuda_mode_reaches_the_cuda_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    import tidalpoold.backends.cuda as cuda
    from tidalpoold.backends import open_backend

    made: list[tuple[tuple[object, ...], dict[str, object]]] = []

    def fake_backend(*args: object, **kwargs: object) -> str:
        made.append((args, kwargs))
        return "backend"

    monkeypatch.setattr(cuda, "CudaBackend", fake_backend)
    assert open_backend("cuda", 4 * MiB, 8 * MiB, 2 * MiB, gpu=1, cuda_mode="ipc") == "backend"
    assert made == [((4 * MiB, 8 * MiB, 2 * MiB), {"gpu": 1, "mode": "ipc"})]


# -- default leases on small pools -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("pools", "device_lease", "host_lease"),
    [
        ({"device_pool": "512MiB"}, 512 * MiB, 2 * GiB),
        ({"host_pool": "1GiB"}, 1 * GiB, 1 * GiB),
        ({"device_pool": "64MiB", "host_pool": "64MiB"}, 64 * MiB, 64 * MiB),
        ({"device_pool": "100MiB", "host_pool": "3GiB"}, 64 * MiB, 2 * GiB),  # whole chunks
        ({"device_pool": "8MiB", "host_pool": "6MiB", "chunk_size": "2MiB"}, 8 * MiB, 6 * MiB),
    ],
)
@pytest.mark.parametrize("source", ["cli", "env", "toml"])
def test_a_default_lease_nobody_set_fits_the_pool(
    tmp_path: Path, source: str, pools: dict[str, str], device_lease: int, host_lease: int
) -> None:
    if source == "cli":
        s = parse_cli([f"--{k.replace('_', '-')}={v}" for k, v in pools.items()])
    elif source == "env":
        s = load_settings(env={f"TIDALPOOLD_{k.upper()}": v for k, v in pools.items()})
    else:
        text = "".join(f'{k} = "{v}"\n' for k, v in pools.items())
        s = load_settings(config_path=write_toml(tmp_path, text))
    assert (s.default_device_lease, s.default_host_lease) == (device_lease, host_lease)
    assert describe(s)["default_device_lease"] == device_lease  # what the startup log says


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            ["--device-pool", "512MiB", "--default-device-lease", "1GiB"],
            {},
            "default_device_lease: default_device_lease must not exceed device_pool (got '1GiB'"
            " from --default-device-lease); device_pool is '512MiB' from --device-pool",
        ),
        (
            ["--host-pool", "1GiB"],
            {"TIDALPOOLD_DEFAULT_HOST_LEASE": "2GiB"},  # the default's value, but set
            "default_host_lease: default_host_lease must not exceed host_pool (got '2GiB'"
            " from TIDALPOOLD_DEFAULT_HOST_LEASE); host_pool is '1GiB' from --host-pool",
        ),
    ],
)
def test_a_lease_set_larger_than_the_pool_is_still_refused(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(SettingsError) as info:
        parse_cli(argv, env)
    assert str(info.value) == message


def test_the_help_says_a_default_lease_fits_the_pool(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="tidalpoold")
    add_arguments(parser)
    parser.print_help()
    text = " ".join(capsys.readouterr().out.split())
    assert "asks for 0 (when not set: at most the device pool, in whole chunks," in text
    assert "asks for 0 (when not set: at most the host pool, in whole chunks," in text


# -- errors, each naming its setting, source and value ---------------------------------------------

# (setting, bad value as text, problem, what follows the "(got ...)" part)
INVALID = [
    ("backend", "rocm", "must be one of sim, cuda", ""),
    ("device_pool", "0", "must be greater than 0", ""),
    (
        "device_pool",
        "4XB",
        "unknown size unit 'XB' in '4XB' (accepted: B; k, m, g, t, Ki, Mi, Gi, Ti, KiB, MiB,"
        " GiB, TiB (powers of 1024); kB, MB, GB, TB (powers of 1000); any case)",
        "",
    ),
    ("host_pool", "0B", "must be greater than 0", ""),
    ("default_device_lease", "0", "must be greater than 0", ""),
    (
        "default_host_lease",
        "9GiB",
        "default_host_lease must not exceed host_pool",
        "; host_pool is 8589934592 from default",
    ),
    (
        "default_device_lease",
        "5GiB",
        "default_device_lease must not exceed device_pool",
        "; device_pool is 4294967296 from default",
    ),
    ("socket_dir", "", "expected a non-empty path", ""),
    ("socket_mode", "0999", "expected an octal permission mode such as 0660", ""),
    (
        "socket_mode",
        "1777",
        'must be a mode from 0000 to 0777 (write it as a string: "0660")',
        "",
    ),
    ("allowed_gids", "-1", "unknown group '-1'", ""),
    ("max_sessions", "0", "must be at least 1", ""),
    ("max_sessions", "many", "expected a whole number", ""),
    ("lease_alignment", "3MiB", "must be a power of two", ""),
    ("lease_alignment", "0", "must be a power of two", ""),
    (
        "chunk_size",
        "3MiB",
        "chunk_size must be a positive multiple of lease_alignment",
        "; lease_alignment is 2097152 from default",
    ),
    (
        "chunk_size",
        "0",
        "chunk_size must be a positive multiple of lease_alignment",
        "; lease_alignment is 2097152 from default",
    ),
    (
        "device_pool",
        "32MiB",
        "device_pool must hold at least one chunk of chunk_size",
        "; chunk_size is 67108864 from default",
    ),
    (
        "chunk_size",
        "16GiB",
        "device_pool must hold at least one chunk of chunk_size",
        "; device_pool is 4294967296 from default",
    ),
    ("attach_timeout_s", "0", "must be a finite number of seconds greater than 0", ""),
    ("attach_timeout_s", "nan", "must be a finite number of seconds greater than 0", ""),
    ("attach_timeout_s", "soon", "expected a number of seconds", ""),
    ("heartbeat_interval_s", "-1", "must be a finite number of seconds greater than 0", ""),
    ("heartbeat_timeout_s", "inf", "must be a finite number of seconds greater than 0", ""),
    (
        "heartbeat_timeout_s",
        "0.5",
        "heartbeat_timeout_s must exceed heartbeat_interval_s",
        "; heartbeat_interval_s is 1.0 from default",
    ),
    (
        "heartbeat_interval_s",
        "30",
        "heartbeat_timeout_s must exceed heartbeat_interval_s",
        "; heartbeat_timeout_s is 15.0 from default",
    ),
    ("shutdown_grace_s", "-1", "must be a finite number of seconds, 0 or more", ""),
    ("trace_chunk_events", "0", "must be between 1 and 1000000", ""),
    ("trace_chunk_events", "1000001", "must be between 1 and 1000000", ""),
    (
        "max_trace_events",
        "100",
        "max_trace_events must be at least trace_chunk_events",
        "; trace_chunk_events is 4096 from default",
    ),
    ("log_format", "xml", "must be one of text, json", ""),
    ("log_level", "verbose", "must be one of debug, info, warning, error", ""),
    (
        "metrics_address",
        "localhost",
        'must be host:port (IPv6 as [::1]:9477) or "" to disable',
        "",
    ),
    ("metrics_address", "::1:9477", 'must be host:port (IPv6 as [::1]:9477) or "" to disable', ""),
    ("metrics_address", "h:99999", 'must be host:port (IPv6 as [::1]:9477) or "" to disable', ""),
    ("gpu", "-1", "must not be negative", ""),
    ("cuda_mode", "rdma", "must be one of auto, vmm, ipc", ""),
    ("cuda_mode", "", "must be one of auto, vmm, ipc", ""),
]


def via_env(tmp_path: Path, name: str, value: str) -> tuple[Callable[[], Settings], str]:
    var = "TIDALPOOLD_" + name.upper()
    return (lambda: load_settings(env={var: value})), var


def via_toml(tmp_path: Path, name: str, value: str) -> tuple[Callable[[], Settings], str]:
    path = write_toml(tmp_path, f"{name} = {json.dumps(value)}\n")
    return (lambda: load_settings(config_path=path)), f"config file {path} key {name}"


def via_cli(tmp_path: Path, name: str, value: str) -> tuple[Callable[[], Settings], str]:
    option = "--" + name.replace("_", "-")
    return (lambda: parse_cli([f"{option}={value}"])), option


@pytest.mark.parametrize("source", [via_env, via_toml, via_cli], ids=["env", "toml", "cli"])
@pytest.mark.parametrize(("name", "value", "problem", "tail"), INVALID)
def test_invalid_value_names_setting_source_and_value(
    tmp_path: Path,
    source: Callable[[Path, str, str], tuple[Callable[[], Settings], str]],
    name: str,
    value: str,
    problem: str,
    tail: str,
) -> None:
    load, where = source(tmp_path, name, value)
    with pytest.raises(SettingsError) as info:
        load()
    assert str(info.value) == f"{name}: {problem} (got {value!r} from {where}){tail}"
    assert (info.value.setting, info.value.source, info.value.value) == (name, where, value)
    assert isinstance(info.value, ValueError)


def test_related_setting_from_another_source(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'host_pool = "1GiB"\n')
    with pytest.raises(SettingsError) as info:
        load_settings(env={"TIDALPOOLD_DEFAULT_HOST_LEASE": "2GiB"}, config_path=path)
    assert str(info.value) == (
        "default_host_lease: default_host_lease must not exceed host_pool "
        f"(got '2GiB' from TIDALPOOLD_DEFAULT_HOST_LEASE); host_pool is '1GiB' from config file "
        f"{path} key host_pool"
    )
    assert info.value.related == ("host_pool", f"config file {path} key host_pool", "1GiB")


def test_toml_types_checked(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "device_pool = [1]\n")
    with pytest.raises(SettingsError) as info:
        load_settings(config_path=path)
    assert str(info.value) == (
        "device_pool: expected a size such as 4GiB, 512MB or a number of bytes "
        f"(got [1] from config file {path} key device_pool)"
    )
    path = write_toml(tmp_path, "allowed_gids = [-1]\n")
    with pytest.raises(SettingsError) as info:
        load_settings(config_path=path)
    assert str(info.value) == (
        "allowed_gids: gids must not be negative "
        f"(got [-1] from config file {path} key allowed_gids)"
    )
    path = write_toml(tmp_path, "socket_mode = 660\n")
    with pytest.raises(SettingsError) as info:
        load_settings(config_path=path)
    assert str(info.value) == (
        'socket_mode: must be a mode from 0000 to 0777 (write it as a string: "0660") '
        f"(got 660 from config file {path} key socket_mode)"
    )


def test_direct_construction_is_validated() -> None:
    with pytest.raises(SettingsError) as info:
        Settings(lease_alignment=3)  # type: ignore[arg-type]
    assert str(info.value) == "lease_alignment: must be a power of two (got 3 from Settings())"
    with pytest.raises(SettingsError) as info:
        Settings(device_pool="4GiB")  # type: ignore[arg-type]
    assert str(info.value) == (
        "device_pool: must be a whole number of bytes (got '4GiB' from Settings())"
    )


def test_unknown_toml_key(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'device_pool = "1GiB"\ndevice_pol = "2GiB"\n')
    with pytest.raises(SettingsError) as info:
        load_settings(config_path=path)
    names = ", ".join(f.name for f in dataclasses.fields(Settings))
    assert str(info.value) == (
        f"device_pol: unknown key; valid keys: {names} "
        f"(got '2GiB' from config file {path} key device_pol)"
    )


def test_toml_table_is_an_unknown_key(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[daemon]\ngpu = 1\n")
    with pytest.raises(SettingsError) as info:
        load_settings(config_path=path)
    assert info.value.setting == "daemon"
    assert info.value.source == f"config file {path} key daemon"


def test_invalid_toml(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "device_pool = \n")
    with pytest.raises(SettingsError) as info:
        load_settings(config_path=path)
    assert str(info.value).startswith("config: not valid TOML: ")
    assert str(info.value).endswith(f"(got {str(path)!r} from config_path argument)")


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    with pytest.raises(SettingsError) as info:
        load_settings(config_path=missing)
    assert str(info.value) == (
        f"config: config file does not exist (got {str(missing)!r} from config_path argument)"
    )
    with pytest.raises(SettingsError) as info:
        load_settings(env={"TIDALPOOLD_CONFIG": str(missing)})
    assert str(info.value) == (
        f"config: config file does not exist (got {str(missing)!r} from TIDALPOOLD_CONFIG)"
    )
    with pytest.raises(SettingsError) as info:
        parse_cli(["--config", str(missing)])
    assert str(info.value) == (
        f"config: config file does not exist (got {str(missing)!r} from --config)"
    )


def test_unknown_environment_variable() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(env={"TIDALPOOLD_DEVICEPOOL": "1GiB"})
    assert info.value.setting == "TIDALPOOLD_DEVICEPOOL"
    assert info.value.source == "environment"
    assert str(info.value).startswith(
        "TIDALPOOLD_DEVICEPOOL: unknown setting; valid variables: TIDALPOOLD_ADMIN_SOCKET_MODE, "
    )
    assert "TIDALPOOLD_DEVICE_POOL, " in str(info.value)


def test_unknown_cli_key() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(cli={"device_pol": "1GiB"})
    assert str(info.value) == "device_pol: unknown setting (got '1GiB' from command line)"


# -- argparse --------------------------------------------------------------------------------------


def test_argparse_defaults_are_not_given() -> None:
    assert parse_cli([]) == Settings()


def test_argparse_round_trip(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'host_pool = "16GiB"\nmax_sessions = 8\n')
    env = {"TIDALPOOLD_MAX_SESSIONS": "9", "TIDALPOOLD_GPU": "2"}
    s = parse_cli(
        [
            "--config",
            str(path),
            "--backend",
            "cuda",
            "--device-pool",
            "8GiB",
            "--socket-dir",
            str(tmp_path),
            "--socket-mode",
            "0600",
            "--allowed-gids",
            f"{ROOT_GROUP},7",
            "--heartbeat-timeout-s",
            "2.5",
            "--metrics-address",
            "",
            "--gpu",
            "1",
        ],
        env,
    )
    assert s == Settings(
        backend="cuda",
        device_pool=Bytes(8 * GiB),
        host_pool=Bytes(16 * GiB),
        socket_dir=tmp_path,
        socket_mode=0o600,
        allowed_gids=(0, 7),
        max_sessions=9,
        heartbeat_timeout_s=2.5,
        metrics_address="",
        gpu=1,
    )
    assert s.handles_socket == tmp_path / "handles.sock"


def test_settings_from_args_ignores_foreign_attributes() -> None:
    parser = argparse.ArgumentParser(prog="tidalpoold")
    add_arguments(parser)
    parser.add_argument("--verbose", action="store_true")
    ns = parser.parse_args(["--verbose", "--max-sessions", "4"])
    assert settings_from_args(ns, {}).max_sessions == 4
