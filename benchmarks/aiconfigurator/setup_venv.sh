#!/usr/bin/env bash
# Create the separate virtualenv that holds NVIDIA AIConfigurator for the side-by-side
# benchmarks in this folder (never a shardc or test dependency).
#
#   benchmarks/aiconfigurator/setup_venv.sh            # -> $SHARDC_AIC_VENV
#
# SHARDC_AIC_VENV  where the venv goes (default ~/.cache/shardc/aic-venv)
# SHARDC_AIC_WHEEL_DIR  a folder holding an already-downloaded
#                  aiconfigurator_core-0.12.0 wheel (default /tmp/aic; used if present,
#                  else the wheel comes from the package index)
# PYTHON           interpreter to build the venv from (default python3; needs >= 3.11)
set -euo pipefail

AIC_VERSION=0.12.0
VENV="${SHARDC_AIC_VENV:-$HOME/.cache/shardc/aic-venv}"
WHEEL_DIR="${SHARDC_AIC_WHEEL_DIR:-/tmp/aic}"
PYTHON="${PYTHON:-python3}"

if [ -x "$VENV/bin/aiconfigurator" ] \
   && "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('aiconfigurator') != '$AIC_VERSION' or m.version('aiconfigurator-core') != '$AIC_VERSION')" 2>/dev/null; then
    echo "aiconfigurator $AIC_VERSION already in $VENV"
    exit 0
fi

"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
core="aiconfigurator-core==$AIC_VERSION"
for whl in "$WHEEL_DIR"/aiconfigurator_core-"$AIC_VERSION"-*.whl; do
    if [ -f "$whl" ]; then
        core="$whl"
        break
    fi
done
"$VENV/bin/python" -m pip install --quiet "$core" "aiconfigurator==$AIC_VERSION"
"$VENV/bin/aiconfigurator" --help >/dev/null
echo "aiconfigurator $AIC_VERSION installed in $VENV"
