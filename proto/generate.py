"""Generate the Python stubs of proto/tidalpool/v1 into core/tidalcore/v1.

    python proto/generate.py            # write the stubs into the shared core
    python proto/generate.py --out DIR  # write them under DIR instead (tests compare)

The stubs are committed so that `pip install .` needs no protoc; a unit test
regenerates them and fails when they differ from the committed files. protoc names a
stub's package after its .proto's folder (`tidalpool/v1`); the stubs live in the shared
core's package, so their imports of one another are rewritten to `tidalcore.v1` (the wire
names, `tidalpool.v1.*`, are the .proto's `package` and do not change).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
CORE_ROOT = ROOT / "core"
STUB_PACKAGE = "tidalcore"  # the stubs are tidalcore.v1.*


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "tidalpool" / "v1").glob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) and return the files written under `out`."""
    import grpc_tools
    from grpc_tools import protoc  # dev dependency

    include = Path(grpc_tools.__file__).parent / "_proto"
    target = out / STUB_PACKAGE / "v1"
    target.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed on " + " ".join(args[6:]))
        for made in sorted((Path(tmp) / "tidalpool" / "v1").glob("*_pb2*.py*")):
            text = made.read_text().replace(
                "from tidalpool.v1 import", f"from {STUB_PACKAGE}.v1 import"
            )
            (target / made.name).write_text(text)
            written.append(target / made.name)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=CORE_ROOT)
    written = generate(parser.parse_args().out)
    print("\n".join(str(p) for p in written), file=sys.stderr)


if __name__ == "__main__":
    main()
