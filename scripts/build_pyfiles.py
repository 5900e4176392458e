"""Build `dist/txn_pyfiles.zip`: the project's code for `spark-submit --py-files`.

On a cluster the executors do not have this repository; Spark ships the zip
to every executor and puts it on their `sys.path` (and on the driver's), so
`import jobs`, `import schemas` and `import txn_core` work there too.

    python scripts/build_pyfiles.py            # prints the zip's path
    python scripts/build_pyfiles.py --out other.zip
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("txn_core", "jobs", "schemas")
DEFAULT_OUT = REPO / "dist" / "txn_pyfiles.zip"

# A fixed timestamp makes the zip byte-identical for identical sources, so a
# rebuild that changed nothing does not look like a new artefact to a deployer.
_EPOCH = (1980, 1, 1, 0, 0, 0)


def package_files(repo: Path = REPO) -> list[Path]:
    """The Python sources of the shipped packages, relative to `repo`, sorted."""
    files: list[Path] = []
    for package in PACKAGES:
        root = repo / package
        if not (root / "__init__.py").is_file():
            raise FileNotFoundError(f"package {package!r} not found under {repo}")
        files.extend(
            p.relative_to(repo) for p in root.rglob("*.py") if "__pycache__" not in p.parts
        )
    return sorted(files)


def build_zip(out: Path | str = DEFAULT_OUT, repo: Path = REPO) -> Path:
    """Write the zip (atomically: a concurrent spark-submit never sees half a file)."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for rel in package_files(repo):
            info = zipfile.ZipInfo(rel.as_posix(), date_time=_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, (repo / rel).read_bytes())
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=str(DEFAULT_OUT),
        help="where to write the zip (default: dist/txn_pyfiles.zip)",
    )
    args = parser.parse_args(argv)
    print(build_zip(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
