#!/bin/sh
# A real OpenSSH server on loopback for trying `rsrun --hosts` on one machine (multinode.md §5.3):
# "hosts" h1, h2, h3 = 127.0.0.1, .2, .3 on PORT, with their own keys in DIR. Needs openssh-server.
#   scripts/loopback-sshd.sh DIR [PORT]    then: rsrun -H h1:2,h2:2,h3:2 --ssh-config DIR/ssh_config ...
#   stop: kill "$(cat DIR/sshd.pid)"; rm -rf DIR
set -eu
D=$1; P=${2:-2222}
mkdir -p "$D" /run/sshd; chmod 700 "$D"; D=$(cd "$D" && pwd)
[ -f "$D/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -f "$D/host_ed25519" -C test-host
[ -f "$D/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -f "$D/id_ed25519" -C test-user
cp "$D/id_ed25519.pub" "$D/authorized_keys"
for ip in 127.0.0.1 127.0.0.2 127.0.0.3; do echo "[$ip]:$P $(cut -d' ' -f1,2 "$D/host_ed25519.pub")"; done > "$D/known_hosts"
cat > "$D/sshd_config" <<CFG
Port $P
ListenAddress 127.0.0.1
ListenAddress 127.0.0.2
ListenAddress 127.0.0.3
HostKey $D/host_ed25519
PidFile $D/sshd.pid
AuthorizedKeysFile $D/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
MaxStartups 200:30:400
MaxSessions 200
CFG
cat > "$D/ssh_config" <<CFG
Host h1 h2 h3
  User $(id -un)
  Port $P
  IdentityFile $D/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile $D/known_hosts
  StrictHostKeyChecking yes
  BatchMode yes
  ConnectTimeout 5
Host h1
  HostName 127.0.0.1
Host h2
  HostName 127.0.0.2
Host h3
  HostName 127.0.0.3
CFG
/usr/sbin/sshd -t -f "$D/sshd_config"
/usr/sbin/sshd -f "$D/sshd_config" -E "$D/sshd.log"   # daemonizes; writes $D/sshd.pid
sleep 0.5
ssh -F "$D/ssh_config" h2 true && echo "sshd on 127.0.0.{1,2,3}:$P; ssh config: $D/ssh_config"
