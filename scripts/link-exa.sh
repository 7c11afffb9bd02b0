#!/usr/bin/env bash
# Put `exa` on the PATH: a symlink in the first writable user or local bin folder on PATH.
set -euo pipefail
target="$1"
for dir in "$HOME/.local/bin" /usr/local/bin; do
  case ":$PATH:" in *":$dir:"*) ;; *) continue ;; esac
  if [ -w "$dir" ]; then
    current="$(readlink "$dir/exa" 2>/dev/null || true)"
    if [ -e "$dir/exa" ] && [ ! -L "$dir/exa" ]; then break; fi
    [ "$current" = "$target" ] || ln -sf "$target" "$dir/exa"
    echo "exa is on your PATH ($dir/exa -> $target)"
    exit 0
  fi
done
echo "exa is at $target (add $(dirname "$target") to PATH to call it as plain 'exa')"
