#!/bin/bash
# Usage: slurm/start-cluster.sh DIR [NNODES=3] [acct]
#
# Starts a throw-away, real multi-node SLURM cluster on this one machine, for tests and demos:
# one slurmctld and NNODES slurmd in Debian's "multiple slurmd" mode (fake nodes node1..NNODES, each its own
# slurmd with its own port, all on 127.0.0.1), AuthType=auth/none (munged is not needed), one partition
# "debug" holding every node. With the third argument "acct", also a private MariaDB and slurmdbd, so that
# `sacct` works (submitit needs it to see the state of ended jobs).
# Everything (config, state, spool, logs, pid files, database) lives in DIR; nothing in /etc is touched.
# Use the cluster with `export SLURM_CONF=DIR/slurm.conf` (or `source DIR/env`); stop it with stop-cluster.sh.
#
# Needs root and the Debian packages of slurm/install-deps.sh. Ports: OOBLECK_SLURMCTLD_PORT (16817),
# node K listens on OOBLECK_SLURMD_PORT_BASE+K (17000+K).
# Timeouts chosen for fast tests, not production: a silent node is NOT_RESPONDING after ~SlurmdTimeout and DOWN
# some 10-20 s later (measured ~25-30 s); ReturnToService=2 lets a restarted slurmd bring its node back to IDLE.
set -eu
if [ $# -lt 1 ]; then echo "usage: $0 DIR [NNODES] [acct]" >&2; exit 2; fi
D=$(realpath -m "$1"); N=${2:-3}; ACCT=${3:-}
CTLD_PORT=${OOBLECK_SLURMCTLD_PORT:-16817}
NODE_PORT_BASE=${OOBLECK_SLURMD_PORT_BASE:-17000}
HERE=$(dirname "$(realpath "$0")")
export SLURM_CONF=$D/slurm.conf

fail() { echo "start-cluster: $*" >&2; "$HERE/stop-cluster.sh" "$D" >/dev/null 2>&1; exit 1; }
# wait_for TRIES COMMAND...: retry COMMAND every 0.2 s, at most TRIES times.
wait_for() { local n=$1; shift; for _ in $(seq "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done; return 1; }

for f in "$D"/slurmctld.pid "$D"/slurmd-*.pid; do
  if [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null; then
    echo "start-cluster: a cluster is already running in $D; stop it first: slurm/stop-cluster.sh $D" >&2; exit 1
  fi
done
command -v slurmctld >/dev/null || { echo "start-cluster: SLURM is not installed; run slurm/install-deps.sh" >&2; exit 1; }

mkdir -p "$D"/{state,spool,log}
chmod 755 "$D"  # job steps of other users (and mariadbd) must reach files in DIR
if [ "$ACCT" = acct ]; then
  ACCTLINES="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux"
else
  ACCTLINES="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi
cat > "$D/slurm.conf" <<CONF
ClusterName=oobleck-test
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
SlurmctldPort=$CTLD_PORT
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobCompType=jobcomp/none
$ACCTLINES
ReturnToService=2
SlurmdTimeout=10
MessageTimeout=5
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
MailProg=/bin/true
CONF
# the machine's cores: nproc alone reports OMP_NUM_THREADS when that is set (the tests set it to 1)
CPUS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
for i in $(seq 1 "$N"); do
  echo "NodeName=node$i NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$((NODE_PORT_BASE + i))" \
       "CPUs=$CPUS RealMemory=1000 State=UNKNOWN" >> "$D/slurm.conf"
  mkdir -p "$D/spool/node$i"
done
echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$D/slurm.conf"
echo "export SLURM_CONF=$D/slurm.conf" > "$D/env"

if [ "$ACCT" = acct ]; then
  # A private MariaDB on a unix socket in DIR (no network), run as root: this is a throw-away test database.
  mkdir -p "$D/db"
  mariadb-install-db --user=root --datadir="$D/db" --auth-root-authentication-method=socket \
    >"$D/log/mariadb-install.log" 2>&1 || fail "mariadb-install-db failed, see $D/log/mariadb-install.log"
  nohup /usr/sbin/mariadbd --no-defaults --user=root --datadir="$D/db" --socket="$D/db/mysqld.sock" \
    --skip-networking --pid-file="$D/db/mariadb.pid" >"$D/log/mariadb.log" 2>&1 &
  wait_for 150 mariadb -S "$D/db/mysqld.sock" -e 'select 1' || fail "MariaDB did not start, see $D/log/mariadb.log"
  cat > "$D/slurmdbd.conf" <<CONF
AuthType=auth/none
DbdHost=localhost
SlurmUser=root
PidFile=$D/slurmdbd.pid
LogFile=$D/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
StoragePort=0
CONF
  chmod 600 "$D/slurmdbd.conf"  # slurmdbd refuses a readable config
  # slurmdbd.conf has no socket option; libmariadb honours MYSQL_UNIX_PORT. slurmdbd finds its config next to
  # SLURM_CONF.
  MYSQL_UNIX_PORT="$D/db/mysqld.sock" slurmdbd || fail "slurmdbd did not start, see $D/log/slurmdbd.log"
  wait_for 150 sacctmgr -n list cluster || fail "slurmdbd does not answer, see $D/log/slurmdbd.log"
  sacctmgr -i add cluster oobleck-test >/dev/null 2>&1 || true  # already there when DIR is reused
fi

slurmctld || fail "slurmctld did not start, see $D/log/slurmctld.log"
for i in $(seq 1 "$N"); do slurmd -N "node$i" || fail "slurmd node$i did not start, see $D/log/slurmd-node$i.log"; done
all_idle() { [ "$(sinfo -h -t idle -o %D)" = "$N" ]; }
wait_for 150 all_idle || fail "the $N nodes did not become idle within 30 s; see $D/log/"
sinfo -N
