#!/bin/sh
# Potluck @VERSION@ for Linux (x86_64): a per-user install, no root needed.
#   sh potluck-@VERSION@-linux-x86_64.run            install (or update) under ~/.local
#   ~/.local/opt/potluck/uninstall.sh [--purge]      remove it (--purge: your data too)
# It unpacks the bundle to ~/.local/opt/potluck, links ~/.local/bin/potluck, and adds the
# menu entry, the icon and the potluck:// link handler. POTLUCK_PREFIX=<dir> installs
# elsewhere; POTLUCK_NO_LAUNCH=1 does not start the app afterwards.
set -eu
PREFIX="${POTLUCK_PREFIX:-$HOME/.local}"
DATA="${XDG_DATA_HOME:-$HOME/.local/share}"
[ -n "${POTLUCK_PREFIX:-}" ] && DATA="$PREFIX/share"
DEST="$PREFIX/opt/potluck"
say() { printf '%s\n' "$*"; }

SKIP=$(awk '/^__POTLUCK_PAYLOAD__$/ { print NR + 1; exit }' "$0")
mkdir -p "$PREFIX/opt" "$PREFIX/bin" "$DATA/applications" "$DATA/icons/hicolor/scalable/apps"
say "Installing Potluck @VERSION@ into $DEST ..."
# unpack beside the old install, then swap: an interrupted update leaves the old one working
rm -rf "$DEST.new" "$DEST.old"
mkdir "$DEST.new"
# the payload is the .deb's data.tar.xz: the bundle is its ./opt/potluck
if ! tail -n +"$SKIP" "$0" | xz -dc | tar -x -C "$DEST.new" --strip-components=3 ./opt/potluck; then
  rm -rf "$DEST.new"; say "Unpacking failed (is the disk full?). Nothing was changed." >&2; exit 1
fi
[ -d "$DEST" ] && mv "$DEST" "$DEST.old"
mv "$DEST.new" "$DEST"
rm -rf "$DEST.old"

ln -sf "$DEST/potluck" "$PREFIX/bin/potluck"
cp "$DEST/_internal/assets/potluck.svg" "$DATA/icons/hicolor/scalable/apps/potluck.svg"
sed "s|^Exec=.*|Exec=$DEST/potluck app %u|" "$DEST/_internal/assets/potluck.desktop" \
  > "$DATA/applications/potluck.desktop"
command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database -q "$DATA/applications" || true
command -v xdg-mime >/dev/null 2>&1 && xdg-mime default potluck.desktop x-scheme-handler/potluck 2>/dev/null || true

cat > "$DEST/uninstall.sh" <<UNINSTALL
#!/bin/sh
# Removes Potluck. Your models, keys and settings stay unless you pass --purge.
set -eu
rm -f "$PREFIX/bin/potluck" "$DATA/applications/potluck.desktop" \\
      "$DATA/icons/hicolor/scalable/apps/potluck.svg" \\
      "\${XDG_CONFIG_HOME:-\$HOME/.config}/autostart/potluck.desktop"
rm -rf "$DEST"
if [ "\${1:-}" = "--purge" ]; then
  rm -rf "\${XDG_DATA_HOME:-\$HOME/.local/share}/potluck" "\${XDG_CONFIG_HOME:-\$HOME/.config}/potluck" \\
         "\${XDG_CACHE_HOME:-\$HOME/.cache}/potluck"
  echo "Potluck and its data are removed."
else
  echo "Potluck is removed. Your data stays in \${XDG_DATA_HOME:-\$HOME/.local/share}/potluck (--purge removes it)."
fi
UNINSTALL
chmod 755 "$DEST/uninstall.sh"

say "Done. Start it from your app menu (Potluck), or run: $PREFIX/bin/potluck app"
case ":$PATH:" in *":$PREFIX/bin:"*) ;; *) say "($PREFIX/bin is not on your PATH; open a new terminal or use the full path.)";; esac
if [ -z "${POTLUCK_NO_LAUNCH:-}" ] && [ -n "${DISPLAY:-}${WAYLAND_DISPLAY:-}" ]; then
  nohup "$DEST/potluck" app >/dev/null 2>&1 &
fi
exit 0
__POTLUCK_PAYLOAD__
