#!/usr/bin/env bash
# Create .venv (if missing) and install the project into it (when pyproject.toml is
# newer than the stamp .venv/.installed). Used by `make venv`. The editable install is the
# platform (jobs/) with the reference project's and the developers' dependencies (the
# `project` and `dev` extras); config/, emails/, ... are imported from the repository root.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib.sh

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.installed

command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found; install Python 3.11+ (Debian: apt-get install -y python3 python3-venv)"

venv_ok() { [[ -x $VENV/bin/python ]] && "$VENV/bin/python" -m pip --version >/dev/null 2>&1; }

if ! venv_ok; then
    if [[ -e $VENV ]]; then
        log "$VENV is incomplete (no working pip); re-creating it"
        rm -rf "$VENV"
    fi
    log "creating $VENV with $PYTHON"
    if ! "$PYTHON" -m venv "$VENV"; then
        rm -rf "$VENV"
        # Debian/Ubuntu ship venv's ensurepip separately.
        pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        apt_install python3-venv
        if ! "$PYTHON" -m venv "$VENV"; then
            rm -rf "$VENV"
            apt_install "python${pyver}-venv"
            "$PYTHON" -m venv "$VENV" || die "$PYTHON -m venv failed even after installing python3-venv"
        fi
    fi
    rm -f "$STAMP"
fi

# The suite runs on Django 5.2 LTS, whatever the interpreter: on Python 3.12+ pyproject's
# Django>=5.2,<6.1 would take 6.0 (that one is .venv-django6's, scripts/venv-django6.sh).
if [[ ! -f $STAMP || pyproject.toml -nt $STAMP ]]; then
    log "installing the project into $VENV (pip install -e '.[project,dev]' 'Django>=5.2,<5.3')"
    "$VENV/bin/python" -m pip install --disable-pip-version-check -e '.[project,dev]' 'Django>=5.2,<5.3'
    touch "$STAMP"
fi
