#!/usr/bin/env bash
# Local Redis, PostgreSQL and RabbitMQ for development and tests.
#
#   scripts/services.sh redis-up URL DATADIR     use the Redis at URL, or start one there
#   scripts/services.sh redis-down DATADIR       stop the Redis that redis-up started
#   scripts/services.sh redis-status DATADIR     exit 0 when a Redis we started is running
#   scripts/services.sh postgres-up DATADIR PORT initdb (once), start on 127.0.0.1:PORT,
#                                                create database "backlot" (owner backlot)
#   scripts/services.sh postgres-down DATADIR    stop it (pg_ctl stop -m fast)
#   scripts/services.sh postgres-status DATADIR  exit 0 when it is running
#   scripts/services.sh rabbitmq-up URL DATADIR  use the RabbitMQ at URL (amqp://U:P@HOST:PORT/V),
#                                                or start a private node there (node
#                                                backlot_amqpPORT@localhost, its own epmd on
#                                                PORT-1300, distribution on PORT+20000, no plugins)
#   scripts/services.sh rabbitmq-down DATADIR    stop that node, then its epmd
#   scripts/services.sh rabbitmq-status DATADIR  exit 0 when a node we started is running
#
# Every command is idempotent: "up" on a running service succeeds and changes nothing,
# "down" on a stopped one succeeds. Stale pid files of dead processes are removed.
# Missing redis-server / PostgreSQL / rabbitmq-server are installed with apt-get when root.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/scripts/lib.sh"

usage() { sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }

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

# -------------------------------------------------------------------------- RabbitMQ
#
# A private node: its own epmd (started here, so its PID is ours to stop), node name and ports
# derived from the AMQP port, everything else (config, Mnesia, logs, cookie as $HOME) inside
# DATADIR, and an environment of only what we set (env -i): rabbitmq-server also reads unprefixed
# variables such as NODENAME or LOGS, and /etc/rabbitmq/ when not told otherwise.
# DATADIR holds: node ("NODE PORT DIST_PORT EPMD_PORT" of the last start), rabbitmq.pid (the
# node's beam.smp, written by the node), epmd.pid, rabbitmq.conf, mnesia/, log/, *.out.

RABBITMQ_SBIN=${RABBITMQ_SBIN:-/usr/lib/rabbitmq/bin}
# Measured here (Debian's 3.10.8, 2 cores): 8 s from launch to a working AMQP connection on a
# fresh data dir; the wait allows for a slow CI machine.
RABBITMQ_BOOT_SECS=90

amqp_python() {
    if [[ -x $ROOT/.venv/bin/python ]] && "$ROOT/.venv/bin/python" -c 'import amqp' 2>/dev/null; then
        echo "$ROOT/.venv/bin/python"
    else
        command -v python3 || die "python3 not found"
    fi
}

# amqp_probe URL -> exit 0 an AMQP connection opens (logged in, vhost open), 1 nothing
#                   answers, 2 a broker answers but refuses the login or the vhost.
# Without py-amqp (no venv yet): 0 when a broker answers the AMQP 0-9-1 protocol header.
amqp_probe() {
    local py
    py=$(amqp_python)
    "$py" - "$1" <<'PY'
import socket, sys
from urllib.parse import unquote, urlparse
u = urlparse(sys.argv[1])
host, port = u.hostname or "127.0.0.1", u.port or 5672
try:
    import amqp
except ImportError:
    amqp = None
if amqp is not None:
    conn = amqp.Connection(
        f"{host}:{port}",
        userid=unquote(u.username or "guest"),
        password=unquote(u.password or "guest"),
        virtual_host=unquote(u.path[1:]) or "/",
        connect_timeout=1,
        read_timeout=3,
        write_timeout=3,
    )
    rc = 0
    try:
        conn.connect()
    except (amqp.exceptions.AccessRefused, amqp.exceptions.NotAllowed) as e:
        print(f"amqp at {host}:{port}: {e}", file=sys.stderr)
        rc = 2
    except (OSError, amqp.exceptions.AMQPError):
        rc = 1
    try:
        conn.close() if rc == 0 else conn.collect()
    except Exception:
        pass
    sys.exit(rc)
try:
    s = socket.create_connection((host, port), timeout=1)
except OSError:
    sys.exit(1)
with s:
    s.settimeout(3)
    try:
        s.sendall(b"AMQP\x00\x00\x09\x01")
        reply = s.recv(11)
    except OSError:
        sys.exit(1)
# Connection.Start: a method frame (type 1) on channel 0, class 10, method 10.
sys.exit(0 if reply[:3] == b"\x01\x00\x00" and reply[7:11] == b"\x00\x0a\x00\x0a" else 1)
PY
}

# Prints "HOST PORT" for an amqp:// URL.
amqp_url_parts() {
    python3 - "$1" <<'PY'
import sys
from urllib.parse import urlparse
u = urlparse(sys.argv[1])
if u.scheme not in ("amqp", "pyamqp"):
    sys.exit(f"unsupported AMQP URL (need amqp://USER:PASSWORD@HOST:PORT/VHOST): {sys.argv[1]}")
print(u.hostname or "127.0.0.1", u.port or 5672)
PY
}

# Prints "USER PASSWORD VHOST" (URL-decoded, one a line) for an amqp:// URL.
amqp_url_login() {
    python3 - "$1" <<'PY'
import sys
from urllib.parse import unquote, urlparse
u = urlparse(sys.argv[1])
print(unquote(u.username or "guest"), unquote(u.password or "guest"), unquote(u.path[1:]) or "/", sep="\n")
PY
}

# Our pid named by DATADIR/FILE if it is a live COMM; removes a stale pid file.
rabbitmq_our_pid() {
    local pidfile pid
    pidfile=$(abspath "$1")/$2
    [[ -f $pidfile ]] || return 1
    pid=$(tr -dc '0-9' <"$pidfile")
    if pid_alive "$pid" "$3"; then
        echo "$pid"
        return 0
    fi
    log "removing stale $pidfile (pid ${pid:-?} is not a running $3)"
    rm -f "$pidfile"
    return 1
}

rabbitmq_node_pid() { rabbitmq_our_pid "$1" rabbitmq.pid beam.smp; }
epmd_our_pid() { rabbitmq_our_pid "$1" epmd.pid epmd; }

# The live (not zombie) processes of the node started from DATADIR, one pid a line: every one
# (rabbitmq-server's shell, beam.smp, erl_child_setup and its helpers, which run in sessions
# of their own) inherits BACKLOT_RABBITMQ_DATA=DATADIR from rabbitmq-up.
rabbitmq_pids() {
    local mark="BACKLOT_RABBITMQ_DATA=$1" p environ var state
    for p in /proc/[0-9]*; do
        { mapfile -d '' environ <"$p/environ"; } 2>/dev/null || continue
        for var in "${environ[@]}"; do
            [[ $var == "$mark" ]] || continue
            state=$(awk '/^State:/ {print $2}' "$p/status" 2>/dev/null) || break
            if [[ -n $state && $state != Z ]]; then echo "${p#/proc/}"; fi
            break
        done
    done
}

# rabbitmq_reap DATADIR [wait|now]: what is left of the node once beam.smp is gone
# (rabbitmq-server's shell, which exits after it, and helpers such as inet_gethost) is waited
# for, then stopped by pid; "now" (no beam.smp was stopped first, e.g. a start interrupted
# before the node wrote its pid file) skips the wait.
rabbitmq_reap() {
    local datadir=$1 left="" sig i
    left=$(rabbitmq_pids "$datadir")
    [[ -z $left ]] && return 0
    for sig in "" TERM KILL; do
        if [[ -z $sig && ${2:-wait} == now ]]; then continue; fi
        if [[ -n $sig ]]; then
            log "stopping what is left of the node in $datadir with SIG$sig: ${left//$'\n'/ }"
            # shellcheck disable=SC2086 # one pid a word
            kill -"$sig" $left 2>/dev/null || true
        fi
        for ((i = 0; i < 50; i++)); do
            left=$(rabbitmq_pids "$datadir")
            [[ -z $left ]] && return 0
            sleep 0.1
        done
    done
    die "processes of the node in $datadir would not stop: ${left//$'\n'/ }"
}

# rabbitmq_wait URL SECS [PID]: poll until an AMQP connection opens; 1 on timeout or when PID
# (the node, or its launcher) is gone, 2 when the broker refuses the login.
rabbitmq_wait() {
    local url=$1 secs=$2 pid=${3:-} i rc
    for ((i = 0; i < secs * 4; i++)); do
        rc=0
        amqp_probe "$url" 2>/dev/null || rc=$?
        [[ $rc -eq 0 ]] && return 0
        [[ $rc -eq 2 ]] && { amqp_probe "$url" || true; return 2; }
        if [[ -n $pid ]] && ! pid_alive "$pid"; then return 1; fi
        sleep 0.25
    done
    return 1
}

tcp_listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Starts our epmd on PORT unless the one we started is still there.
epmd_up() {
    local datadir=$1 port=$2 pid i
    if pid=$(epmd_our_pid "$datadir"); then return 0; fi
    if tcp_listening "$port"; then
        die "port $port (this node's epmd) is taken by another process"
    fi
    # In the foreground (not -daemon) and without job control, so $! is epmd itself.
    setsid epmd -port "$port" -address 127.0.0.1 </dev/null >"$datadir/epmd.out" 2>&1 &
    pid=$!
    echo "$pid" >"$datadir/epmd.pid"
    for ((i = 0; i < 50; i++)); do
        tcp_listening "$port" && return 0
        pid_alive "$pid" || break   # no name check: it may not have exec'd epmd yet
        sleep 0.1
    done
    cat "$datadir/epmd.out" >&2 2>/dev/null || true
    if pid_alive "$pid" epmd; then kill -TERM "$pid" 2>/dev/null || true; fi
    rm -f "$datadir/epmd.pid"
    die "epmd did not listen on 127.0.0.1:$port"
}

epmd_down() {
    local datadir=$1 pid
    pid=$(epmd_our_pid "$datadir") || return 0
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_pid_gone "$pid" 5; then
        kill -KILL "$pid" 2>/dev/null || true
        wait_pid_gone "$pid" 5 || die "could not stop epmd pid $pid"
    fi
    rm -f "$datadir/epmd.pid"
}

cmd_rabbitmq_up() {
    [[ $# -eq 2 ]] || usage
    local url=$1 datadir rc=0 pid host port node dist_port epmd_port user password vhost launcher
    datadir=$(abspath "$2")
    read -r host port < <(amqp_url_parts "$url") || die "bad AMQP URL: $url"
    amqp_probe "$url" || rc=$?
    case $rc in
        0)
            if pid=$(rabbitmq_node_pid "$datadir"); then
                log "RabbitMQ already running at $url (started by us, pid $pid)"
            else
                log "using the RabbitMQ already answering at $url"
            fi
            return 0 ;;
        2) die "a broker answers at $url but refuses our login or vhost" ;;
    esac

    case $host in
        127.0.0.1 | localhost | ::1) ;;
        *) die "no RabbitMQ answers at $url, and I only start local ones (host is $host)" ;;
    esac
    # epmd and the distribution listener get ports of their own beside the AMQP port.
    ((port > 2324 && port <= 45535)) || die "AMQP port $port: need 2325..45535 (epmd PORT-1300, distribution PORT+20000)"
    node=backlot_amqp$port@localhost
    dist_port=$((port + 20000))
    epmd_port=$((port - 1300))

    if pid=$(rabbitmq_node_pid "$datadir"); then
        if [[ -f $datadir/node && $(cut -d' ' -f2 "$datadir/node") != "$port" ]]; then
            die "the RabbitMQ in $datadir (pid $pid) runs on port $(cut -d' ' -f2 "$datadir/node"), not $port (stop it: $0 rabbitmq-down $datadir)"
        fi
        # Ours, alive, but not answering yet (still booting).
        log "RabbitMQ pid $pid (ours) is not answering yet; waiting"
        rc=0
        rabbitmq_wait "$url" "$RABBITMQ_BOOT_SECS" "$pid" || rc=$?
        [[ $rc -eq 0 ]] || die "RabbitMQ pid $pid does not answer at $url; see $datadir/log/"
        return 0
    fi

    if [[ ! -x $RABBITMQ_SBIN/rabbitmq-server ]]; then
        apt_install rabbitmq-server
        [[ -x $RABBITMQ_SBIN/rabbitmq-server ]] || die "$RABBITMQ_SBIN/rabbitmq-server still missing"
    fi
    command -v epmd >/dev/null 2>&1 || die "epmd not on PATH (Debian: erlang-base)"
    if tcp_listening "$port"; then
        die "port $port is taken by something that does not answer as an AMQP broker"
    fi
    if tcp_listening "$dist_port"; then
        die "port $dist_port (this node's distribution port) is taken by another process"
    fi

    mkdir -p "$datadir/log" "$datadir/mnesia" "$datadir/conf.d"
    echo "$node $port $dist_port $epmd_port" >"$datadir/node"
    # consumer_timeout stays at its default (30 min), as on a production broker.
    printf '%s\n' "# written by scripts/services.sh rabbitmq-up" "loopback_users = none" >"$datadir/rabbitmq.conf"
    echo "[]." >"$datadir/enabled_plugins"
    { read -r user; read -r password; read -r vhost; } < <(amqp_url_login "$url")

    rabbitmq_reap "$datadir" now   # what a node that died may have left
    epmd_up "$datadir" "$epmd_port"
    log "starting RabbitMQ node $node on 127.0.0.1:$port (epmd :$epmd_port, data in $datadir)"
    rm -f "$datadir/rabbitmq.pid"
    # -start_epmd false: if our epmd is gone the node fails, rather than start a stray one.
    env -i PATH="$PATH" HOME="$datadir" LANG=C.UTF-8 LC_ALL=C.UTF-8 BACKLOT_RABBITMQ_DATA="$datadir" \
        ERL_EPMD_PORT="$epmd_port" ERL_EPMD_ADDRESS=127.0.0.1 \
        RABBITMQ_NODENAME="$node" \
        RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT="$port" \
        RABBITMQ_DIST_PORT="$dist_port" \
        RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-start_epmd false -kernel inet_dist_use_interface {127,0,0,1}" \
        RABBITMQ_CONF_ENV_FILE="$datadir/rabbitmq-env.conf" \
        RABBITMQ_CONFIG_FILE="$datadir/rabbitmq.conf" \
        RABBITMQ_CONFIG_FILES="$datadir/conf.d/*.conf" \
        RABBITMQ_ADVANCED_CONFIG_FILE="$datadir/advanced.config" \
        RABBITMQ_ENABLED_PLUGINS_FILE="$datadir/enabled_plugins" RABBITMQ_ENABLED_PLUGINS="" \
        RABBITMQ_MNESIA_BASE="$datadir/mnesia" RABBITMQ_LOG_BASE="$datadir/log" \
        RABBITMQ_PID_FILE="$datadir/rabbitmq.pid" \
        RABBITMQ_DEFAULT_USER="$user" RABBITMQ_DEFAULT_PASS="$password" RABBITMQ_DEFAULT_VHOST="$vhost" \
        setsid "$RABBITMQ_SBIN/rabbitmq-server" </dev/null >"$datadir/rabbitmq.out" 2>&1 &
    launcher=$!

    rc=0
    rabbitmq_wait "$url" "$RABBITMQ_BOOT_SECS" "$launcher" || rc=$?
    if [[ $rc -ne 0 ]]; then
        tail -n 20 "$datadir/rabbitmq.out" "$datadir/log/$node.log" >&2 2>/dev/null || true
        local why="did not answer at $url within $RABBITMQ_BOOT_SECS s"
        if ! pid_alive "$launcher"; then why="exited while booting"; fi
        if [[ $rc -eq 2 ]]; then why="refuses the login or vhost of $url"; fi
        if pid=$(rabbitmq_node_pid "$datadir" 2>/dev/null); then kill -KILL "$pid" 2>/dev/null || true; fi
        rabbitmq_reap "$datadir"
        epmd_down "$datadir"
        die "RabbitMQ $why; see $datadir/rabbitmq.out and $datadir/log/"
    fi
    pid=$(rabbitmq_node_pid "$datadir") || die "RabbitMQ answers but wrote no pid file at $datadir/rabbitmq.pid"
    log "RabbitMQ ready at $url (pid $pid, node $node; rabbitmqctl: HOME=$datadir ERL_EPMD_PORT=$epmd_port $RABBITMQ_SBIN/rabbitmqctl -n $node status)"
}

cmd_rabbitmq_down() {
    [[ $# -eq 1 ]] || usage
    local datadir pid
    datadir=$(abspath "$1")
    if pid=$(rabbitmq_node_pid "$datadir"); then
        # SIGTERM is a graceful stop for RabbitMQ (as `rabbitmqctl stop`), without booting a CLI VM.
        log "stopping RabbitMQ (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        if ! wait_pid_gone "$pid" 30; then
            log "RabbitMQ pid $pid did not stop in 30 s; killing it"
            kill -KILL "$pid" 2>/dev/null || true
            wait_pid_gone "$pid" 5 || die "could not stop RabbitMQ pid $pid"
        fi
        rm -f "$datadir/rabbitmq.pid"
        rabbitmq_reap "$datadir"
        log "RabbitMQ stopped"
    else
        log "no RabbitMQ started by us in $datadir; nothing to stop"
        rabbitmq_reap "$datadir" now
    fi
    epmd_down "$datadir"
}

cmd_rabbitmq_status() {
    [[ $# -eq 1 ]] || usage
    local datadir pid node port epmd_pid
    datadir=$(abspath "$1")
    if pid=$(rabbitmq_node_pid "$datadir" 2>/dev/null); then
        read -r node port _ < <(cat "$datadir/node" 2>/dev/null || echo "? ?")
        epmd_pid=$(epmd_our_pid "$datadir" 2>/dev/null || echo "gone")
        echo "rabbitmq running (pid $pid, node $node, port $port, epmd pid $epmd_pid)"
        return 0
    fi
    echo "rabbitmq not running (none started by us in $1)"
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
    rabbitmq-up) cmd_rabbitmq_up "$@" ;;
    rabbitmq-down) cmd_rabbitmq_down "$@" ;;
    rabbitmq-status) cmd_rabbitmq_status "$@" ;;
    -h | --help | help) usage ;;
    *) log "unknown command: $sub"; usage ;;
esac
