"""Generate the Python stubs for every .proto under protos/ into the source tree.

Usage: python scripts/generate_protos.py
The stubs land beside the package they belong to (protos/splitserve/engine/v1/x.proto ->
splitserve/engine/v1/x_pb2.py, x_pb2.pyi, x_pb2_grpc.py) and are committed, so a fresh clone imports them
without grpcio-tools. tests/test_protos.py fails when a committed stub no longer matches its .proto.
"""

from __future__ import annotations

import sys
from importlib.resources import files
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def proto_files() -> list[Path]:
    """Every .proto under protos/, sorted, as paths relative to protos/."""
    return sorted(p.relative_to(PROTO_ROOT) for p in PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path = ROOT) -> None:
    """Run protoc (bundled with grpcio-tools) over every .proto, writing stubs under out_dir.

    Raises:
        RuntimeError: protoc failed (its message is printed on stderr).
    """
    include = str(files("grpc_tools") / "_proto")
    for rel in proto_files():
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
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
