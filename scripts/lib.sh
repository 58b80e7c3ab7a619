# shellcheck shell=bash
# Helpers shared by scripts/*.sh. Source it; it defines functions only.

log()  { printf '[backlot] %s\n' "$*" >&2; }
die()  { printf '[backlot] error: %s\n' "$*" >&2; exit 1; }

is_root() { [[ $(id -u) -eq 0 ]]; }

# apt_install PKG... : install Debian packages when we are root on a Debian/Ubuntu
# machine; otherwise print exactly what to install and fail.
# While installing, a temporary /usr/sbin/policy-rc.d stops the packages from
# starting their own daemons (a stray redis on 6379 or postgres on 5432).
_BACKLOT_APT_UPDATED=0
apt_install() {
    if ! is_root || ! command -v apt-get >/dev/null 2>&1; then
        printf '[backlot] error: missing system packages: %s\n' "$*" >&2
        printf '[backlot] install them with:  sudo apt-get update && sudo apt-get install -y %s\n' "$*" >&2
        exit 1
    fi
    local policy=/usr/sbin/policy-rc.d made_policy=0 rc=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\n# temporary, written by backlot scripts/lib.sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        made_policy=1
    fi
    log "apt-get install -y $*"
    export DEBIAN_FRONTEND=noninteractive
    if [[ $_BACKLOT_APT_UPDATED -eq 0 ]]; then
        apt-get update -qq || rc=$?
        _BACKLOT_APT_UPDATED=1
    fi
    if [[ $rc -eq 0 ]]; then
        apt-get install -y -qq --no-install-recommends "$@" || rc=$?
    fi
    if [[ $made_policy -eq 1 ]]; then rm -f "$policy"; fi
    [[ $rc -eq 0 ]] || die "apt-get install $* failed (exit $rc)"
}

# pid_alive PID [COMM-PREFIX]: the process exists (and its name starts with COMM-PREFIX).
pid_alive() {
    local pid=$1 want=${2:-}
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    # /proc sees processes of other users too (kill -0 would fail with EPERM).
    if [[ -d /proc/self ]]; then
        [[ -d /proc/$pid ]] || return 1
        # A zombie is as good as gone.
        [[ $(awk '/^State:/ {print $2}' "/proc/$pid/status" 2>/dev/null) != Z ]] || return 1
    else
        ps -p "$pid" >/dev/null 2>&1 || return 1
    fi
    [[ -z $want ]] && return 0
    local comm=""
    if [[ -r /proc/$pid/comm ]]; then
        comm=$(<"/proc/$pid/comm")
    else
        comm=$(ps -p "$pid" -o comm= 2>/dev/null || true)
    fi
    # ps/comm may show the full path or a truncated name.
    comm=${comm##*/}
    [[ $comm == "$want"* ]]
}

# wait_pid_gone PID SECONDS: poll until PID is gone; non-zero on timeout.
wait_pid_gone() {
    local pid=$1 secs=$2 i
    for ((i = 0; i < secs * 10; i++)); do
        pid_alive "$pid" || return 0
        sleep 0.1
    done
    return 1
}

# load_dotenv FILE: export KEY=VALUE lines from FILE for keys not already set in the
# environment (the environment wins, as with docker compose). No shell expansion.
load_dotenv() {
    local file=$1 line key val
    [[ -f $file ]] || return 0
    while IFS= read -r line || [[ -n $line ]]; do
        line=${line%$'\r'}
        [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
        line=${line#export }
        [[ $line == *=* ]] || continue
        key=${line%%=*}
        key=${key//[[:space:]]/}
        val=${line#*=}
        [[ $key =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || continue
        if [[ $val =~ ^\"(.*)\"$ || $val =~ ^\'(.*)\'$ ]]; then
            val=${BASH_REMATCH[1]}
        fi
        if [[ -z ${!key+x} ]]; then
            export "$key=$val"
        fi
    done <"$file"
}
