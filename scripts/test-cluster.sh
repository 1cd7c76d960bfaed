#!/usr/bin/env bash
# A real test cluster on one machine: each "host" is a network namespace running its own
# OpenSSH `sshd`, joined to two bridges (management and data) in the root namespace, with
# different NIC names per host. The launcher runs in the root namespace, which has an
# address on the management network only.
#
#   scripts/test-cluster.sh up ID N DIR    # hosts h0..h(N-1); keys, configs, inventory in DIR
#   scripts/test-cluster.sh down ID DIR
#
# ID is a short tag (lowercase letters/digits, ≤ 6 characters) that keeps concurrent clusters
# apart; names derive from it, and so does the subnet octet unless OCTET is set (the tests
# set it, so their clusters never share a subnet). Each host's sshd runs in its own mount
# namespace with empty tmpfs over DIR/private and ~/.cache/infer/bin, so a file the launcher
# puts there is missing on the hosts (a model to push, a binary to stage), as on real hosts.
# FAKE_NCCL_HOST=I FAKE_NCCL_LIB=FILE puts FILE at /usr/local/lib/libnccl.so.2 on host I
# only (a tmpfs over /usr/local/lib in its mount namespace).
# LOW_NOFILE_HOST=I starts host I's sshd (and so its sessions) with `ulimit -n 1024`.
# FAKE_ARCH=aarch64 makes `uname -m` answer that on every host (a script over
# /usr/local/bin in the hosts' mount namespaces), to test a host of another architecture.
# Needs root, `ip`, `unshare` and `sshd` (apt openssh-server).
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
  # The root-namespace ends of the veth pairs (deleting one end deletes the pair, even
  # while the kernel is still tearing the namespace down).
  for link in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^v${id}h" || true); do
    ip link delete dev "$link" 2>/dev/null || true
  done
  ip link delete dev "im${id}" 2>/dev/null || true
  if [ -f "$dir/data_subnet" ]; then ip route delete blackhole "$(cat "$dir/data_subnet")" 2>/dev/null || true; fi
  ip link delete dev "id${id}" 2>/dev/null || true
  exit 0
fi

n=${3:?host count}
dir=${4:?dir}
# A /24 pair per cluster id, so concurrent clusters never share a subnet.
octet=${OCTET:-$(( ( $(printf '%s' "$id" | cksum | cut -d' ' -f1) % 200 ) + 20 ))}
# Another cluster (or anything else) on that subnet pair: take the next free one.
for _ in $(seq 200); do
  if [ -z "$(ip route show "10.${octet}.1.0/24")" ] && [ -z "$(ip route show "10.${octet}.2.0/24")" ]; then
    break
  fi
  octet=$(( (octet - 20 + 1) % 200 + 20 ))
done
mgmt="10.${octet}.1"
data="10.${octet}.2"
mkdir -p "$dir/private" "$HOME/.cache/infer/bin" /run/sshd
chmod 700 "$dir"

ip link add name "im${id}" type bridge
ip link add name "id${id}" type bridge
ip link set dev "im${id}" up
ip link set dev "id${id}" up
# The launcher (root namespace) is on the management network only. Its default route
# leads off this machine: the data subnet is blackholed here so that nothing the launcher
# sends to a data address ever leaves the machine.
ip addr add "${mgmt}.1/24" dev "im${id}"
ip route add blackhole "${data}.0/24"
echo "${data}.0/24" > "$dir/data_subnet"

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
ListenAddress ${data}.$((10 + i)):22
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
  ip netns exec "$ns" unshare --mount --propagation private sh -c '
    mount -t tmpfs tmpfs "$1/private" && mount -t tmpfs tmpfs "$HOME/.cache/infer/bin" &&
    if [ -n "$3" ]; then
      mount -t tmpfs tmpfs /usr/local/bin &&
      printf "#!/bin/sh\nif [ \"\$1\" = -m ]; then echo %s; else exec /bin/uname \"\$@\"; fi\n" "$3" > /usr/local/bin/uname &&
      chmod 755 /usr/local/bin/uname
    fi &&
    if [ "$4" = "$5" ]; then ulimit -n 1024; fi &&
    if [ "$4" = "$6" ] && [ -n "$7" ]; then
      mount -t tmpfs tmpfs /usr/local/lib && cp "$7" /usr/local/lib/libnccl.so.2
    fi &&
    exec /usr/sbin/sshd -f "$2/sshd_config" -E "$2/sshd.log"' sh "$dir" "$hdir" "${FAKE_ARCH:-}" "$i" \
    "${LOW_NOFILE_HOST:-none}" "${FAKE_NCCL_HOST:-none}" "${FAKE_NCCL_LIB:-}"
  cat >> "$dir/hosts.toml" <<TOML
[[hosts]]
name = "h${i}"
address = "${mgmt}.$((10 + i))"
cpu-ranks = 2

TOML
  echo "h${i} ${ns} ${mgmt}.$((10 + i)) ${data}.$((10 + i)) ${mnic} ${dnic} $(cut -d' ' -f1,2 "$hdir/ssh_host_ed25519_key.pub")" >> "$dir/hosts.txt"
done
echo "$dir/hosts.toml"
