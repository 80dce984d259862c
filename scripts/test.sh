#!/usr/bin/env bash
# Install everything the test suite needs on a fresh machine, then run it.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -e ".[test]"
if ! command -v chromium >/dev/null 2>&1; then
  # browser tests drive Debian's chromium (never `playwright install`)
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
fi
exec python -m pytest -q -n 2 --dist loadgroup "$@"
