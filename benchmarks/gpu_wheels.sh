#!/usr/bin/env bash
# Fetch, on this (networked) machine, the wheels the GPU machine lacks, for CPython 3.12 on x86_64
# (gpu_session.sh installs them there with --no-index; docs/benchmarks.md, "The commands"):
#   .whl/        humming-kernels (the 4-bit GEMMs) and tabulate: every GPU phase
#   .whl_kedro/  kedro and what it needs, bitsandbytes: only the paper7b phase (kedro run)
# Versions: what this machine's .venv resolved (make setup), so both ends run the same releases.
# Both folders are git-ignored; name them in the device call's carry.
#   bash benchmarks/gpu_wheels.sh          # .whl only (about 0.7 MB)
#   bash benchmarks/gpu_wheels.sh kedro    # and .whl_kedro (about 46 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64)
python3 -m pip download -q "${PLAT[@]}" -d .whl humming-kernels==0.1.20 tabulate
if [ "${1:-}" = kedro ]; then
  PINNED=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null | grep -i -E \
    '^(kedro|kedro-datasets|kedro-telemetry|pydantic|pydantic[-_]core|annotated-types|typing-inspection|cookiecutter|dynaconf|gitpython|gitdb|smmap|more-itertools|omegaconf|parse|tomli[-_]w|arrow|binaryornot|python-slugify|text-unidecode|lazy-loader|antlr4-python3-runtime|appdirs|bitsandbytes)==')
  [ -n "$PINNED" ] || { echo "no .venv with kedro: run make setup first" >&2; exit 1; }
  # shellcheck disable=SC2086
  python3 -m pip download -q "${PLAT[@]}" -d .whl_kedro $PINNED
fi
ls -la .whl ${1:+.whl_kedro}
