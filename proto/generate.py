"""Generate the Python stubs of proto/tidalpool/v1 into client/tidalpool/v1.

    python proto/generate.py            # write the stubs into the client package
    python proto/generate.py --out DIR  # write them under DIR instead (tests compare)

The stubs are committed so that `pip install .` needs no protoc; a unit test
regenerates them and fails when they differ from the committed files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
CLIENT_ROOT = ROOT / "client"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "tidalpool" / "v1").glob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) and return the files it wrote."""
    import grpc_tools
    from grpc_tools import protoc  # dev dependency

    include = Path(grpc_tools.__file__).parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed on " + " ".join(args[4:]))
    return sorted((out / "tidalpool" / "v1").glob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=CLIENT_ROOT)
    written = generate(parser.parse_args().out)
    print("\n".join(str(p) for p in written), file=sys.stderr)


if __name__ == "__main__":
    main()
