# Sourced by test.sh: the OS packages some tests drive (Debian): Chromium and its chromedriver (the web UI's browser
# tests), nginx (the deployment test). Installed with apt-get when missing and this user may (root, or sudo without a
# password); otherwise a message, and those tests skip saying why. Never fails the caller.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1 \
    || ! { command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; }; then
  if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    SUDO="no"
  fi
  if ! command -v apt-get >/dev/null 2>&1 || [ "$SUDO" = "no" ]; then
    echo "chromium, chromium-driver and nginx are not all installed, and apt-get cannot run here (it needs root or" \
         "sudo without a password): the web UI's browser tests and the nginx deployment test will be skipped" >&2
  else
    echo "installing chromium, chromium-driver and nginx (apt-get) for the browser and deployment tests" >&2
    { $SUDO apt-get update -qq \
      && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver nginx >/dev/null; } \
      || echo "could not install chromium, chromium-driver and nginx: the tests that need them will be skipped" >&2
  fi
  unset SUDO
fi
