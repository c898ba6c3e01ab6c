#!/usr/bin/env bash
# Wheels of the pure-Python packages `scripts/gpu_check.py` needs and the GPU image lacks, into .whl/ (ignored),
# for a device machine that reaches no package index.
#
#   scripts/gpu_wheels.sh          # -> .whl/*.whl (about 0.5 MiB; the device tool carries at most 64 MiB)
#
# The image (/work/.library/device/KINDS.md, "Python packages already there") has jax, flax, optax, orbax,
# jaxtyping, numpy, tensorboard, safetensors, tokenizers, pyyaml, tqdm, jinja2, pyarrow, matplotlib, sympy,
# typing-inspect, mypy-extensions, torch and transformers. Of pyproject.toml's runtime dependencies it lacks
# draccus (jaxrl.config) and math-verify (jaxrl.rewards), and of theirs mergedeep and toml (draccus),
# latex2sympy2_extended and antlr4-python3-runtime (math-verify); xprof is missing too but nothing imports it
# (TensorBoard's Profile tab only). Versions: the ones the project's venv tests with. One version of each: two
# stop the whole install there. On the device (docs/gpu.md), with `.whl` in the run's carry:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.whl"
WHEELS=(draccus==0.11.6 mergedeep==1.3.4 toml==0.10.2
        math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2)
py="$(command -v python3)"
rm -rf "$dest"
mkdir -p "$dest"
# the device README's command (x86-64, CPython 3.12 as on the image); pure-Python wheels match every platform
"$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "${WHEELS[@]}"
echo "requirements of the bundled wheels (each must be bundled or on the image):"
for w in "$dest"/*.whl; do
  unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed "s|^|  $(basename "$w"): |" || true
done
# the install the device runs, here into a scratch folder: the wheels are valid and hold one version each
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$scratch" "$dest"/*.whl
bytes=$(du -sb "$dest" | cut -f1)
echo "$(ls "$dest" | wc -l) wheels, $bytes bytes in $dest"
[ "$bytes" -lt $((64 * 1024 * 1024)) ] || { echo "bundle over 64 MiB: the device tool would refuse it" >&2; exit 1; }
