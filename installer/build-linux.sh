#!/usr/bin/env bash
# Builds dist/potluck-linux-x86_64.tar.gz from build.spec (PyInstaller one-folder bundle).
# The double-click installers (AppImage / Windows setup) come with the desktop app work.
set -euo pipefail
cd "$(dirname "$0")/.."
make setup
.venv/bin/python -m pip install --quiet pyinstaller
.venv/bin/pyinstaller --noconfirm build.spec
tar -C dist -czf dist/potluck-linux-x86_64.tar.gz potluck
echo "built dist/potluck-linux-x86_64.tar.gz"
