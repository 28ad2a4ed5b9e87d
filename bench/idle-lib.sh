# shellcheck shell=bash
# The daemon config the idle-connection benches share (bench/nvme-controllers.sh,
# bench/idle-heap.sh). Source it after setting IQN and NQN.

# idle_config ISCSI_PORT NVME_PORT [METRICS_PORT]: one RAM LUN on both doors, room for 1,000
# controllers' queues; with METRICS_PORT, metrics served there.
idle_config() {
    if [[ -n ${3:-} ]]; then
        printf '[server]\nmetrics_listen = "127.0.0.1:%s"\n\n' "$3"
    fi
    cat <<CONFIG
[limits]
max_connections = 16384
max_sessions = 4096
max_connections_per_source = 128

[[portal_group]]
tag = 1
listen = ["127.0.0.1:$1"]
nvme_listen = ["127.0.0.1:$2"]
nvme_discovery_listen = []

[[device]]
name = "ram0"
store = "ram"
size = "64M"

[[target]]
iqn = "$IQN"
nqn = "$NQN"

  [[target.group]]
  name = "g"
  any_initiator = true
  luns = [{ lun = 0, device = "ram0" }]
CONFIG
}
