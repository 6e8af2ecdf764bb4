#!/bin/bash
# Usage: slurm/install-deps.sh
#
# Installs the Debian packages the throw-away test cluster needs (start-cluster.sh), only when missing:
#   slurmctld slurmd slurm-client munge   the controller, the node daemon, sbatch/srun/squeue/sinfo
#                                         (munge is a package dependency only; the cluster runs auth/none)
#   slurmdbd mariadb-server               accounting, so `sacct` (and submitit's job states) work
# Needs root (apt-get). Tested with Debian 12: slurm-wlm 22.05.8, mariadb 10.11.
# No /etc/slurm/slurm.conf is written, so Debian's own init scripts start no system daemons.
set -eu
PACKAGES="slurmctld slurmd slurm-client munge slurmdbd mariadb-server"
missing=""
for p in $PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -z "$missing" ]; then
  echo "install-deps: all SLURM packages present"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install-deps: missing Debian packages:$missing; run this script as root (it uses apt-get)" >&2
  exit 1
fi
echo "install-deps: installing$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# shellcheck disable=SC2086  # word splitting of the package list is intended
apt-get install -y -q --no-install-recommends $missing
