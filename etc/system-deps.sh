#!/bin/sh
# The programs pip cannot bring. `sh etc/system-deps.sh run` (make run): PostgreSQL's
# server, which derivd needs. `sh etc/system-deps.sh test` (make test, make install): also
# pgbouncer, chromium, faketime and Node (the upload service in tests/node), which the
# test suite drives, and jpegtran, which makes
# its arithmetic-coded JPEG (the tests that need one skip, each with one line, where it
# is missing).
# Root with apt-get: install what is missing, with one `apt-get update` at most.
# Otherwise: one line per missing program saying what to install; exit 1 without
# PostgreSQL's server.
set -u

purpose=${1:-test}
case $purpose in
    run|test) ;;
    *) echo "usage: sh etc/system-deps.sh run|test" >&2; exit 2 ;;
esac

has_postgres() {
    command -v initdb >/dev/null 2>&1 && return 0
    ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && return 0
    bindir=$(pg_config --bindir 2>/dev/null) && [ -x "$bindir/initdb" ]
}
# Debian puts pgbouncer in /usr/sbin, which a non-root PATH often lacks.
has_pgbouncer() { command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ]; }
# The browser tests run /usr/bin/chromium headless, so that exact path is what counts.
has_chromium() { [ -x /usr/bin/chromium ]; }
has_faketime() { command -v faketime >/dev/null 2>&1; }
has_jpegtran() { command -v jpegtran >/dev/null 2>&1; }
has_node() { command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; }

missing() {
    out=""
    has_postgres || out="$out postgresql"
    if [ "$purpose" = test ]; then
        has_pgbouncer || out="$out pgbouncer"
        has_chromium || out="$out chromium"
        has_faketime || out="$out faketime"
        has_jpegtran || out="$out libjpeg-turbo-progs"
        has_node || out="$out nodejs npm"
    fi
    echo "$out"
}

todo=$(missing)
[ -z "$todo" ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "derivd: installing system packages:$todo"
    export DEBIAN_FRONTEND=noninteractive
    # Recommends would pull ~100 desktop packages in with chromium; headless needs none.
    # shellcheck disable=SC2086 # the package list is meant to split into words
    apt-get update -qq && apt-get install -y -qq --no-install-recommends $todo >/dev/null
    todo=$(missing)
fi

status=0
for pkg in $todo; do
    case $pkg in
        postgresql)
            echo "derivd needs PostgreSQL server binaries (initdb): apt-get install postgresql (or your OS's package)"
            status=1 ;;
        pgbouncer)
            echo "optional: pgbouncer not found: apt-get install pgbouncer (its tests skip without it)" ;;
        chromium)
            echo "optional: /usr/bin/chromium not found: apt-get install chromium (its tests skip without it)" ;;
        faketime)
            echo "optional: faketime not found: apt-get install faketime (its tests skip without it)" ;;
        nodejs)
            echo "optional: node or npm not found: apt-get install nodejs npm (the Node client's test skips without them)" ;;
        npm) ;;
        libjpeg-turbo-progs)
            echo "optional: jpegtran not found: apt-get install libjpeg-turbo-progs (its tests skip without it)" ;;
    esac
done
exit $status
