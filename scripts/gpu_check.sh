#!/usr/bin/env bash
# The GPU check in one command: preflight, the tests marked `cuda`, and a benchmark on a dummy-weight
# Llama-3-8B (batch 8/16, context 16k/32k), JSON + Markdown into OUTDIR. See docs/gpu.md.
#
#   scripts/gpu_check.sh OUTDIR            # on a GPU machine, about 8 minutes
#   scripts/gpu_check.sh OUTDIR --tiny     # tiny model and contexts, on CPU when there is no GPU
#
# infinikv runs from this source tree (PYTHONPATH=src); nothing is installed from a network. Wheels placed in
# .whl/ (git-ignored; see docs/gpu.md) are installed first, offline and without their dependencies.
# PYTHON picks the interpreter (default: /opt/torch/.venv/bin/python3 if present, else python3).
set -euo pipefail

if [[ $# -lt 1 || $1 == -* ]]; then
    echo "usage: scripts/gpu_check.sh OUTDIR [--tiny] [options of python -m infinikv.gpucheck]" >&2
    exit 2
fi
out=$(realpath -m "$1")
shift
cd "$(dirname "$0")/.."

if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    [[ -x /opt/torch/.venv/bin/python3 ]] && PYTHON=/opt/torch/.venv/bin/python3
fi
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || {
    echo "gpu-check: $PYTHON is Python $("$PYTHON" -V 2>&1); 3.11 or newer is needed" >&2
    exit 1
}
shopt -s nullglob
wheels=(.whl/*.whl)
if ((${#wheels[@]})); then
    echo "gpu-check: installing ${#wheels[@]} carried wheel(s) from .whl/ (offline, no dependencies)" >&2
    "$PYTHON" -m pip install --quiet --no-index --no-deps "${wheels[@]}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m infinikv.gpucheck check "$out" "$@"
