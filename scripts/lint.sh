#!/usr/bin/env bash
# The tree's lint and format checks, as CI runs them: ruff (lint and format, settings in
# pyproject.toml) over the Python, clang-format (.clang-format) over ffi/'s C++ and CUDA.
# The tools are pyproject.toml's `lint` extra, installed at those pinned versions into a
# venv of their own (LINT_VENV, default .venv-lint), so that every machine formats alike.
#
#   bash scripts/lint.sh          # check
#   bash scripts/lint.sh --fix    # rewrite the tree in place instead
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${LINT_VENV:-.venv-lint}
tools=$(python -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["lint"]))')
[ -x "$venv/bin/python" ] || python -m venv "$venv"
"$venv/bin/python" -m pip install -q $tools  # quick where they are installed already
mapfile -t cuda < <(git ls-files 'ffi/*.cu' 'ffi/*.cuh' 'ffi/*.h' 'ffi/*.cc')
if [ "${1:-}" = --fix ]; then
  "$venv/bin/ruff" check --fix .
  "$venv/bin/ruff" format .
  "$venv/bin/clang-format" -i "${cuda[@]}"
else
  "$venv/bin/ruff" check .
  "$venv/bin/ruff" format --check .
  "$venv/bin/clang-format" --dry-run --Werror "${cuda[@]}"
  echo "lint: ruff check, ruff format and clang-format (${#cuda[@]} files) clean"
fi
