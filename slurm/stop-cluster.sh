#!/bin/bash
# Usage: slurm/stop-cluster.sh DIR
#
# Stops everything slurm/start-cluster.sh DIR started, and nothing else: jobs are cancelled first (while
# slurmctld still runs), then the daemons are stopped by the PIDs in their pid files (SIGTERM, SIGKILL after
# 10 s), then leftovers of this cluster's jobs are SIGKILLed: slurmstepd that keep DIR's logs open, and processes
# whose environment names this cluster's SLURM_CONF and a SLURM_JOB_ID (tasks orphaned by a crashed node).
# Idempotent (a stopped or half-started cluster is fine), bounded (~15 s at most), always exits 0. DIR is kept
# (logs); remove it yourself.
if [ $# -lt 1 ]; then echo "usage: $0 DIR" >&2; exit 2; fi
D=$(realpath -m "$1")
export SLURM_CONF=$D/slurm.conf
alive() { [ -f "$1" ] && kill -0 "$(cat "$1" 2>/dev/null)" 2>/dev/null; }
pidfiles() { ls "$D"/slurmd-*.pid "$D"/slurmctld.pid "$D"/slurmdbd.pid "$D"/db/mariadb.pid 2>/dev/null; }

# 1. Cancel jobs and give them 5 s to end, while slurmctld can still clean up.
if alive "$D/slurmctld.pid"; then
  jobs=$(timeout 5 squeue -h -o %i 2>/dev/null)
  if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086
    timeout 5 scancel --quiet $jobs 2>/dev/null
    for _ in $(seq 25); do [ -z "$(timeout 5 squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi

# 2. The daemons, by pid file: SIGTERM, then SIGKILL after 10 s.
for f in $(pidfiles); do alive "$f" && kill "$(cat "$f")" 2>/dev/null; done
for _ in $(seq 50); do
  left=0; for f in $(pidfiles); do alive "$f" && left=1; done
  [ $left = 0 ] && break; sleep 0.2
done
for f in $(pidfiles); do alive "$f" && kill -9 "$(cat "$f")" 2>/dev/null; done

# 3. Leftovers: step daemons of this cluster (they keep DIR/log/slurmd-*.log open) and job processes.
for p in $(pgrep -x slurmstepd); do
  ls -l "/proc/$p/fd" 2>/dev/null | grep -q "$D/log/" && kill -9 "$p" 2>/dev/null
done
for e in /proc/[0-9]*/environ; do
  p=${e#/proc/}; p=${p%/environ}
  [ "$p" = $$ ] && continue
  env=$( { tr '\0' '\n' <"$e"; } 2>/dev/null) || continue
  grep -qx "SLURM_CONF=$D/slurm.conf" <<<"$env" && grep -q "^SLURM_JOB_ID=" <<<"$env" && kill -9 "$p" 2>/dev/null
done
rm -f "$D"/slurmd-*.pid "$D"/slurmctld.pid "$D"/slurmdbd.pid "$D"/db/mariadb.pid
exit 0
