#!/usr/bin/env bash
# Builds the Linux installers from the PyInstaller bundle (build.spec) into dist/:
#   potluck_<version>_amd64.deb     double-click in the Software app, or `sudo apt install ./…deb`
#   potluck-<version>-linux-x86_64.run   per-user, no root: run it (or double-click after chmod +x)
# Both carry the same one-folder bundle (Python, torch CPU, Qt, the default model), so a
# fresh machine needs nothing else. `installer/build-linux.sh --skip-bundle` repackages an
# existing dist/potluck (the packaging steps take seconds, the bundle minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)

if [ "${1:-}" != "--skip-bundle" ]; then
  make setup
  # PyInstaller alone, not the project again: CI builds this while the tests run from the
  # same venv, and reinstalling the project would pull it from under them
  .venv/bin/python -m pip install --quiet "$(.venv/bin/python -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["build"][0])')"
  .venv/bin/pyinstaller --noconfirm --log-level WARN build.spec
fi
[ -x dist/potluck/potluck ] || { echo "no dist/potluck/potluck: build the bundle first" >&2; exit 1; }

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

desktop_entry() {  # $1: the command the menu entry runs
  sed "s|^Exec=.*|Exec=$1 app %u|" assets/potluck.desktop
}

# --- .deb: /opt/potluck, /usr/bin/potluck, menu entry, icon, potluck:// handler -------------
DEB="$WORK/deb"
mkdir -p "$DEB/DEBIAN" "$DEB/opt" "$DEB/usr/bin" "$DEB/usr/share/applications" \
         "$DEB/usr/share/icons/hicolor/scalable/apps"
cp -a dist/potluck "$DEB/opt/potluck"
ln -s /opt/potluck/potluck "$DEB/usr/bin/potluck"
desktop_entry /opt/potluck/potluck > "$DEB/usr/share/applications/potluck.desktop"
cp assets/potluck.svg "$DEB/usr/share/icons/hicolor/scalable/apps/potluck.svg"
SIZE_KB=$(du -sk "$DEB" | cut -f1)
cat > "$DEB/DEBIAN/control" <<EOF
Package: potluck
Version: $VERSION
Architecture: amd64
Maintainer: Potluck <potluck@users.noreply.github.com>
Installed-Size: $SIZE_KB
Section: net
Priority: optional
Depends: libc6 (>= 2.31), libegl1, libgl1, libfontconfig1, libglib2.0-0, libdbus-1-3, libxkbcommon0, libxkbcommon-x11-0, libxcb-cursor0, libxcb-icccm4, libxcb-image0, libxcb-keysyms1, libxcb-randr0, libxcb-render-util0, libxcb-shape0, libxcb-xinerama0, libxcb-xkb1, libx11-xcb1
Description: Pool friends' home GPUs to run one LLM
 A tray app: share this GPU with friends, host a model none of you could run
 alone, chat with it, or serve an OpenAI-compatible API. Ships its own Python,
 torch (CPU; the app offers the CUDA build when it finds an NVIDIA GPU) and
 a small default model, so it works offline after install.
EOF
# the menu and the potluck:// handler are picked up at once, not at the next login
for s in postinst postrm; do
  cat > "$DEB/DEBIAN/$s" <<'EOF'
#!/bin/sh
set -e
command -v update-desktop-database >/dev/null && update-desktop-database -q /usr/share/applications || true
command -v gtk-update-icon-cache >/dev/null && gtk-update-icon-cache -q -t /usr/share/icons/hicolor || true
exit 0
EOF
  chmod 755 "$DEB/DEBIAN/$s"
done
DEB_OUT="dist/potluck_${VERSION}_amd64.deb"
dpkg-deb --root-owner-group -Zxz -z6 --build "$DEB" "$DEB_OUT" >/dev/null

# --- .run: a shell script with the bundle appended, installs under ~/.local ------------------
# Its payload is the .deb's own data.tar.xz (./opt/potluck/... inside): the bundle is
# compressed once, not twice (xz over a GB is most of this script's time)
RUN_OUT="dist/potluck-${VERSION}-linux-x86_64.run"
(cd "$WORK" && ar x "$ROOT/$DEB_OUT" data.tar.xz)
sed "s/@VERSION@/$VERSION/" installer/linux/run-header.sh > "$RUN_OUT"
cat "$WORK/data.tar.xz" >> "$RUN_OUT"
chmod 755 "$RUN_OUT"

ls -l --block-size=M "$DEB_OUT" "$RUN_OUT"
