"""Generate the gRPC Python code in ``edgespec/v1/`` from ``proto/`` (grpcio-tools).

    python -m edgespec.wire.protogen            # regenerate in place
    python -m edgespec.wire.protogen --out DIR  # generate elsewhere (the test compares the two)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
PROTOS = ["edgespec/v1/edgespec.proto"]


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *PROTOS]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out / "edgespec" / "v1").glob("edgespec_pb2*"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    files = generate(p.parse_args(argv).out)
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
