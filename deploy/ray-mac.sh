#!/usr/bin/env bash
# Start Ray on a Mac the way Orchard expects: one `mlx` resource unit per Mac (so one worker lands on each), token
# authentication on, multi-node macOS allowed, Python matched at minor level. deploy/README.md says why.
#
#   deploy/ray-mac.sh head            # on the Mac that runs `driver run` (prints the address to join)
#   deploy/ray-mac.sh join HEAD_IP    # on every other Mac (after copying the head's ~/.ray/auth_token)
#   deploy/ray-mac.sh stop            # anywhere
#
# NODE_IP overrides the address this Mac advertises (default: en0's, then en1's); PORT the head's port (6379).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ray=${ORCHARD_VENV:-$root/.venv}/bin/ray
[ -x "$ray" ] || ray=ray
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1       # Ray refuses multi-node clusters on macOS without it
export RAY_AUTH_MODE=token                       # every node and driver must send the cluster's token
export RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor  # 3.11.9 and 3.11.10 may join; 3.11 and 3.12 may not
token="$HOME/.ray/auth_token"
port=${PORT:-6379}
ip=${NODE_IP:-$(ipconfig getifaddr en0 2>/dev/null || ipconfig getifaddr en1 2>/dev/null || true)}
case "${1:-}" in
  head | join)
    [ -n "$ip" ] || { echo "ray-mac.sh: cannot tell this Mac's LAN address: set NODE_IP" >&2; exit 2; } ;;
esac
case "${1:-}" in
  head)
    if [ ! -s "$token" ]; then  # made once, never printed
      (umask 077 && "$ray" get-auth-token --generate >/dev/null 2>&1) \
        || { echo "ray-mac.sh: ray get-auth-token --generate failed: run deploy/bootstrap-mac.sh head first" >&2; exit 1; }
    fi
    chmod 600 "$token"
    "$ray" start --head --port "$port" --node-ip-address "$ip" --resources='{"mlx": 1}' --include-dashboard=false
    echo "next, on every other Mac: copy $token there (mode 600), then: deploy/ray-mac.sh join $ip" ;;
  join)
    [ -n "${2:-}" ] || { echo "usage: $0 join HEAD_IP" >&2; exit 2; }
    [ -s "$token" ] || { echo "ray-mac.sh: no $token: copy the head's (mkdir -p ~/.ray && scp $2:.ray/auth_token ~/.ray/ && chmod 600 $token)" >&2; exit 1; }
    "$ray" start --address "$2:$port" --node-ip-address "$ip" --resources='{"mlx": 1}' ;;
  stop) "$ray" stop ;;
  *) echo "usage: $0 head | join HEAD_IP | stop" >&2; exit 2 ;;
esac
