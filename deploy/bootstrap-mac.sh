#!/usr/bin/env bash
# Set up one Apple-silicon Mac for Orchard, idempotently (run it again any time: it only does what is missing).
#
#   deploy/bootstrap-mac.sh                 # check, venv, install, self-check; print the next commands
#   deploy/bootstrap-mac.sh head            # ... and make the cluster's token once (~/.ray/auth_token, 0600)
#   deploy/bootstrap-mac.sh join HEAD_IP    # ... and check this Mac has the head's token
#
# ORCHARD_PYTHON: the Python to use (default python3.11); every Mac must have the same minor version.
# ORCHARD_VENV: the venv (default .venv in this repository). The token is never printed.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${ORCHARD_VENV:-$root/.venv}
python=${ORCHARD_PYTHON:-python3.11}
token="$HOME/.ray/auth_token"
mode=${1:-setup}
head_ip=${2:-}

die() { echo "bootstrap-mac.sh: $*" >&2; exit 1; }

case "$mode" in
  setup | head) ;;
  join) [ -n "$head_ip" ] || die "join needs the head's address: deploy/bootstrap-mac.sh join HEAD_IP" ;;
  *) die "unknown command '$mode': use setup, head or join HEAD_IP" ;;
esac

# 1. macOS on Apple silicon: MLX's Metal backend needs it (Linux machines use `pip install -e .` and mlx[cpu]).
os=$(uname -s) arch=$(uname -m)
if [ "$os" != Darwin ] || [ "$arch" != arm64 ]; then
  die "this is $os $arch, not macOS on Apple silicon (arm64): run it on each Mac (Linux: pip install -e . instead)"
fi

# 2. The Python: Homebrew's and python.org's usual places, then the version (the same minor on every Mac).
for dir in /opt/homebrew/bin /usr/local/bin; do
  case ":$PATH:" in *":$dir:"*) ;; *) if [ -d "$dir" ]; then PATH="$dir:$PATH"; fi ;; esac
done
command -v "$python" >/dev/null || die "$python not found: install it (brew install python@3.11) or set ORCHARD_PYTHON"
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "$python is Python $version: Orchard needs 3.10 or newer"

# 3. The venv, made once; one made by another Python minor version is refused, not silently reused.
if [ -x "$venv/bin/python" ]; then
  have=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [ "$have" = "$version" ] || die "$venv has Python $have, not $version: remove it (rm -rf $venv) and rerun"
else
  "$python" -m venv "$venv"
fi

# 4. Orchard and its pinned dependencies (a no-op when already installed).
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root"

# 5. Self-check: `driver nodes` on an embedded, loopback-only Ray (no token needed, none created).
RAY_AUTH_MODE=disabled "$venv/bin/driver" nodes --address local >/dev/null \
  || die "the self-check \`driver nodes --address local\` failed (its error is above): fix that, then rerun"

# 6. The cluster's token: made once on the head; other Macs get a copy (ray up's file_mounts, or scp).
if [ "$mode" = head ] && [ ! -s "$token" ]; then
  (umask 077 && env -u RAY_AUTH_TOKEN -u RAY_AUTH_TOKEN_PATH "$venv/bin/ray" get-auth-token --generate >/dev/null 2>&1) \
    || die "ray get-auth-token --generate failed: run it by hand"
fi
if [ -f "$token" ]; then chmod 600 "$token"; fi

echo "This Mac is ready: Python $version, Orchard in $venv."
echo "Next:"
case "$mode" in
  setup)
    echo "  on the head Mac:   deploy/bootstrap-mac.sh head"
    echo "  on every other:    deploy/bootstrap-mac.sh join HEAD_IP" ;;
  head)
    echo "  deploy/ray-mac.sh head"
    echo "  (or, from here, every Mac at once: fill in deploy/cluster.yaml, then $venv/bin/ray up deploy/cluster.yaml)" ;;
  join)
    if [ ! -s "$token" ]; then
      echo "  mkdir -p ~/.ray && scp $head_ip:.ray/auth_token ~/.ray/auth_token && chmod 600 ~/.ray/auth_token"
    fi
    echo "  deploy/ray-mac.sh join $head_ip" ;;
esac
