#!/usr/bin/env bash
# A one-node Slurm on this machine, to run the SLURM templates of scripts/slurm/ under a real Slurm
# (`make slurm`; tests/test_slurm.py).
#
# Installs what is missing of slurmctld, slurmd, the client commands and munge from the Debian or
# Ubuntu packages (as root), writes a minimal config for one node named `localhost` with this
# machine's CPUs (no cgroups, no accounting), makes a munge key, starts munged, slurmctld and slurmd
# where they are not running, and waits until the node is idle. Running it again changes nothing
# that already works, and takes a second.
#
#   JAXDIST_SLURM_STATE  where the daemons keep their state, pid and log files
#                        (default /var/lib/jaxdist-slurm)
#
# The config goes to /etc/slurm/slurm.conf, where the packaged commands look, so that `sbatch`,
# `squeue` and `sinfo` need no setting; a slurm.conf written by anything else is left alone and the
# script stops.
set -euo pipefail

STATE=${JAXDIST_SLURM_STATE:-/var/lib/jaxdist-slurm}
CONF=/etc/slurm/slurm.conf
NODE=localhost
MARK="# written by jaxdist .ci/local_cluster.sh"
# The same script's mark from when it lived under scripts/slurm/: its config is rewritten with the one above.
EARLIER_MARK="# written by jaxdist scripts/slurm/local_cluster.sh"

say() { echo "local_cluster: $*"; }
fail() { echo "local_cluster: error: $*" >&2; exit 1; }

install_packages() {
    local missing=0
    for command in sbatch slurmctld slurmd munged; do
        command -v "$command" >/dev/null 2>&1 || missing=1
    done
    [ "$missing" = 0 ] && return
    [ "$(id -u)" = 0 ] || fail "Slurm is not installed and installing it needs root: run as root, or install slurmctld, slurmd, slurm-client and munge"
    command -v apt-get >/dev/null || fail "Slurm is not installed and there is no apt-get: install slurmctld, slurmd, slurm-client and munge"
    say "installing slurmctld, slurmd, slurm-client and munge"
    local started=$SECONDS
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # No recommended packages: the docs and the accounting database are not needed.
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
    say "installed in $((SECONDS - started)) s"
}

write_config() {
    if [ -e "$CONF" ] && ! grep -qxF -e "$MARK" -e "$EARLIER_MARK" "$CONF"; then
        fail "$CONF exists and was not written by this script; it is left alone (this machine has its own Slurm)"
    fi
    mkdir -p "$STATE/slurmctld" "$STATE/slurmd" /etc/slurm
    local wanted
    wanted=$(cat <<EOF
$MARK
ClusterName=jaxdist-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# No cgroups: processes are tracked by their parent ids, tasks are not bound to CPUs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# A job asking for more than the partition allows is refused when submitted, not left pending.
EnforcePartLimits=ALL
# Finished jobs stay visible to scontrol for 10 minutes.
MinJobAge=600
# Tasks get SIGTERM, then SIGKILL this many seconds later (a cancel, a requeue, the time limit).
KillWait=30
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=04:00:00 State=UP
EOF
)
    if [ -e "$CONF" ] && [ "$(cat "$CONF")" = "$wanted" ]; then
        CONFIG_CHANGED=0
    else
        printf '%s\n' "$wanted" >"$CONF"
        CONFIG_CHANGED=1
        say "wrote $CONF"
    fi
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return
    fi
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile=/etc/munge/munge.key
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        fi
    fi
    # munged insists on these owners and modes.
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /etc/munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge
    chmod 0700 /etc/munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge
    chmod 0400 /etc/munge/munge.key
    say "starting munged"
    runuser -u munge -- munged
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 0.1
    done
    fail "munged did not answer; see /var/log/munge/munged.log"
}

running() {  # running NAME PIDFILE: the daemon whose pid is in PIDFILE is alive
    local pid
    pid=$(cat "$2" 2>/dev/null) || return 1
    [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ]
}

start_slurm() {
    local started=0
    if ! running slurmctld "$STATE/slurmctld.pid"; then
        say "starting slurmctld"
        slurmctld
        started=1
    fi
    if ! running slurmd "$STATE/slurmd.pid"; then
        say "starting slurmd"
        slurmd -N "$NODE"
        started=1
    fi
    if [ "$started" = 0 ] && [ "$CONFIG_CHANGED" = 1 ]; then
        scontrol reconfigure
    fi
}

wait_idle() {
    local state=""
    for _ in $(seq 120); do
        state=$(sinfo --noheader --nodes="$NODE" --format=%T 2>/dev/null | head -n 1) || true
        case "$state" in
            idle | mixed | allocated | completing) say "node $NODE is $state ($(nproc) CPUs, partition local)"; return ;;
            down* | drain* | fail*) scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
        esac
        sleep 0.5
    done
    fail "node $NODE is '${state:-not reported}' after 60 s; see $STATE/slurmctld.log and $STATE/slurmd.log"
}

PATH=$PATH:/usr/sbin:/sbin
install_packages
write_config
start_munge
start_slurm
wait_idle
