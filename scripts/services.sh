#!/usr/bin/env bash
# Local Redis and PostgreSQL for development and tests.
#
#   scripts/services.sh redis-up URL DATADIR     use the Redis at URL, or start one there
#   scripts/services.sh redis-down DATADIR       stop the Redis that redis-up started
#   scripts/services.sh redis-status DATADIR     exit 0 when a Redis we started is running
#   scripts/services.sh postgres-up DATADIR PORT initdb (once), start on 127.0.0.1:PORT,
#                                                create database "backlot" (owner backlot)
#   scripts/services.sh postgres-down DATADIR    stop it (pg_ctl stop -m fast)
#   scripts/services.sh postgres-status DATADIR  exit 0 when it is running
#
# Every command is idempotent: "up" on a running service succeeds and changes nothing,
# "down" on a stopped one succeeds. Stale pid files of dead processes are removed.
# Missing redis-server / PostgreSQL binaries are installed with apt-get when root.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/scripts/lib.sh"

usage() { sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }

abspath() { realpath -m -- "$1"; }

# ---------------------------------------------------------------------------- Redis

# Python with redis-py if the venv has it, else the system python (raw RESP PING).
redis_python() {
    if [[ -x $ROOT/.venv/bin/python ]] && "$ROOT/.venv/bin/python" -c 'import redis' 2>/dev/null; then
        echo "$ROOT/.venv/bin/python"
    else
        command -v python3 || die "python3 not found"
    fi
}

# redis_probe URL -> exit 0 PONG, 1 nothing answers, 2 answers but unusable (auth...),
#                    3 answers but still loading its data
redis_probe() {
    local py
    py=$(redis_python)
    "$py" - "$1" <<'PY'
import socket, sys
from urllib.parse import urlparse
url = sys.argv[1]
try:
    import redis
except ImportError:
    redis = None
if redis is not None:
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2).ping()
        sys.exit(0)
    except redis.exceptions.AuthenticationError as e:
        print(f"redis at {url}: {e}", file=sys.stderr); sys.exit(2)
    except redis.exceptions.BusyLoadingError:
        sys.exit(3)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
        sys.exit(1)
    except redis.exceptions.ResponseError as e:
        print(f"redis at {url}: {e}", file=sys.stderr); sys.exit(2)
u = urlparse(url)
try:
    s = socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379), timeout=1)
except OSError:
    sys.exit(1)
with s:
    s.settimeout(2)
    try:
        if u.password:
            user = u.username or "default"
            args = [b"AUTH", user.encode(), u.password.encode()]
            s.sendall(b"*3\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args))
            if not s.recv(1024).startswith(b"+OK"):
                sys.exit(2)
        s.sendall(b"*1\r\n$4\r\nPING\r\n")
        reply = s.recv(1024)
    except OSError:
        sys.exit(1)
if reply.startswith(b"+PONG"):
    sys.exit(0)
if reply.startswith(b"-LOADING"):
    sys.exit(3)
print(f"redis at {url}: {reply!r}", file=sys.stderr)
sys.exit(2)
PY
}

# Prints "HOST PORT PASSWORD" (PASSWORD may be empty) for a redis:// URL.
redis_url_parts() {
    python3 - "$1" <<'PY'
import sys
from urllib.parse import urlparse, unquote
u = urlparse(sys.argv[1])
if u.scheme not in ("redis", "rediss"):
    sys.exit(f"unsupported Redis URL (need redis://HOST:PORT/DB): {sys.argv[1]}")
print(u.hostname or "127.0.0.1", u.port or 6379, unquote(u.password or ""))
PY
}

redis_pidfile() { echo "$(abspath "$1")/redis.pid"; }

# Our pid if the pid file names a live redis-server; removes a stale pid file.
redis_our_pid() {
    local pidfile pid
    pidfile=$(redis_pidfile "$1")
    [[ -f $pidfile ]] || return 1
    pid=$(tr -dc '0-9' <"$pidfile")
    if pid_alive "$pid" redis-server; then
        echo "$pid"
        return 0
    fi
    log "removing stale $pidfile (pid ${pid:-?} is not running)"
    rm -f "$pidfile"
    return 1
}

redis_wait() {
    local url=$1 secs=$2 i rc
    for ((i = 0; i < secs * 5; i++)); do
        rc=0
        redis_probe "$url" 2>/dev/null || rc=$?
        [[ $rc -eq 0 ]] && return 0
        [[ $rc -eq 2 ]] && { redis_probe "$url" || true; return 2; }
        sleep 0.2
    done
    return 1
}

cmd_redis_up() {
    [[ $# -eq 2 ]] || usage
    local url=$1 datadir rc=0 pid host port password
    datadir=$(abspath "$2")
    redis_probe "$url" || rc=$?
    case $rc in
        0)
            if pid=$(redis_our_pid "$datadir"); then
                log "Redis already running at $url (started by us, pid $pid)"
            else
                log "using the Redis already answering at $url"
            fi
            return 0 ;;
        2) die "something answers at $url but refuses our PING (wrong password?)" ;;
        3)
            log "Redis at $url is loading its data; waiting"
            redis_wait "$url" 60 || die "Redis at $url did not become ready"
            return 0 ;;
    esac

    read -r host port password < <(redis_url_parts "$url") || die "bad Redis URL: $url"
    case $host in
        127.0.0.1 | localhost | ::1) ;;
        *) die "no Redis answers at $url, and I only start local ones (host is $host)" ;;
    esac

    if pid=$(redis_our_pid "$datadir"); then
        # Ours, alive, but not answering yet (starting up, or loading a large AOF).
        log "Redis pid $pid (ours) is not answering yet; waiting"
        redis_wait "$url" 30 || die "Redis pid $pid does not answer at $url; see $datadir/redis.log"
        return 0
    fi

    if ! command -v redis-server >/dev/null 2>&1; then
        apt_install redis-server
        command -v redis-server >/dev/null 2>&1 || die "redis-server still not on PATH"
    fi

    mkdir -p "$datadir"
    local args=(
        --bind 127.0.0.1 --port "$port"
        --appendonly yes --appendfsync everysec
        --dir "$datadir"
        --maxmemory-policy noeviction
        --daemonize yes
        --pidfile "$datadir/redis.pid"
        --logfile "$datadir/redis.log"
        --save ""
    )
    if [[ -n $password ]]; then args+=(--requirepass "$password"); fi
    log "starting redis-server on 127.0.0.1:$port (data in $datadir)"
    redis-server "${args[@]}" || die "redis-server failed to start; see $datadir/redis.log"

    rc=0
    redis_wait "$url" 10 || rc=$?
    if [[ $rc -ne 0 ]]; then
        tail -n 20 "$datadir/redis.log" >&2 2>/dev/null || true
        if pid=$(redis_our_pid "$datadir"); then kill -TERM "$pid" 2>/dev/null || true; fi
        die "Redis did not answer at $url within 10 s"
    fi
    pid=$(redis_our_pid "$datadir") || die "Redis answers but wrote no pid file at $datadir/redis.pid"
    log "Redis ready at $url (pid $pid)"
}

cmd_redis_down() {
    [[ $# -eq 1 ]] || usage
    local datadir pid
    datadir=$(abspath "$1")
    if ! pid=$(redis_our_pid "$datadir"); then
        log "no Redis started by us in $datadir; nothing to stop"
        return 0
    fi
    log "stopping Redis (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_pid_gone "$pid" 20; then
        log "Redis pid $pid did not stop in 20 s; killing it"
        kill -KILL "$pid" 2>/dev/null || true
        wait_pid_gone "$pid" 5 || die "could not stop Redis pid $pid"
    fi
    rm -f "$datadir/redis.pid"
    log "Redis stopped"
}

cmd_redis_status() {
    [[ $# -eq 1 ]] || usage
    local pid
    if pid=$(redis_our_pid "$1" 2>/dev/null); then
        echo "redis running (pid $pid)"
        return 0
    fi
    echo "redis not running (none started by us in $1)"
    return 1
}

# ------------------------------------------------------------------------ PostgreSQL

PG_BIN=${PG_BIN:-}
PG_OS_USER=postgres

pg_find_bin() {
    local want=${1:-} d
    if [[ -n $PG_BIN ]]; then
        [[ -x $PG_BIN/pg_ctl ]] || die "PG_BIN=$PG_BIN has no pg_ctl"
        return 0
    fi
    # The version the data dir was made with, if there is one.
    if [[ -n $want && -x /usr/lib/postgresql/$want/bin/pg_ctl ]]; then
        PG_BIN=/usr/lib/postgresql/$want/bin
        return 0
    fi
    if [[ -z $want ]]; then
        d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | while read -r b; do
            [[ -x $b/pg_ctl && -x $b/initdb && -x $b/postgres ]] && echo "$b"
        done | tail -n 1 || true)
        if [[ -n $d ]]; then PG_BIN=$d; return 0; fi
    fi
    if command -v pg_ctl >/dev/null 2>&1; then
        d=$(dirname "$(readlink -f "$(command -v pg_ctl)")")
        if [[ -x $d/initdb && -x $d/postgres ]]; then
            if [[ -z $want ]] || "$d/pg_ctl" --version | grep -q " $want\b"; then
                PG_BIN=$d
                return 0
            fi
        fi
    fi
    return 1
}

pg_ensure_bin() {
    local want=${1:-}
    pg_find_bin "$want" && return 0
    if [[ -n $want ]]; then
        die "the data dir was made by PostgreSQL $want, whose binaries are not installed (apt-get install postgresql-$want, or delete the data dir)"
    fi
    apt_install postgresql
    pg_find_bin || die "PostgreSQL binaries still not found under /usr/lib/postgresql/*/bin"
}

# Run a server-side command as the right OS user (PostgreSQL refuses to run as root).
pg_as_owner() {
    if is_root; then
        (cd / && runuser -u "$PG_OS_USER" -- "$@")
    else
        "$@"
    fi
}

pg_ensure_os_user() {
    is_root || return 0
    id "$PG_OS_USER" >/dev/null 2>&1 && return 0
    log "creating system user $PG_OS_USER"
    useradd --system --user-group --home-dir /var/lib/postgresql --no-create-home \
        --shell /bin/sh "$PG_OS_USER"
}

# The directory really used for DATADIR. When root and the postgres user cannot reach
# DATADIR (e.g. the checkout lives under /root, mode 700), the cluster lives under
# /var/tmp/backlot-pg/ and DATADIR becomes a symlink to it.
pg_real_dir() {
    local dir parent real
    dir=$(abspath "$1")
    if ! is_root || [[ -f $dir/PG_VERSION ]]; then
        echo "$dir"; return 0
    fi
    parent=$(dirname "$dir")
    mkdir -p "$parent"
    if runuser -u "$PG_OS_USER" -- test -x "$parent" 2>/dev/null; then
        echo "$dir"; return 0
    fi
    real=/var/tmp/backlot-pg/$(printf '%s' "$dir" | sha1sum | cut -c1-16)
    mkdir -p /var/tmp/backlot-pg "$real"
    chmod 755 /var/tmp/backlot-pg
    if [[ -d $dir && ! -L $dir ]]; then rmdir "$dir" 2>/dev/null || die "$dir exists and the postgres user cannot reach it"; fi
    [[ -L $dir ]] || ln -s "$real" "$dir"
    log "the postgres user cannot reach $parent; the cluster lives in $real ($dir links to it)"
    echo "$real"
}

# Remove postmaster.pid (and socket lock files) when its pid is not a live postgres,
# after giving the processes of a crashed server a moment to go away.
pg_clean_stale_pid() {
    local dir=$1 pidfile=$1/postmaster.pid pid f lpid i
    [[ -f $pidfile ]] || return 0
    pid=$(head -n 1 "$pidfile" | tr -dc '0-9')
    pid_alive "$pid" postgres && return 0
    log "removing stale $pidfile (pid ${pid:-?} is not a running postgres)"
    pg_wait_orphans "$dir" "$pid"
    rm -f "$pidfile"
    for f in "$dir"/.s.PGSQL.*.lock; do
        [[ -f $f ]] || continue
        lpid=$(head -n 1 "$f" | tr -dc '0-9')
        if ! pid_alive "$lpid" postgres; then rm -f "$f" "${f%.lock}"; fi
    done
}

# Wait (at most 15 s) until a dead postmaster PID is reaped and the server processes
# it left behind (they run with the data dir as their cwd) have exited.
pg_wait_orphans() {
    local dir=$1 pid=${2:-} i p left
    for ((i = 0; i < 150; i++)); do
        left=""
        if [[ -n $pid && -e /proc/$pid ]]; then left=$pid; fi
        for p in /proc/[0-9]*; do
            [[ $(readlink "$p/cwd" 2>/dev/null) == "$dir" ]] || continue
            [[ $(cat "$p/comm" 2>/dev/null) == postgres ]] && left+=" ${p#/proc/}"
        done
        [[ -z $left ]] && return 0
        [[ $i -eq 0 ]] && log "waiting for the processes of the dead server to exit:$left"
        sleep 0.1
    done
    log "warning: processes of a dead server are still there:$left"
}

pg_running() {
    local dir=$1
    [[ -f $dir/PG_VERSION ]] || return 1
    pg_clean_stale_pid "$dir"
    [[ -f $dir/postmaster.pid ]] || return 1
    pg_as_owner "$PG_BIN/pg_ctl" status -D "$dir" >/dev/null 2>&1
}

pg_ready() { "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$1" -U backlot -d postgres -t 2 >/dev/null 2>&1; }

pg_psql() {
    local port=$1; shift
    PGCONNECT_TIMEOUT=5 "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$port" -U backlot "$@"
}

pg_ensure_database() {
    local port=$1 i
    for ((i = 0; i < 150; i++)); do
        pg_ready "$port" && break
        sleep 0.2
    done
    pg_ready "$port" || die "PostgreSQL on 127.0.0.1:$port is not accepting connections"
    if [[ $(pg_psql "$port" -d postgres -tAc "select 1 from pg_database where datname = 'backlot'") != 1 ]]; then
        log "creating database backlot"
        pg_psql "$port" -d postgres -c 'create database backlot owner backlot'
    fi
}

cmd_postgres_up() {
    [[ $# -eq 2 ]] || usage
    local datadir=$1 port=$2 dir version="" running_port sockdir opts
    [[ $port =~ ^[0-9]+$ ]] || die "bad port: $port"

    if [[ -f $(abspath "$datadir")/PG_VERSION ]]; then version=$(<"$(abspath "$datadir")/PG_VERSION"); fi
    pg_ensure_bin "$version"
    pg_ensure_os_user
    dir=$(pg_real_dir "$datadir")

    if pg_running "$dir"; then
        running_port=$(sed -n 4p "$dir/postmaster.pid")
        if [[ $running_port != "$port" ]]; then
            die "the cluster in $dir is already running on port $running_port, not $port (stop it: $0 postgres-down $datadir)"
        fi
        log "PostgreSQL already running on 127.0.0.1:$port (data in $dir)"
        pg_ensure_database "$port"
        return 0
    fi

    if pg_ready "$port"; then
        # Another server holds the port. Use it if it takes our role, like redis-up does.
        if pg_psql "$port" -d postgres -tAc 'select 1' >/dev/null 2>&1; then
            log "using the PostgreSQL already answering on 127.0.0.1:$port"
            pg_ensure_database "$port"
            return 0
        fi
        die "port $port is taken by a PostgreSQL that does not accept role backlot"
    fi

    mkdir -p "$dir"
    if is_root; then chown "$PG_OS_USER:" "$dir"; fi
    chmod 700 "$dir"

    if [[ ! -f $dir/PG_VERSION ]]; then
        if [[ -n $(ls -A "$dir") ]]; then die "$dir is not empty and holds no cluster (no PG_VERSION)"; fi
        log "initdb $dir ($("$PG_BIN/pg_ctl" --version))"
        pg_as_owner "$PG_BIN/initdb" -D "$dir" -U backlot --auth=trust -E UTF8 --locale=C >"$dir.initdb.log" 2>&1 || {
            cat "$dir.initdb.log" >&2
            die "initdb failed"
        }
        rm -f "$dir.initdb.log"
    fi

    # Unix socket inside the data dir, unless the path is too long for a socket name.
    sockdir=$dir
    if (( ${#sockdir} + 20 > 100 )); then sockdir=""; fi
    opts="-c listen_addresses=127.0.0.1 -p $port -c unix_socket_directories='$sockdir'"
    opts+=" -c max_connections=200 -c fsync=off -c synchronous_commit=off -c full_page_writes=off"

    log "starting PostgreSQL on 127.0.0.1:$port (data in $dir)"
    if ! pg_as_owner "$PG_BIN/pg_ctl" start -D "$dir" -l "$dir/server.log" -w -t 60 -o "$opts" >/dev/null; then
        tail -n 30 "$dir/server.log" >&2 2>/dev/null || true
        die "PostgreSQL failed to start; see $dir/server.log"
    fi
    pg_ensure_database "$port"
    log "PostgreSQL ready: postgres://backlot@127.0.0.1:$port/backlot"
}

cmd_postgres_down() {
    [[ $# -eq 1 ]] || usage
    local dir version
    dir=$(abspath "$1")
    if [[ ! -f $dir/PG_VERSION ]]; then
        log "no PostgreSQL cluster in $1; nothing to stop"
        return 0
    fi
    version=$(<"$dir/PG_VERSION")
    pg_find_bin "$version" || die "PostgreSQL $version binaries not found"
    if ! pg_running "$dir"; then
        log "PostgreSQL in $dir is not running"
        return 0
    fi
    log "stopping PostgreSQL (data in $dir)"
    if ! pg_as_owner "$PG_BIN/pg_ctl" stop -D "$dir" -m fast -w -t 30 >/dev/null; then
        log "fast shutdown timed out; using immediate"
        pg_as_owner "$PG_BIN/pg_ctl" stop -D "$dir" -m immediate -w -t 30 >/dev/null || die "could not stop PostgreSQL in $dir"
    fi
    log "PostgreSQL stopped"
}

cmd_postgres_status() {
    [[ $# -eq 1 ]] || usage
    local dir
    dir=$(abspath "$1")
    if [[ -f $dir/PG_VERSION ]] && pg_find_bin "$(<"$dir/PG_VERSION")" && pg_running "$dir"; then
        echo "postgres running on port $(sed -n 4p "$dir/postmaster.pid") (data in $dir)"
        return 0
    fi
    echo "postgres not running (data dir $1)"
    return 1
}

# ---------------------------------------------------------------------------- main

[[ $# -ge 1 ]] || usage
sub=$1; shift
case $sub in
    redis-up) cmd_redis_up "$@" ;;
    redis-down) cmd_redis_down "$@" ;;
    redis-status) cmd_redis_status "$@" ;;
    postgres-up) cmd_postgres_up "$@" ;;
    postgres-down) cmd_postgres_down "$@" ;;
    postgres-status) cmd_postgres_status "$@" ;;
    -h | --help | help) usage ;;
    *) log "unknown command: $sub"; usage ;;
esac
