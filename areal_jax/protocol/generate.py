"""Regenerate the Python gRPC stubs from ``protos/``: ``python -m areal_jax.protocol.generate``.

The ``-I`` root is ``protos/``, whose layout mirrors the package path, so the generated
``rollout_pb2_grpc.py`` imports ``areal_jax.protocol.v1.rollout_pb2`` by its real name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_FILES = ("areal_jax/protocol/v1/rollout.proto",)


def generate(out_root: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` under ``out_root``; return them."""
    from grpc_tools import protoc

    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    for proto in PROTO_FILES:
        if not (proto_root / proto).is_file():
            raise FileNotFoundError(f"proto source {proto_root / proto} does not exist")
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    outputs = []
    for proto in PROTO_FILES:
        stem = out_root / proto.removesuffix(".proto")
        outputs += [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2.pyi"), Path(f"{stem}_pb2_grpc.py")]
    return outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
