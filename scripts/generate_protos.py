"""Generate the Python stubs for every .proto under protos/ into the source tree.

Usage: python scripts/generate_protos.py
The stubs land in the package splitserve.stubs (protos/splitserve/engine/v1/x.proto ->
splitserve/stubs/engine/v1/x_pb2.py, x_pb2.pyi, x_pb2_grpc.py) and are committed, so a fresh clone imports them
without grpcio-tools. protoc sees each file at its virtual path splitserve/stubs/... (``-Isplitserve/stubs=``
protos/splitserve), so the stubs import each other as ``splitserve.stubs...``; the proto packages, and so the
services' names on the wire (``splitserve.engine.v1.EngineCore``), stay those the .proto files declare.
tests/test_protos.py fails when a committed stub no longer matches its .proto.
"""

from __future__ import annotations

import sys
from importlib.resources import files
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
# protos/splitserve/<x> is seen by protoc as splitserve/stubs/<x>: where its stubs go, and how they import.
PROTO_PACKAGE_DIR = PROTO_ROOT / "splitserve"
STUBS_VIRTUAL_DIR = Path("splitserve/stubs")


def proto_files() -> list[Path]:
    """Every .proto under protos/splitserve/, sorted, as protoc's virtual paths (splitserve/stubs/...)."""
    return sorted(STUBS_VIRTUAL_DIR / p.relative_to(PROTO_PACKAGE_DIR) for p in PROTO_PACKAGE_DIR.rglob("*.proto"))


def include_args() -> list[str]:
    """protoc's -I flags: the virtual mapping of protos/splitserve, then the well-known types of grpcio-tools."""
    return [f"-I{STUBS_VIRTUAL_DIR}={PROTO_PACKAGE_DIR}", f"-I{files('grpc_tools') / '_proto'}"]


def generate(out_dir: Path = ROOT) -> None:
    """Run protoc (bundled with grpcio-tools) over every .proto, writing stubs under out_dir.

    Raises:
        RuntimeError: protoc failed (its message is printed on stderr).
    """
    for rel in proto_files():
        args = [
            "protoc",
            *include_args(),
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(rel),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {rel}")
        package_dir = out_dir / rel.parent
        for parent in [package_dir, *package_dir.relative_to(out_dir).parents]:
            init = out_dir / parent / "__init__.py"
            if parent != Path(".") and not init.exists():
                init.write_text("")


if __name__ == "__main__":
    generate()
    print(f"generated stubs for {len(proto_files())} proto file(s)", file=sys.stderr)
