#!/usr/bin/env bash
# Run a command inside the project's virtual environment, creating it first if needed.
#   scripts/venv.sh python -m jaxrl.train          # the entry points need the runtime dependencies only
#   scripts/venv.sh python -m pytest -q            # anything else adds the test extra (torch, transformers, ...)
#   scripts/venv.sh tensorboard --logdir runs/quickstart/tb
# Needs only Python 3.11 on PATH (python3.11, or python3 when it is 3.11). The environment lives in
# .venv/ (override with JAXRL_VENV); it is re-synced when pyproject.toml changes. What it installs: the
# runtime set (`pip install -e .`) for `python -m jaxrl.*` / `python -m models.*` and tensorboard, the test
# extra too (`.[test]`: the reference stack the tests and benchmarks compare against) for any other command;
# JAXRL_EXTRAS=test or =runtime forces one. Once the test extra is in, it stays. The command runs in
# the caller's directory (relative paths are the caller's), with the environment's bin/ first on PATH
# and VIRTUAL_ENV set, so the processes it starts use the environment too.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${JAXRL_VENV:-$root/.venv}"
venv="$(mkdir -p "$(dirname "$venv")" && cd "$(dirname "$venv")" && pwd)/$(basename "$venv")"
[ "$#" -gt 0 ] || { echo "usage: scripts/venv.sh COMMAND [ARGS...]" >&2; exit 2; }
py="$(command -v python3.11 || command -v python3)"
"$py" -c 'import sys; assert sys.version_info[:2] >= (3, 11), "Python 3.11+ needed, found " + sys.version'
if [ ! -x "$venv/bin/python" ]; then
  echo "[venv] creating $venv" >&2
  "$py" -m venv "$venv"
fi
extras="${JAXRL_EXTRAS:-}"
if [ -z "$extras" ]; then
  extras=test
  case "$1 ${2:-} ${3:-}" in
    "python -m jaxrl"*|"python3 -m jaxrl"*|"python -m models"*|"python3 -m models"*|tensorboard*) extras=runtime ;;
  esac
fi
stamp="$venv/.jaxrl-installed"
installed="$( [ -f "$stamp" ] && cat "$stamp" || true )"
[ -f "$stamp" ] && [ -z "$installed" ] && installed=test    # (a stamp of before the runtime set: it had the test extra)
[ "$installed" = test ] && extras=test          # (a venv with the test extra serves every command)
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ] || [ "$extras" != "${installed:-runtime}" ]; then
  spec="$root[test]"; [ "$extras" = runtime ] && spec="$root"
  echo "[venv] installing jaxrl$([ "$extras" = test ] && echo '[test]') (first run takes a few minutes)" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  # The bytecode is still written, but by compileall on every core instead of pip on one (pip's own compile
  # step was half the install: 84 s -> 45 s + 26 s on 2 cores). Not skipped: where PYTHONDONTWRITEBYTECODE is
  # set, as on our VMs, every process would compile every module it imports from source (`import
  # jaxrl.train.__main__`: 2.8 s from source, 0.8 s from bytecode). compileall's status is ignored: a few
  # packages ship files for newer Pythons (torch's py312_intrinsics.py) that no 3.11 can compile; pip skips
  # them the same way. Left out: packages' own tests, the model families of transformers we do not load, and
  # the test extra's reference stack (torch, transformers, TRL, PEFT and what only they bring), which only
  # the test suite imports: it writes the bytecode of the modules it imports itself (tests/conftest.py).
  # 21 -> 14 s on 2 cores.
  "$venv/bin/python" -m pip install -q --no-compile -e "$spec" >&2
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  unused='site-packages/(transformers/models/(?!(auto|bloom|encoder_decoder|qwen2|qwen3|llama)/)|.*/tests?/)'
  tests_only='site-packages/(torch|transformers|trl|peft|accelerate|datasets|sympy|networkx|pandas)/'
  "$venv/bin/python" -m compileall -q -j 0 -x "$unused|$tests_only" "$site" >/dev/null 2>&1 || true
  echo "$extras" > "$stamp"
fi
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"
unset PYTHONHOME
exec "$@"
