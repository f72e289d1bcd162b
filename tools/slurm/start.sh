#!/usr/bin/env bash
# Start a single-node Slurm cluster on this machine (munge, slurmctld, slurmd), for the tests and
# for trying dataparallel under srun/salloc/sbatch. Idempotent: does nothing when Slurm answers.
#
#   tools/slurm/start.sh            # start it (as root), installing nothing
#   tools/slurm/start.sh --install  # apt-get install slurmctld slurmd slurm-client munge first
#                                   # (and libpmix-dev, so that srun --mpi=pmix can be tried)
#
# The node declares CPUs=4 whatever the machine has (SlurmdParameters=config_overrides), so that
# jobs of 3-4 tasks fit on a small machine. Processes are tracked without cgroups
# (proctrack/linuxproc, task/none), which works in containers. Exit status: 0 when the cluster
# answers, 1 when it cannot be started (the reason on stderr).
set -euo pipefail

CPUS=${SLURM_TEST_CPUS:-4}
CONF=/etc/slurm/slurm.conf
LOGS=/var/log/slurm
say() { echo "tools/slurm/start.sh: $*" >&2; }

if [ "${1:-}" = "--install" ] && ! command -v slurmctld >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    say "installing Slurm needs root and apt-get"; exit 1
  fi
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
     apt-get install -y -qq slurmctld slurmd slurm-client munge libpmix-dev) >/dev/null 2>&1 \
    || { say "apt-get install slurmctld slurmd slurm-client munge failed"; exit 1; }
fi
for tool in munged slurmctld slurmd srun scontrol; do
  command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] \
    || { say "$tool is not installed (apt-get install slurmctld slurmd slurm-client munge)"; exit 1; }
done
if [ -f "$CONF" ] && scontrol ping 2>/dev/null | grep -q 'is UP' \
   && sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
  exit 0  # already running
fi
[ "$(id -u)" = 0 ] || { say "starting Slurm needs root"; exit 1; }

NODE=$(hostname -s)
mkdir -p /etc/slurm "$LOGS" /var/spool/slurmctld /var/spool/slurmd /run/munge /var/log/munge
chown slurm:slurm /var/spool/slurmctld "$LOGS"
chown munge:munge /run/munge /var/log/munge
chmod 0755 /run/munge

# munge: the key comes with the package; started by hand as its user (no systemd here).
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
fi
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged --force
fi

cat > "$CONF.new" <<CONFEOF
# Written by dataparallel's tools/slurm/start.sh: one node, $CPUS CPUs, no cgroups.
ClusterName=dataparallel
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
KillWait=5
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONFEOF
mv "$CONF.new" "$CONF"

if ! pgrep -x slurmctld >/dev/null && ! /usr/sbin/slurmctld -c; then
  say "slurmctld failed to start:"; tail -5 "$LOGS/slurmctld.log" >&2; exit 1
fi
if ! pgrep -x slurmd >/dev/null && ! /usr/sbin/slurmd -N "$NODE"; then
  say "slurmd failed to start:"; tail -5 "$LOGS/slurmd.log" >&2; exit 1
fi

# Wait for the node to be idle (conditions, not a fixed sleep), for at most a minute.
for _ in $(seq 600); do
  if scontrol ping 2>/dev/null | grep -q 'is UP'; then
    state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
    case "$state" in
      idle*|mixed*|allocated*) exit 0 ;;
      down*|drain*) scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true ;;
    esac
  fi
  sleep 0.1
done
say "Slurm did not come up within a minute; see $LOGS/slurmctld.log and $LOGS/slurmd.log"
exit 1
