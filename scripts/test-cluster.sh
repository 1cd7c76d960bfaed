#!/usr/bin/env bash
# A real test cluster on one machine: each "host" is a network namespace running its own
# OpenSSH `sshd`, joined to two bridges (management and data) in the root namespace, with
# different NIC names per host. The launcher runs in the root namespace, which has an
# address on the management network only.
#
#   scripts/test-cluster.sh up ID N DIR    # hosts h0..h(N-1); keys, configs, inventory in DIR
#   scripts/test-cluster.sh down ID DIR
#
# ID is a short tag (letters/digits, ≤ 4 characters) that keeps concurrent clusters apart;
# subnet octet and names derive from it. Needs root, `ip` and `sshd` (apt openssh-server).
set -euo pipefail

action=${1:?usage: test-cluster.sh up|down ID [N] DIR}
id=${2:?cluster id}

if [ "$action" = down ]; then
  dir=${3:?dir}
  for pidfile in "$dir"/h*/sshd.pid; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  for ns in $(ip netns list | awk '{print $1}' | grep "^inf${id}h" || true); do
    # Anything still running in the namespace goes with it.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns delete "$ns" 2>/dev/null || true
  done
  ip link delete dev "im${id}" 2>/dev/null || true
  ip link delete dev "id${id}" 2>/dev/null || true
  exit 0
fi

n=${3:?host count}
dir=${4:?dir}
# A /24 pair per cluster id, so concurrent clusters never share a subnet.
octet=$(( ( $(printf '%s' "$id" | cksum | cut -d' ' -f1) % 200 ) + 20 ))
mgmt="10.${octet}.1"
data="10.${octet}.2"
mkdir -p "$dir" /run/sshd
chmod 700 "$dir"

ip link add name "im${id}" type bridge
ip link add name "id${id}" type bridge
ip link set dev "im${id}" up
ip link set dev "id${id}" up
# The launcher (root namespace) is on the management network only.
ip addr add "${mgmt}.1/24" dev "im${id}"

[ -f "$dir/client_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C infer-test -f "$dir/client_ed25519"
: > "$dir/known_hosts"
cat > "$dir/hosts.toml" <<TOML
[defaults]
user = "root"
identity-file = "$dir/client_ed25519"
known-hosts = "$dir/known_hosts"

TOML

for i in $(seq 0 $((n - 1))); do
  ns="inf${id}h${i}"
  hdir="$dir/h${i}"
  mkdir -p "$hdir"
  # Different NIC names per host, as on real clusters.
  if [ $((i % 2)) -eq 0 ]; then mnic="eno1"; dnic="data0"; else mnic="eth0"; dnic="ens5"; fi
  ip netns add "$ns"
  ip -n "$ns" link set dev lo up
  ip link add name "v${id}h${i}m" type veth peer name "$mnic" netns "$ns"
  ip link add name "v${id}h${i}d" type veth peer name "$dnic" netns "$ns"
  ip link set dev "v${id}h${i}m" master "im${id}" up
  ip link set dev "v${id}h${i}d" master "id${id}" up
  ip -n "$ns" addr add "${mgmt}.$((10 + i))/24" dev "$mnic"
  ip -n "$ns" addr add "${data}.$((10 + i))/24" dev "$dnic"
  ip -n "$ns" link set dev "$mnic" up
  ip -n "$ns" link set dev "$dnic" up
  ssh-keygen -q -t ed25519 -N '' -C "h${i}" -f "$hdir/ssh_host_ed25519_key"
  cp "$dir/client_ed25519.pub" "$hdir/authorized_keys"
  cat > "$hdir/sshd_config" <<CFG
ListenAddress ${mgmt}.$((10 + i)):22
HostKey $hdir/ssh_host_ed25519_key
AuthorizedKeysFile $hdir/authorized_keys
PidFile $hdir/sshd.pid
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AllowTcpForwarding yes
ClientAliveInterval 2
ClientAliveCountMax 3
LogLevel VERBOSE
CFG
  ip netns exec "$ns" /usr/sbin/sshd -f "$hdir/sshd_config" -E "$hdir/sshd.log"
  cat >> "$dir/hosts.toml" <<TOML
[[hosts]]
name = "h${i}"
address = "${mgmt}.$((10 + i))"
cpu-ranks = 2

TOML
  echo "h${i} ${ns} ${mgmt}.$((10 + i)) ${data}.$((10 + i)) ${mnic} ${dnic} $(cut -d' ' -f1,2 "$hdir/ssh_host_ed25519_key.pub")" >> "$dir/hosts.txt"
done
echo "$dir/hosts.toml"
