#!/usr/bin/env bash
# Create .venv-django6: the project (`.[project,dev]`) on Django 6.0, where jobs.flow.backends plugs
# into the built-in django.tasks instead of the django-tasks backport. scripts/test.sh runs the
# Tasks-backend tests and the platform smoke test from it. Rebuilt only when pyproject.toml or
# this script is newer than the stamp .venv-django6/.installed, like scripts/venv.sh's .venv.
#
# Django 6.0 needs Python 3.12+, and the machine's python3 may be 3.11: DJANGO6_PYTHON names
# the interpreter; otherwise the first python3.13/python3.12 that runs (PATH, then pyenv's
# versions) is used. Prints the venv's python on stdout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib.sh

# django-celery-beat 2.9 declares Django<6.1 (django-celery-results 2.6 sets no upper bound):
# 6.0 is the newest Django 6 both support.
DJANGO6=${DJANGO6:-Django==6.0.*}
VENV=.venv-django6
STAMP=$VENV/.installed

python_ok() { "$1" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
    local candidate
    if [[ -n ${DJANGO6_PYTHON:-} ]]; then
        python_ok "$DJANGO6_PYTHON" || die "DJANGO6_PYTHON=$DJANGO6_PYTHON is not a Python 3.12+ with venv"
        echo "$DJANGO6_PYTHON"
        return
    fi
    # pyenv's shims exist for every installed version but fail unless it is selected, hence
    # the check that each candidate actually runs.
    for candidate in python3.13 python3.12; do
        if command -v "$candidate" >/dev/null 2>&1 && python_ok "$candidate"; then
            echo "$candidate"
            return
        fi
    done
    local root
    root=$( (command -v pyenv >/dev/null 2>&1 && pyenv root) || echo "$HOME/.pyenv")
    for candidate in "$root"/versions/3.13*/bin/python3 "$root"/versions/3.12*/bin/python3; do
        if [[ -x $candidate ]] && python_ok "$candidate"; then
            echo "$candidate"
            return
        fi
    done
    die "Django 6 needs Python 3.12+ and none was found (tried DJANGO6_PYTHON, python3.13, python3.12, $root/versions); install one, or run make test with BACKLOT_DJANGO6=0 to leave the Django 6 run out"
}

venv_ok() { [[ -x $VENV/bin/python ]] && python_ok "$VENV/bin/python" && "$VENV/bin/python" -m pip --version >/dev/null 2>&1; }

if ! venv_ok; then
    python=$(find_python)
    rm -rf "$VENV"
    log "creating $VENV with $python ($("$python" --version 2>&1))"
    "$python" -m venv "$VENV" || die "$python -m venv $VENV failed"
fi

if [[ ! -f $STAMP || pyproject.toml -nt $STAMP || scripts/venv-django6.sh -nt $STAMP ]]; then
    log "installing the project into $VENV (pip install -e '.[project,dev]' '$DJANGO6')"
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q -e '.[project,dev]' "$DJANGO6" >&2
    touch "$STAMP"
fi
echo "$VENV/bin/python"
