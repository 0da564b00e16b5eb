"""The committed stubs in core/tidalcore/v1 are what proto/generate.py makes of the protos."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools (a dev dependency) is not installed")

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "core" / "tidalcore" / "v1"


def load_generate() -> ModuleType:
    """proto/ is not a package: load proto/generate.py by path, as a fresh module."""
    spec = importlib.util.spec_from_file_location(
        "tidalpool_proto_generate", REPO / "proto" / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def generate_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    # protoc reads relative .proto names from the working directory when they exist there:
    # work in an empty one so that only PROTO_ROOT is read.
    monkeypatch.chdir(tmp_path)
    return load_generate()


def committed_files() -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in COMMITTED.iterdir()
        if p.is_file() and p.name != "__init__.py"
    }


def generated_files(module: ModuleType, out: Path) -> dict[str, bytes]:
    written: list[Path] = module.generate(out)
    assert all(p.parent == out / "tidalcore" / "v1" for p in written)
    return {p.name: p.read_bytes() for p in written}


def test_generator_reads_the_repository_protos(generate_module: ModuleType) -> None:
    assert generate_module.PROTO_ROOT == REPO / "proto"
    assert [p.name for p in generate_module.proto_files()] == [
        "admin.proto",
        "common.proto",
        "handles.proto",
        "pool.proto",
    ]


def test_committed_stubs_match_the_protos(generate_module: ModuleType, tmp_path: Path) -> None:
    generated = generated_files(generate_module, tmp_path)
    committed = committed_files()
    assert sorted(generated) == sorted(committed)
    assert len(generated) == 12  # *_pb2.py, *_pb2.pyi and *_pb2_grpc.py of four protos
    stale = [name for name in sorted(generated) if generated[name] != committed[name]]
    assert stale == [], "regenerate with `python proto/generate.py`"


def test_a_changed_proto_is_caught(
    generate_module: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    protos = tmp_path / "proto"
    shutil.copytree(REPO / "proto" / "tidalpool", protos / "tidalpool")
    handles = protos / "tidalpool" / "v1" / "handles.proto"
    text = handles.read_text()
    marker = "  string job_name = 4;\n"
    assert text.count(marker) == 1
    handles.write_text(text.replace(marker, marker + "  uint32 priority = 6;\n"))
    monkeypatch.setattr(generate_module, "PROTO_ROOT", protos)

    generated = generated_files(generate_module, tmp_path / "out")
    committed = committed_files()
    assert sorted(generated) == sorted(committed)
    stale = [name for name in sorted(generated) if generated[name] != committed[name]]
    assert stale == ["handles_pb2.py", "handles_pb2.pyi"]
    assert b"priority" in generated["handles_pb2.pyi"]
    assert b"priority" not in committed["handles_pb2.pyi"]
