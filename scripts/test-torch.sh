#!/usr/bin/env bash
# Run the test suite against another torch, in its own venv (not in CI: the wheels are large,
# PyPI's Linux torch wheel brings the CUDA libraries, ~4.7 GB for 2.11; it runs on CPU too).
#   bash scripts/test-torch.sh 2.11.0 [pytest args...]
# The venv is .venv-torch-VERSION (kept for the next run); mixprec is installed editable from
# this checkout and every other dependency under a constraint that pins torch to VERSION.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: scripts/test-torch.sh TORCH_VERSION [pytest args...]}
shift
VENV=.venv-torch-$VERSION
PIN=$VENV/torch-pin.txt
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
echo "torch==$VERSION" >"$PIN"
"$VENV/bin/pip" install -q "torch==$VERSION"
"$VENV/bin/pip" install -q -c "$PIN" -e '.[dev]'
"$VENV/bin/python" -c "import torch; print('testing against torch', torch.__version__)"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VENV/bin/python" -m pytest "$@"
