#!/usr/bin/env bash
# Start Ray on a Mac the way Orchard expects: one `mlx` resource unit per Mac, so one worker lands on each.
#
#   deploy/ray-mac.sh head            # on the Mac that runs `driver run` (prints the address to join)
#   deploy/ray-mac.sh join HEAD_IP    # on every other Mac
#   deploy/ray-mac.sh stop            # anywhere
#
# NODE_IP overrides the address this Mac advertises (default: en0's, then en1's); PORT the head's port (6379).
set -euo pipefail
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1  # Ray refuses multi-node clusters on macOS without it
port=${PORT:-6379}
ip=${NODE_IP:-$(ipconfig getifaddr en0 2>/dev/null || ipconfig getifaddr en1 2>/dev/null || true)}
[ -n "$ip" ] || { echo "cannot tell this Mac's LAN address: set NODE_IP" >&2; exit 2; }
case "${1:-}" in
  head) ray start --head --port "$port" --node-ip-address "$ip" --resources='{"mlx": 1}' --include-dashboard=false ;;
  join) [ -n "${2:-}" ] || { echo "usage: $0 join HEAD_IP" >&2; exit 2; }
        ray start --address "$2:$port" --node-ip-address "$ip" --resources='{"mlx": 1}' ;;
  stop) ray stop ;;
  *) echo "usage: $0 head | join HEAD_IP | stop" >&2; exit 2 ;;
esac
