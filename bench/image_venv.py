"""A venv that sees only the device image's Python packages: proof, without a GPU, that
bench/gpu_check.sh needs nothing the device machine lacks.

The device machine cannot download anything, and its image has torch, triton, transformers and
the rest of `bench/device_image_packages.txt` but none of the daemon's own stack (fastapi,
pydantic, sqlalchemy, alembic, apscheduler, gguf, ...). A check that imports one of those by
accident fails there after the machine has been paid for. This builds, in a few seconds, a venv
without system site-packages whose site-packages holds links to exactly those distributions of
the running interpreter's environment (this repo's .venv) that the image lists, each with its
dist-info, so `importlib.metadata` agrees with what can be imported. Everything else, kvguard
included, is invisible: gpu_check.sh must bring kvguard itself (it puts the working tree on
the path) and anything more as prepared wheels (bench/gpu_prepare.sh).

The runtime dependencies of the listed distributions, as installed here, are linked too: a
newer release here may need a package its image release did without (huggingface_hub 2.x here
needs httpx2, the image's 1.x uses httpx), and the image's own releases are complete installs.
`NOT_IN_IMAGE` (the daemon-only stack) is never linked, whatever needs it.

Linking instead of installing keeps it fast and offline; versions are this machine's (torch
2.13 CPU here, 2.11 CUDA there), so it proves which packages are needed, not version details.

    python bench/image_venv.py DIR   # prints DIR/bin/python
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

PACKAGE_LIST = Path(__file__).with_name("device_image_packages.txt")
# What the issue names as missing on the device: never linked, not even as a dependency of a
# newer release here (typer 0.29 here needs pydantic; the image's typer does not).
NOT_IN_IMAGE = frozenset(
    {
        "alembic",
        "apscheduler",
        "fastapi",
        "gguf",
        "prometheus-api-client",
        "pydantic",
        "pydantic-core",
        "sqlalchemy",
        "starlette",
        "uvicorn",
    }
)


def normalize(name: str) -> str:
    """PEP 503 name normalisation: `PyYAML`, `pyyaml` and `py_yaml` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = PACKAGE_LIST) -> set[str]:
    lines = path.read_text().splitlines()
    return {normalize(s) for s in (ln.strip() for ln in lines) if s and not s.startswith("#")}


def top_level_entries(dist: metadata.Distribution) -> set[str]:
    """The site-packages entries a distribution owns (packages, modules, its dist-info), from
    its RECORD; files installed outside site-packages (scripts, data) are left out."""
    entries: set[str] = set()
    for f in dist.files or ():
        first = f.parts[0]
        if first not in ("..", "__pycache__") and not first.endswith(".pth"):
            entries.add(first)
    return entries


def with_dependencies(names: set[str], source: Path) -> set[str]:
    """`names` plus every distribution they need at run time (no extras), as installed in
    `source`; names not installed here are kept (the image has them, we cannot link them)."""
    from packaging.requirements import Requirement

    installed = {
        normalize(d.metadata["Name"]): d for d in metadata.distributions(path=[str(source)])
    }
    todo, seen = list(names), set(names)
    while todo:
        dist = installed.get(todo.pop())
        for spec in (dist.requires or []) if dist else []:
            req = Requirement(spec)
            name = normalize(req.name)
            if name in NOT_IN_IMAGE:
                continue
            if name not in seen and (req.marker is None or req.marker.evaluate({"extra": ""})):
                seen.add(name)
                todo.append(name)
    return seen


def build(target: Path, allowed: set[str]) -> Path:
    """Create the venv at `target` and link in the allowed distributions; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True)
    python = target / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip()
    )
    source = Path(sysconfig.get_paths()["purelib"])
    allowed = with_dependencies(allowed, source)
    for dist in metadata.distributions(path=[str(source)]):
        if normalize(dist.metadata["Name"]) not in allowed:
            continue
        for entry in top_level_entries(dist):
            link, real = site / entry, source / entry
            if real.exists() and not link.exists():
                link.symlink_to(real)
    return python


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path)
    args = ap.parse_args()
    print(build(args.target, image_packages()))


if __name__ == "__main__":
    main()
