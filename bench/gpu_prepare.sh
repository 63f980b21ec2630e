#!/usr/bin/env bash
# Prepare what a device run of bench/gpu_check.sh carries: wheels for the packages it needs
# beyond the device image (bench/gpu_requirements.txt), downloaded here for the device's
# Python 3.12 on x86-64 manylinux, binary only, into .gpu_wheels/ (git-ignored). The device
# cannot download; gpu_check.sh installs these offline (pip --no-index into a private
# --target) before anything else.
#
#   bench/gpu_prepare.sh                       # then: device run with carry [".gpu_wheels"]
#   GPU_REQUIREMENTS=FILE WHEEL_DIR=DIR bench/gpu_prepare.sh
#
# PY overrides the interpreter whose pip downloads (default .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
REQS=${GPU_REQUIREMENTS:-bench/gpu_requirements.txt}
DEST=${WHEEL_DIR:-.gpu_wheels}
LIMIT_MIB=${WHEEL_LIMIT_MIB:-48}  # of the 64 MiB a run carries; the tree needs the rest

rm -rf "$DEST"
mkdir -p "$DEST"
mapfile -t wanted < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$REQS" | grep -v '^$' || true)
if (( ${#wanted[@]} )); then
  platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
  done
  # --no-deps: every requirement is listed by hand, so nothing the image already has (at
  # another version) sneaks in and shadows it.
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$DEST" "${wanted[@]}"
fi
size_kib=$(du -sk "$DEST" | cut -f1)
n=$(find "$DEST" -name '*.whl' | wc -l)
echo "$n wheel(s), $((size_kib / 1024)) MiB in $DEST"
if (( size_kib > LIMIT_MIB * 1024 )); then
  echo "$DEST is over ${LIMIT_MIB} MiB: a device run carries 64 MiB in all" >&2
  exit 1
fi
