#!/usr/bin/env bash
# Fill ./wheelhouse with the test tools benchmarks/gpu.sh installs on the GPU machine, which
# has torch but no network: pytest and its plugins, hypothesis, numpy (required by the suite),
# and transformers / torchao / lightning (optional: their tests skip without them).
#   bash scripts/gpu-wheelhouse.sh [PYTHON_VERSION]   # e.g. 3.12: the GPU image's python
# Then carry the folder with the run (it is git-ignored): the device tool's carry=["wheelhouse"].
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
mkdir -p wheelhouse
download() {
    python3 -m pip download -q --only-binary=:all: --python-version "$PYVER" \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        --implementation cp -d wheelhouse "$@"
}
# no torch in here: the image's torch is the one tested
download --no-deps pytest pluggy iniconfig packaging pytest-timeout hypothesis \
    sortedcontainers attrs numpy
download --no-deps "transformers>=4.40" tokenizers safetensors huggingface_hub hf-xet regex \
    pyyaml tqdm filelock fsspec requests urllib3 idna certifi charset-normalizer \
    typing-extensions "torchao==0.18.0" lightning lightning-utilities torchmetrics \
    || echo "optional wheels: some missing (their tests skip)" >&2
du -sh wheelhouse
