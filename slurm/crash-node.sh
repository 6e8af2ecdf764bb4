#!/bin/bash
# Usage: slurm/crash-node.sh DIR NODE
#
# Simulates a hard crash of fake node NODE (e.g. node2) of the cluster in DIR (slurm/start-cluster.sh): SIGKILLs
# at once that node's slurmd, its slurmstepd (found by the node's log file they keep open), every process in
# the stepds' sessions (the job's tasks on that node) and every process its slurmd started elsewhere (by their
# environment: the batch host's rendezvous, in a session of its own). Nothing is told to SLURM: like a real crash, slurmctld
# only notices that the node went silent (NOT_RESPONDING after ~SlurmdTimeout, DOWN later).
# Prints "crashed NODE at EPOCH_SECONDS: PIDS". Bring the node back with slurm/restart-node.sh DIR NODE.
set -u
if [ $# -lt 2 ]; then echo "usage: $0 DIR NODE" >&2; exit 2; fi
D=$(realpath -m "$1"); NODE=$2
PIDFILE=$D/slurmd-$NODE.pid
if ! [ -f "$PIDFILE" ] || ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
  echo "crash-node: $NODE has no running slurmd in $D (no live $PIDFILE)" >&2; exit 1
fi
victims=$(cat "$PIDFILE")
for p in $(pgrep -x slurmstepd); do
  ls -l "/proc/$p/fd" 2>/dev/null | grep -q "$D/log/slurmd-$NODE.log" && victims="$victims $p"
done
pids=$victims
for v in $victims; do
  sid=$(ps -o sid= -p "$v" | tr -d ' ')
  [ -n "$sid" ] && pids="$pids $(ps -eo pid=,sid= | awk -v s="$sid" '$2 == s { print $1 }')"
done
# and whatever else runs "on" the node: processes started by its slurmd (their environment names it), such as
# the batch host's rendezvous store and coordinator, which detach into their own session
for p in $(grep -lza "^SLURMD_NODENAME=$NODE$" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); do
  pids="$pids $p"
done
pids=$(echo "$pids" | tr ' ' '\n' | sort -un | tr '\n' ' ')
# A crash takes every process of the node at once: none may act on the death of another. Killed one after
# the other, they do: srun, outliving the others, had every other node's tasks killed ("srun: forcing job
# termination"; their slurmstepd SIGKILLed them ~20 ms after the crash). So they are frozen together first (the cgroup freezer), killed while frozen,
# and die as they thaw, before any of them runs again. Without a writable freezer: one kill after another.
freezer=/sys/fs/cgroup/freezer
cg=$freezer/oobleck-crash-$NODE-$$
if [ -w "$freezer" ] && mkdir "$cg" 2>/dev/null; then
  for p in $pids; do echo "$p" > "$cg/cgroup.procs" 2>/dev/null; done
  echo FROZEN > "$cg/freezer.state"
  for _ in $(seq 100); do [ "$(cat "$cg/freezer.state")" = FROZEN ] && break; sleep 0.01; done
fi
# shellcheck disable=SC2086
kill -9 $pids 2>/dev/null
if [ -d "$cg" ]; then
  echo THAWED > "$cg/freezer.state"
  for _ in $(seq 100); do [ -z "$(cat "$cg/cgroup.procs")" ] && break; sleep 0.01; done
  rmdir "$cg" 2>/dev/null
fi
echo "crashed $NODE at $(date +%s.%N): $pids"
