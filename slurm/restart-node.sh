#!/bin/bash
# Usage: slurm/restart-node.sh DIR NODE
#
# Brings a crashed fake node of the cluster in DIR back: starts its slurmd again and waits (at most 60 s) until
# SLURM lists it as IDLE (ReturnToService=2 returns a node SLURM set DOWN on registration; one an admin set DOWN,
# `scontrol update State=DOWN`, is resumed once its slurmd answers; the new slurmd cleans up the node's
# orphaned steps). A slurmd that exited before it registered (seen once on a loaded machine: the node stayed
# "down*", not responding) is started again every 10 s.
set -u
if [ $# -lt 2 ]; then echo "usage: $0 DIR NODE" >&2; exit 2; fi
D=$(realpath -m "$1"); NODE=$2
export SLURM_CONF=$D/slurm.conf
PIDFILE=$D/slurmd-$NODE.pid
start_slurmd() {
  if ! { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }; then
    slurmd -N "$NODE" || { echo "restart-node: slurmd $NODE did not start, see $D/log/slurmd-$NODE.log" >&2; exit 1; }
  fi
}
start_slurmd
for i in $(seq 300); do
  state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null)
  [ "$state" = idle ] && exit 0
  [ "$state" = down ] && scontrol update NodeName="$NODE" State=RESUME 2>/dev/null  # responding, still down
  [ $((i % 50)) = 0 ] && start_slurmd  # its slurmd gone before it registered: start it again
  sleep 0.2
done
echo "restart-node: $NODE is not idle after 60 s: $(sinfo -h -n "$NODE" -o '%T %E')" >&2
exit 1
