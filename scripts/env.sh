#!/usr/bin/env bash
# Set up (idempotently) everything nnloom's build, demo, tests and benchmarks
# need, OUTSIDE the repository: Debian packages, and a virtual environment in
# $NNLOOM_HOME (default ~/.cache/nnloom) with the pinned Python packages.
# A second run finds the stamp files and returns at once.
#
#   scripts/env.sh            build + tests environment
#   scripts/env.sh bench      also the benchmark anchors (nnsight 0.8 from PyPI)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
home=${NNLOOM_HOME:-$HOME/.cache/nnloom}
venv=$home/venv
want=${1:-base}

say() { printf '[nnloom env] %s\n' "$*" >&2; }

# ---- Debian packages -------------------------------------------------------
apt_pkgs=(libcmocka-dev)
missing=()
for p in "${apt_pkgs[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    say "installing Debian packages: ${missing[*]}"
    sudo_=""
    [ "$(id -u)" -eq 0 ] || sudo_="sudo"
    $sudo_ apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq "${missing[@]}" >&2
fi

# ---- interpreter -------------------------------------------------------------
pick_python() {
    for c in "${NNLOOM_PYTHON:-}" python3.12 python3.11 python3.13 python3.10 python3; do
        [ -n "$c" ] || continue
        if command -v "$c" >/dev/null 2>&1 &&
            "$c" -c 'import sys; sys.exit(not ((3,10) <= sys.version_info[:2] <= (3,13)))' 2>/dev/null; then
            command -v "$c"; return 0
        fi
    done
    return 1
}

if [ ! -x "$venv/bin/python" ]; then
    py=$(pick_python) || { say "no Python 3.10-3.13 found"; exit 1; }
    say "creating virtual environment $venv with $py"
    mkdir -p "$home"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
fi

# ---- Python packages ---------------------------------------------------------
install_set() { # name requirements-file
    local name=$1 req=$2 stamp
    stamp="$venv/.nnloom-$name-$(sha256sum "$req" | cut -c1-16)"
    [ -f "$stamp" ] && return 0
    say "installing Python packages ($name) into $venv:"
    grep -v '^\s*#' "$req" | grep -v '^\s*$' | sed 's/^/[nnloom env]   /' >&2
    "$venv/bin/python" -m pip install -q -r "$req" >&2
    rm -f "$venv/.nnloom-$name-"*
    touch "$stamp"
}

install_set base "$here/requirements.txt"
if [ "$want" = bench ]; then
    install_set bench "$here/requirements-bench.txt"
fi
echo "$venv/bin/python"
