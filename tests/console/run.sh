#!/usr/bin/env bash
# run.sh - the console's browser test (test_console's console_browser
# suite): makes sure Debian's chromium and chromium-driver are installed,
# installing them with apt-get where it may (as root, or through sudo
# without a password; without the recommended packages, but with
# fonts-liberation, one of them, so the screenshots have their letters),
# then runs the suite; its screenshots go to the
# folder test_console was built with (BUILD/console).
#
#   tests/console/run.sh TEST_CONSOLE_BINARY
#
# Exit status: the suite's; 77 (the test's SKIP_RETURN_CODE) only when the
# browser is missing and cannot be installed here, and 1 then too under
# QL_REQUIRE_ALL=1 (CI's setting: every test runs).
set -uo pipefail

test_binary=${1:?usage: run.sh TEST_CONSOLE_BINARY}

have_browser() {
  command -v chromium >/dev/null && command -v chromedriver >/dev/null
}

install_browser() {
  local sudo=
  if [ "$(id -u)" != 0 ]; then
    sudo -n true 2>/dev/null || return 1
    sudo="sudo -n"
  fi
  command -v apt-get >/dev/null || return 1
  echo "console: installing chromium and chromium-driver with apt-get" >&2
  # the package lists may be stale or absent (a slim image): update once
  # when the first try fails
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends \
    chromium chromium-driver fonts-liberation >&2 ||
    { DEBIAN_FRONTEND=noninteractive $sudo apt-get update -q >&2 &&
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends \
        chromium chromium-driver fonts-liberation >&2; }
}

if ! have_browser && ! { install_browser && have_browser; }; then
  why="chromium and chromedriver are not installed, and apt-get cannot install them here (not root, no passwordless sudo, or no package index)"
  if [ "${QL_REQUIRE_ALL:-0}" = 1 ]; then
    echo "console: FAILED: $why, and QL_REQUIRE_ALL=1 asks that every test run" >&2
    exit 1
  fi
  echo "console: NOT RUN: $why" >&2
  exit 77
fi
exec "$test_binary" --filter 'console_browser/*' --jobs 1
