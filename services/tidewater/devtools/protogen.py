"""Generate the Python gRPC code in gen/ from protos/: the one command for it.

python -m tidewater.devtools.protogen            # regenerate gen/ in place
python -m tidewater.devtools.protogen --out DIR  # generate elsewhere (the staleness test)
"""

from __future__ import annotations

import argparse
import importlib.resources
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parents[3]
PROTO_ROOT = REPO_ROOT / "protos"
PACKAGE_DIR = Path("tidewater") / "v1"
INIT_TEXT = (
    '"""Generated gRPC code for package tidewater.v1 (python -m tidewater.devtools.protogen)."""\n'
)


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    return sorted((proto_root / PACKAGE_DIR).glob("*.proto"))


def generate(out_root: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Compile every proto into out_root/tidewater/v1 and return the files written.

    In two steps, so that the descriptors embedded in the code (what reflection serves) name
    every field's JSON name: `--python_out` keeps a field's json_name only where it is given,
    as protoc's descriptor set output gives it for every field. Without it grpcurl 1.8 prints
    the fields' proto names (`broker_id`), newer versions the JSON names (`brokerId`)."""
    out_dir = out_root / PACKAGE_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*_pb2*.py*"):
        stale.unlink()
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    sources = [str(p.relative_to(proto_root)) for p in proto_files(proto_root)]
    with tempfile.TemporaryDirectory() as scratch:
        descriptors = Path(scratch) / "tidewater.pb"
        _protoc(
            f"-I{proto_root}",
            f"-I{well_known}",
            "--include_imports",
            "--include_source_info",  # the comments the gRPC code's docstrings come from
            f"--descriptor_set_out={descriptors}",
            *sources,
        )
        _protoc(
            f"--descriptor_set_in={descriptors}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            *sources,
        )
    (out_dir / "__init__.py").write_text(INIT_TEXT)
    (out_dir / "py.typed").write_text("")
    return sorted(out_dir.iterdir())


def _protoc(*args: str) -> None:
    if protoc.main(["protoc", *args]) != 0:
        raise RuntimeError(f"protoc failed: protoc {' '.join(args)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "gen", help="output root")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
