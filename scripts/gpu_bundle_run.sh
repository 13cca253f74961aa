#!/usr/bin/env bash
# DIR/run [--site PATH] [gpu_check flags], copied into a bundle by scripts/gpu_bundle (docs/cuda.md, "A lent GPU:
# one call"). From a Tandem checkout's root, on a machine whose Python (PYTHON, default python3) has torch and
# may reach no registry: installs the bundle's wheels into PATH (default $TMPDIR/tandem-bundle-site, reused while
# the bundle is the same) with pip and no index, puts PATH and the checkout on PYTHONPATH, checks what the bundle
# leaves to the machine (torch) and runs scripts/gpu_check with the flags.
set -euo pipefail
bundle="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-python3}"
site="${TMPDIR:-/tmp}/tandem-bundle-site"
if [ "${1:-}" = "--site" ]; then
  site="$2"; shift 2
fi
if [ ! -x scripts/gpu_check ]; then
  echo "run: start me from the repository root (no scripts/gpu_check in $PWD)" >&2; exit 2
fi
case "${1:-}" in -h|--help) sed -n '2,6p' "$0"; echo; exec scripts/gpu_check --help ;; esac
if ! command -v "$py" >/dev/null; then
  echo "run: no $py here (PYTHON names the interpreter that has torch)" >&2; exit 2
fi
key="$(sha256sum "$bundle/bundle.json" | cut -c1-16)"
if [ "$(cat "$site/.tandem-bundle" 2>/dev/null)" != "$key" ]; then
  echo "run: installing $(ls "$bundle"/*.whl | wc -l) wheels into $site with $py (no index: nothing is downloaded)"
  rm -rf "$site"
  start=$SECONDS
  if "$py" -m pip --version >/dev/null 2>&1; then
    # no configuration file, no PIP_* variable: nothing but this folder is looked at (--find-links, extra indexes)
    PIP_CONFIG_FILE=/dev/null "$py" -m pip install --isolated --no-index --find-links "$bundle" --target "$site" \
      --no-compile --disable-pip-version-check --no-warn-script-location -q -r "$bundle/requirements.txt"
    if [ -s "$bundle/requirements-nodeps.txt" ]; then  # those that need torch (the machine's): without their deps,
      # which the first install resolved (scripts/gpu_bundle, TORCH_USERS); their scripts beside the others' are
      # left out (pip says the bin folder exists: nothing here runs them)
      PIP_CONFIG_FILE=/dev/null "$py" -m pip install --isolated --no-index --find-links "$bundle" --target "$site" \
        --no-deps --no-compile --disable-pip-version-check --no-warn-script-location -q \
        -r "$bundle/requirements-nodeps.txt"
    fi
  else  # a Python without pip: the wheels unpacked as they are (gpu_bundle resolved them all; scripts left out)
    echo "run: $py has no pip: unpacking the wheels instead" >&2
    "$py" - "$bundle" "$site" <<'EOF'
import sys, zipfile
from pathlib import Path
bundle, site = Path(sys.argv[1]), Path(sys.argv[2])
for wheel in sorted(bundle.glob("*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for member in z.infolist():
            parts = Path(member.filename).parts
            if member.is_dir():
                continue
            if parts[0].endswith(".data"):  # <name>.data/purelib|platlib/... belongs in the site itself
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            target = site.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(member))
EOF
  fi
  echo "$key" >"$site/.tandem-bundle"
  echo "run: installed in $(( SECONDS - start ))s"
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
"$py" - "$bundle/provided.txt" <<'EOF'
import sys
from importlib import metadata

from packaging.requirements import Requirement  # (the bundle's)

missing = []
for line in open(sys.argv[1], encoding="utf-8"):
    if not line.strip():
        continue
    req = Requirement(line.strip())
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        missing.append(f"{req.name} is not installed (the bundle leaves {req} to this machine)")
        continue
    if req.specifier.contains(version, prereleases=True):
        print(f"run: {req.name} {version}: this machine's")
    else:
        missing.append(f"{req.name} {version} does not satisfy {req}")
if missing:
    sys.exit("run: " + "; ".join(missing))
EOF
PYTHON="$py" exec scripts/gpu_check "$@"
