#!/usr/bin/env bash
# Make sure PostgreSQL and Redis answer at DATABASE_URL / REDIS_URL.
#
# Usage:
#
#   source scripts/services.sh            # from a bash script (scripts/test.sh does this)
#   scripts/services.sh [--] CMD [ARG...] # run CMD with the services up (make bench does this)
#   scripts/services.sh check             # only report what answers; start nothing
#
# Defaults: DATABASE_URL=postgres://postgres@127.0.0.1:5432/aap
#           REDIS_URL=redis://127.0.0.1:6379/15
#
# When a server already answers at its URL it is used as is. When nothing answers and
# the URL points at 127.0.0.1/localhost, a throwaway server is started from the local
# binaries in a temporary directory (on the URL's port when free, otherwise on a free
# port), DATABASE_URL / REDIS_URL are exported pointing at it, and it is stopped and its
# directory removed when the shell exits (EXIT trap; call aap_services_stop yourself if
# you install your own EXIT trap after sourcing). When that is impossible the script
# fails with a message naming what is missing - it never silently skips.
#
# The database named in DATABASE_URL need not exist: the check connects to the
# "postgres" maintenance database, and the named database is then created when missing
# (AAP_SERVICES_CREATEDB=0 to skip). pytest-django creates test_<name> itself.
#
# Exports: DATABASE_URL, REDIS_URL, AAP_SERVICES_STARTED (e.g. "postgres redis", empty
# when nothing was started), AAP_SERVICES_DIR (temp dir of the throwaway servers or "").
#
# Knobs: AAP_SERVICES_PYTHON (interpreter for the probes; default .venv/bin/python, then
# python3), AAP_PG_BINDIR (directory holding initdb/pg_ctl/postgres), AAP_PG_SEARCH
# (globs searched after PATH; default "/usr/lib/postgresql/*/bin /usr/local/pgsql/bin"),
# AAP_REDIS_SERVER (path of redis-server; default: looked up in PATH),
# AAP_SERVICES_USER (non-root user that runs a throwaway PostgreSQL when run as root;
# default postgres, else nobody), AAP_SERVICES_QUIET=1, AAP_SERVICES_OWN_REDIS=1 (with
# REDIS_URL unset: always start a throwaway Redis on a free port, so nothing touches a Redis
# someone else uses; the suite and the bench do this), AAP_SERVICES_OWN_POSTGRES=1 (with
# DATABASE_URL unset: the same for PostgreSQL; the suite does this, so its parallel workers
# never compete with another checkout for a shared server's connections).

# shellcheck disable=SC2154  # the _aap_u_* variables are assigned by eval of `_aap_py info`

# ---------------------------------------------------------------------------------------
# Python helper for URL parsing and wire-level probes (no third-party module required;
# psycopg is used when importable so authentication is checked too).
_AAP_SERVICES_PY='
import os, socket, struct, sys
from urllib.parse import urlsplit, urlunsplit, unquote

def parts(url):
    u = urlsplit(url)
    return u, (u.hostname or "localhost"), u.port

def say(msg):
    print("services: " + msg, file=sys.stderr)

def tcp(host, port):
    try:
        return socket.create_connection((host, port), timeout=3)
    except OSError:
        return None

def masked(url):
    u = urlsplit(url)
    if u.password is None:
        return url
    netloc = u.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(u._replace(netloc=user + ":***@" + netloc[1]))

def recv_line(s):
    buf = b""
    while not buf.endswith(b"\r\n"):
        chunk = s.recv(1)
        if not chunk:
            break
        buf += chunk
    return buf.decode("utf-8", "replace").strip()

def cmd_info(url, kind):
    import shlex
    u, host, port = parts(url)
    port = port or (5432 if kind == "pg" else 6379)
    user = unquote(u.username) if u.username else ""
    password = unquote(u.password) if u.password is not None else ""
    path = unquote(u.path.lstrip("/"))
    local = host in ("127.0.0.1", "localhost", "::1", "ip6-localhost")
    for key, value in (("scheme", u.scheme), ("host", host), ("port", str(port)),
                       ("user", user), ("password", password), ("path", path),
                       ("local", "1" if local else "0"), ("masked", masked(url))):
        print("_aap_u_%s=%s" % (key, shlex.quote(value)))

def cmd_probe_pg(url):
    # 0: answers and accepts us; 1: nothing answers; 2: something answers but fails.
    u, host, port = parts(url)
    port = port or 5432
    s = tcp(host, port)
    if s is None:
        return 1
    try:
        s.sendall(struct.pack("!ii", 8, 80877103))  # SSLRequest: a server answers S or N
        answer = s.recv(1)
    except OSError:
        answer = b""
    finally:
        s.close()
    if answer not in (b"S", b"N"):
        say("something listens on %s:%s but it does not speak the PostgreSQL protocol" % (host, port))
        return 2
    try:
        import psycopg
    except ImportError:
        return 0  # a PostgreSQL server answers; credentials are checked by the first real use
    kwargs = dict(host=host, port=port, dbname="postgres", connect_timeout=5)
    if u.username:
        kwargs["user"] = unquote(u.username)
    if u.password is not None:
        kwargs["password"] = unquote(u.password)
    try:
        psycopg.connect(**kwargs).close()
    except Exception as exc:
        say("PostgreSQL at %s:%s answers but refuses us: %s" % (host, port, str(exc).strip()))
        return 2
    return 0

def cmd_probe_redis(url):
    u, host, port = parts(url)
    port = port or 6379
    if u.scheme not in ("redis", ""):
        say("cannot probe %s:// URLs; assuming the server is there" % u.scheme)
        return 0
    s = tcp(host, port)
    if s is None:
        return 1
    try:
        s.settimeout(5)
        def call(*args):
            payload = b"*%d\r\n" % len(args)
            for arg in args:
                arg = arg.encode()
                payload += b"$%d\r\n%s\r\n" % (len(arg), arg)
            s.sendall(payload)
            return recv_line(s)
        if u.password is not None:
            auth = (unquote(u.username), unquote(u.password)) if u.username else (unquote(u.password),)
            reply = call("AUTH", *auth)
            if not reply.startswith("+"):
                say("Redis at %s:%s refuses AUTH: %s" % (host, port, reply))
                return 2
        reply = call("PING")
        if reply != "+PONG":
            say("%s:%s does not answer PING like Redis: %r" % (host, port, reply))
            return 2
        db = u.path.lstrip("/") or "0"
        reply = call("SELECT", db)
        if not reply.startswith("+"):
            say("Redis at %s:%s refuses SELECT %s: %s" % (host, port, db, reply))
            return 2
    except OSError as exc:
        say("%s:%s accepted a connection but the Redis handshake failed: %s" % (host, port, exc))
        return 2
    finally:
        s.close()
    return 0

def cmd_ensure_db(url):
    u, host, port = parts(url)
    name = unquote(u.path.lstrip("/"))
    if not name or name == "postgres":
        return 0
    try:
        import psycopg
        from psycopg import sql
    except ImportError:
        say("psycopg is not importable here; not checking that database %r exists" % name)
        return 0
    kwargs = dict(host=host, port=port or 5432, dbname="postgres", connect_timeout=5, autocommit=True)
    if u.username:
        kwargs["user"] = unquote(u.username)
    if u.password is not None:
        kwargs["password"] = unquote(u.password)
    try:
        with psycopg.connect(**kwargs) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
                return 0
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            say("created database %r" % name)
    except Exception as exc:
        say("warning: could not create database %r: %s" % (name, str(exc).strip()))
    return 0

def cmd_with_hostport(url, host, port):
    u = urlsplit(url)
    auth = u.netloc.rsplit("@", 1)[0] + "@" if "@" in u.netloc else ""
    return print(urlunsplit(u._replace(netloc="%s%s:%s" % (auth, host, port))))

def cmd_port(preferred):
    # The preferred port when nothing listens there, otherwise a free one.
    for port in (int(preferred), 0):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
        else:
            print(s.getsockname()[1])
            return 0
        finally:
            s.close()
    return 1

cmd, args = sys.argv[1], sys.argv[2:]
result = {
    "info": cmd_info, "probe-pg": cmd_probe_pg, "probe-redis": cmd_probe_redis,
    "ensure-db": cmd_ensure_db, "with-hostport": cmd_with_hostport, "port": cmd_port,
}[cmd](*args)
sys.exit(result or 0)
'

_aap_say() {
    [[ "${AAP_SERVICES_QUIET:-0}" == 1 ]] || printf 'services: %s\n' "$*" >&2
}

_aap_err() {
    printf 'services: ERROR: %s\n' "$*" >&2
}

_aap_py() {
    "$_aap_python" -c "$_AAP_SERVICES_PY" "$@"
}

# Run a command as the unprivileged owner of the throwaway PostgreSQL (root only).
_aap_as_pg_user() {
    if [[ -z "${_aap_pg_runas:-}" ]]; then
        "$@"
    elif command -v runuser >/dev/null 2>&1; then
        runuser -u "$_aap_pg_runas" -- "$@"
    else
        su -s /bin/sh "$_aap_pg_runas" -c "$(printf '%q ' "$@")"
    fi
}

# Directory holding initdb, pg_ctl and postgres of one PostgreSQL version.
_aap_find_pg_bindir() {
    local candidates=() dir pattern found
    if [[ -n "${AAP_PG_BINDIR:-}" ]]; then
        candidates+=("$AAP_PG_BINDIR")
    else
        if found=$(command -v pg_ctl 2>/dev/null); then
            candidates+=("$(dirname "$(readlink -f "$found")")")
        fi
        if found=$(command -v initdb 2>/dev/null); then
            candidates+=("$(dirname "$(readlink -f "$found")")")
        fi
        for pattern in ${AAP_PG_SEARCH-/usr/lib/postgresql/*/bin /usr/local/pgsql/bin}; do
            # newest version first
            while IFS= read -r dir; do
                [[ -n "$dir" ]] && candidates+=("$dir")
            done < <(compgen -G "$pattern" | sort -rV)
        done
    fi
    for dir in "${candidates[@]}"; do
        if [[ -x "$dir/initdb" && -x "$dir/pg_ctl" && -x "$dir/postgres" ]]; then
            printf '%s\n' "$dir"
            return 0
        fi
    done
    return 1
}

_aap_make_tmpdir() {
    [[ -n "${AAP_SERVICES_DIR:-}" && -d "$AAP_SERVICES_DIR" ]] && return 0
    AAP_SERVICES_DIR=$(mktemp -d "${TMPDIR:-/tmp}/aap-services.XXXXXX") || return 1
    chmod 755 "$AAP_SERVICES_DIR"
    export AAP_SERVICES_DIR
}

_aap_start_postgres() {
    local bindir=$1 port data superuser log
    _aap_pg_runas=""
    if [[ $(id -u) == 0 ]]; then
        # PostgreSQL refuses to run as root.
        _aap_pg_runas=${AAP_SERVICES_USER:-}
        if [[ -z "$_aap_pg_runas" ]]; then
            if id postgres >/dev/null 2>&1; then _aap_pg_runas=postgres; else _aap_pg_runas=nobody; fi
        fi
        if ! id "$_aap_pg_runas" >/dev/null 2>&1; then
            _aap_err "running as root, and user '$_aap_pg_runas' (needed to run PostgreSQL) does not exist;" \
                "set AAP_SERVICES_USER to an unprivileged user"
            return 1
        fi
        if ! command -v runuser >/dev/null 2>&1 && ! command -v su >/dev/null 2>&1; then
            _aap_err "running as root and neither runuser nor su is available to drop privileges for PostgreSQL"
            return 1
        fi
    fi
    _aap_make_tmpdir || { _aap_err "cannot create a temporary directory"; return 1; }
    port=$(_aap_py port "$_aap_u_port") || { _aap_err "no free TCP port on 127.0.0.1"; return 1; }
    data="$AAP_SERVICES_DIR/pg"
    log="$AAP_SERVICES_DIR/postgres.log"
    superuser=${_aap_u_user:-$(id -un)}
    mkdir -p "$data" "$AAP_SERVICES_DIR/pgrun" && touch "$log" || return 1
    if [[ -n "$_aap_pg_runas" ]]; then
        chown "$_aap_pg_runas" "$data" "$AAP_SERVICES_DIR/pgrun" "$log" || return 1
        chmod 700 "$data"
        # shellcheck disable=SC2016  # $1 expands in the inner shell
        if ! _aap_as_pg_user "$BASH" -c 'test -w "$1"' _ "$data"; then
            _aap_err "user $_aap_pg_runas cannot write $data (is ${TMPDIR:-/tmp} traversable by it? set TMPDIR)"
            return 1
        fi
    fi
    _aap_say "nothing answers at $_aap_u_masked; starting a throwaway PostgreSQL ($bindir) on 127.0.0.1:$port"
    if ! (cd "$AAP_SERVICES_DIR" && _aap_as_pg_user "$bindir/initdb" -D "$data" -U "$superuser" \
            --auth=trust --encoding=UTF8 --locale=C --no-sync >"$AAP_SERVICES_DIR/initdb.log" 2>&1); then
        _aap_err "initdb failed:"; tail -n 20 "$AAP_SERVICES_DIR/initdb.log" >&2
        return 1
    fi
    cat >>"$data/postgresql.conf" <<EOF
# throwaway server started by scripts/services.sh
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$AAP_SERVICES_DIR/pgrun'
max_connections = 600
fsync = off
synchronous_commit = off
full_page_writes = off
EOF
    _aap_pg_bindir=$bindir
    _aap_pg_data=$data
    if ! (cd "$AAP_SERVICES_DIR" && _aap_as_pg_user "$bindir/pg_ctl" -D "$data" -l "$log" -w -t 60 start >/dev/null); then
        _aap_err "the throwaway PostgreSQL did not start; its log:"; tail -n 30 "$log" >&2
        return 1
    fi
    AAP_SERVICES_STARTED="${AAP_SERVICES_STARTED:+$AAP_SERVICES_STARTED }postgres"
    DATABASE_URL=$(_aap_py with-hostport "$DATABASE_URL" 127.0.0.1 "$port") || return 1
    export DATABASE_URL AAP_SERVICES_STARTED
}

_aap_start_redis() {
    local server=$1 port log i args
    _aap_make_tmpdir || { _aap_err "cannot create a temporary directory"; return 1; }
    port=$(_aap_py port "$_aap_u_port") || { _aap_err "no free TCP port on 127.0.0.1"; return 1; }
    log="$AAP_SERVICES_DIR/redis.log"
    # 64 databases: the suite's parallel workers and their side stacks each take their own.
    args=(--bind 127.0.0.1 --port "$port" --save '' --appendonly no --daemonize no
          --dir "$AAP_SERVICES_DIR" --logfile "$log" --databases 64)
    if [[ -n "$_aap_u_user" && "$_aap_u_user" != default ]]; then
        args+=(--user "$_aap_u_user" on ">$_aap_u_password" '~*' '&*' '+@all')
    elif [[ -n "$_aap_u_password" ]]; then
        args+=(--requirepass "$_aap_u_password")
    fi
    _aap_say "nothing answers at $_aap_u_masked; starting a throwaway Redis ($server) on 127.0.0.1:$port"
    "$server" "${args[@]}" </dev/null >/dev/null 2>&1 &
    _aap_redis_pid=$!
    local url
    url=$(_aap_py with-hostport "$REDIS_URL" 127.0.0.1 "$port") || return 1
    for ((i = 0; i < 100; i++)); do
        if ! kill -0 "$_aap_redis_pid" 2>/dev/null; then
            _aap_redis_pid=""
            _aap_err "the throwaway Redis exited at once; its log:"; tail -n 20 "$log" >&2
            return 1
        fi
        if _aap_py probe-redis "$url" 2>/dev/null; then
            AAP_SERVICES_STARTED="${AAP_SERVICES_STARTED:+$AAP_SERVICES_STARTED }redis"
            REDIS_URL=$url
            export REDIS_URL AAP_SERVICES_STARTED
            return 0
        fi
        sleep 0.1
    done
    _aap_err "the throwaway Redis did not answer within 10s; its log:"; tail -n 20 "$log" >&2
    return 1
}

# Stop the throwaway servers and remove their directory. Safe to call more than once,
# and under `set -e` (it runs from an EXIT trap: nothing in it may fail).
aap_services_stop() {
    local i pid
    if [[ -n "${_aap_pg_data:-}" && -f "$_aap_pg_data/postmaster.pid" ]]; then
        if ! (cd "$AAP_SERVICES_DIR" && _aap_as_pg_user "$_aap_pg_bindir/pg_ctl" -D "$_aap_pg_data" \
                -m immediate -w -t 20 stop >/dev/null 2>&1); then
            pid=$(head -n 1 "$_aap_pg_data/postmaster.pid" 2>/dev/null) || pid=""
            if [[ -n "$pid" ]]; then kill -KILL "$pid" 2>/dev/null || true; fi
        fi
    fi
    _aap_pg_data=""
    if [[ -n "${_aap_redis_pid:-}" ]]; then
        kill -TERM "$_aap_redis_pid" 2>/dev/null || true
        for ((i = 0; i < 50; i++)); do
            kill -0 "$_aap_redis_pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$_aap_redis_pid" 2>/dev/null || true
        wait "$_aap_redis_pid" 2>/dev/null || true
        _aap_redis_pid=""
    fi
    if [[ -n "${AAP_SERVICES_DIR:-}" && -d "$AAP_SERVICES_DIR" ]]; then
        rm -rf "$AAP_SERVICES_DIR" || true
        _aap_say "stopped throwaway ${AAP_SERVICES_STARTED:-servers}" || true
    fi
    AAP_SERVICES_DIR=""
    AAP_SERVICES_STARTED=""
    return 0
}

_aap_redis_server_path() {
    local server=${AAP_REDIS_SERVER:-}
    [[ -n "$server" ]] || server=$(command -v redis-server 2>/dev/null) || return 1
    [[ -x "$server" ]] || return 1
    printf '%s\n' "$server"
}

# Probe one service. Sets _aap_need_<kind>=1 when a throwaway server must be started.
# Returns non-zero when the URL is unusable and nothing can be started for it.
_aap_probe() {
    local kind=$1 var=$2 mode=$3 url info rc label example
    url=${!var}
    if [[ $kind == pg ]]; then
        label=PostgreSQL; example=postgres://postgres@127.0.0.1:55432/aap
    else
        label=Redis; example=redis://127.0.0.1:56379/15
    fi
    info=$(_aap_py info "$url" "$kind") || { _aap_err "cannot parse $var"; return 1; }
    eval "$info"
    if [[ $kind == pg ]]; then
        case "$_aap_u_scheme" in
            postgres | postgresql | pgsql | postgis) ;;
            *) _aap_say "$var is not a PostgreSQL URL ($_aap_u_scheme://); leaving it alone"; return 0 ;;
        esac
    fi
    rc=0; _aap_py "probe-$kind" "$url" || rc=$?
    if [[ $rc == 0 ]]; then
        _aap_say "$label answers at $_aap_u_masked"
    elif [[ $mode == check ]]; then
        _aap_say "$label: nothing usable at $_aap_u_masked"
    elif [[ $rc == 1 && $_aap_u_local == 1 ]]; then
        printf -v "_aap_need_$kind" 1
    elif [[ $rc == 1 ]]; then
        _aap_err "nothing answers at $var=$_aap_u_masked; it is not a local address, so no throwaway" \
            "server is started. Start it, or unset $var to get a local one."
        return 1
    else
        _aap_err "$var=$_aap_u_masked is not usable (see above). Fix the server or the URL; to get a" \
            "throwaway server instead, point $var at a free local port (e.g. $example)."
        return 1
    fi
    return 0
}

# Ensure both services answer; start throwaways when needed. Returns non-zero on failure.
# With "check" as argument only reports.
aap_services_up() {
    local mode=${1:-up} root pg_bindir="" redis_server="" missing=() packages=() info
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    _aap_python=${AAP_SERVICES_PYTHON:-}
    if [[ -z "$_aap_python" ]]; then
        if [[ -x "$root/.venv/bin/python" ]]; then _aap_python="$root/.venv/bin/python"
        elif command -v python3 >/dev/null 2>&1; then _aap_python=python3
        else _aap_err "python3 is needed to probe the services (sudo apt-get install python3)"; return 1
        fi
    fi
    if [[ -z "${DATABASE_URL:-}" && "${AAP_SERVICES_OWN_POSTGRES:-0}" == 1 && $mode != check ]]; then
        local own_pg_port
        own_pg_port=$(_aap_py port 0) || { _aap_err "no free TCP port on 127.0.0.1"; return 1; }
        export DATABASE_URL="postgres://postgres@127.0.0.1:$own_pg_port/aap"
    fi
    export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/aap}
    if [[ -z "${REDIS_URL:-}" && "${AAP_SERVICES_OWN_REDIS:-0}" == 1 && $mode != check ]]; then
        # A free local port: the probe finds nothing there, so a throwaway server starts.
        local own_port
        own_port=$(_aap_py port 0) || { _aap_err "no free TCP port on 127.0.0.1"; return 1; }
        export REDIS_URL="redis://127.0.0.1:$own_port/0"
    fi
    export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/15}
    AAP_SERVICES_STARTED=${AAP_SERVICES_STARTED:-}
    AAP_SERVICES_DIR=${AAP_SERVICES_DIR:-}
    export AAP_SERVICES_STARTED AAP_SERVICES_DIR
    _aap_need_pg=0
    _aap_need_redis=0

    _aap_probe pg DATABASE_URL "$mode" || return 1
    _aap_probe redis REDIS_URL "$mode" || return 1

    # Everything needed to start the missing servers must be there before starting any.
    if [[ $_aap_need_pg == 1 ]] && ! pg_bindir=$(_aap_find_pg_bindir); then
        local where="PATH ${AAP_PG_SEARCH-/usr/lib/postgresql/*/bin /usr/local/pgsql/bin}"
        [[ -n "${AAP_PG_BINDIR:-}" ]] && where="AAP_PG_BINDIR=$AAP_PG_BINDIR"
        missing+=("PostgreSQL server binaries initdb, pg_ctl and postgres (looked in ${where% }; set AAP_PG_BINDIR to their directory)")
        packages+=(postgresql)
    fi
    if [[ $_aap_need_redis == 1 ]] && ! redis_server=$(_aap_redis_server_path); then
        missing+=("redis-server (looked in ${AAP_REDIS_SERVER:-PATH}; set AAP_REDIS_SERVER to its path)")
        packages+=(redis-server)
    fi
    if [[ ${#missing[@]} -gt 0 ]]; then
        [[ $_aap_need_pg == 1 ]] && _aap_err "nothing answers at DATABASE_URL=$(_aap_py info "$DATABASE_URL" pg | sed -n "s/^_aap_u_masked=//p")"
        [[ $_aap_need_redis == 1 ]] && _aap_err "nothing answers at REDIS_URL=$(_aap_py info "$REDIS_URL" redis | sed -n "s/^_aap_u_masked=//p")"
        _aap_err "cannot start throwaway servers; missing:"
        local item
        for item in "${missing[@]}"; do printf 'services:   - %s\n' "$item" >&2; done
        _aap_err "install with: sudo apt-get install ${packages[*]}   (macOS: brew install" \
            "${packages[*]/redis-server/redis})  - or point DATABASE_URL / REDIS_URL at running servers."
        return 1
    fi

    if [[ $_aap_need_pg == 1 ]]; then
        info=$(_aap_py info "$DATABASE_URL" pg) && eval "$info" || return 1
        _aap_start_postgres "$pg_bindir" || return 1
    fi
    if [[ $_aap_need_redis == 1 ]]; then
        info=$(_aap_py info "$REDIS_URL" redis) && eval "$info" || return 1
        _aap_start_redis "$redis_server" || return 1
    fi
    if [[ $mode != check && "${AAP_SERVICES_CREATEDB:-1}" != 0 ]]; then
        case "$DATABASE_URL" in
            postgres:* | postgresql:* | pgsql:* | postgis:*) _aap_py ensure-db "$DATABASE_URL" ;;
        esac
    fi
    return 0
}

_aap_services_on_signal() {
    trap - INT TERM HUP
    exit "$1"
}

_aap_services_install_traps() {
    trap 'aap_services_stop' EXIT
    trap '_aap_services_on_signal 130' INT
    trap '_aap_services_on_signal 143' TERM
    trap '_aap_services_on_signal 129' HUP
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
    # Sourced: bring the services up in the caller's shell.
    _aap_services_install_traps
    if ! aap_services_up; then
        aap_services_stop
        return 1
    fi
else
    set -uo pipefail
    case "${1:-}" in
        check)
            aap_services_up check
            exit $?
            ;;
        -h | --help)
            sed -n '2,/^$/s/^# \{0,1\}//p' "$0"
            exit 0
            ;;
        "")
            sed -n '2,/^$/s/^# \{0,1\}//p' "$0" >&2
            exit 2
            ;;
        --) shift ;;
    esac
    [[ $# -gt 0 ]] || { _aap_err "no command given"; exit 2; }
    _aap_services_install_traps
    aap_services_up || exit 1
    rc=0
    "$@" || rc=$?
    exit "$rc"
fi
