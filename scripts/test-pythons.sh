#!/usr/bin/env bash
# Run the interleaving tests on every other CPython 3.10-3.13 this machine has
# (frame writes differ before and after PEP 667, tracing differs from 3.12 on).
# Each interpreter gets its own environment in $NNLOOM_HOME/venv-X.Y with the
# pinned packages (installed once), and its own build of the extension.
set -euo pipefail
cd "$(dirname "$0")/.."
home=${NNLOOM_HOME:-$HOME/.cache/nnloom}
main_py=$("$home/venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
say() { printf '[nnloom pythons] %s\n' "$*" >&2; }

find_python() { # X.Y -> an interpreter of that version, or nothing
    local v=$1 c
    for c in "python$v" /root/.pyenv/versions/"$v".*/bin/"python$v" /usr/bin/"python$v"; do
        [ -x "$(command -v "$c" 2>/dev/null || echo "$c")" ] || continue
        if "$c" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$v'.split('.'))))" 2>/dev/null; then
            command -v "$c" 2>/dev/null || echo "$c"
            return 0
        fi
    done
    return 1
}

ran=0
for v in 3.10 3.11 3.12 3.13; do
    [ "$v" = "$main_py" ] && continue
    py=$(find_python "$v") || { say "python$v: not on this machine, skipped"; continue; }
    venv=$home/venv-$v
    req=scripts/requirements.txt
    stamp=$venv/.nnloom-base-$(sha256sum "$req" | cut -c1-16)
    if [ ! -f "$stamp" ]; then
        say "python$v: installing the pinned packages into $venv"
        "$py" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip >&2
        "$venv/bin/python" -m pip install -q -r "$req" >&2
        touch "$stamp"
    fi
    build=build/py${v/./}
    "$venv/bin/cmake" -S . -B "$build" -G Ninja -DPython3_EXECUTABLE="$venv/bin/python" \
        -DNNLOOM_BUILD_TESTS=OFF >/dev/null
    "$venv/bin/cmake" --build "$build" >/dev/null
    pkg=$(mktemp -d)
    cp -r python/nnloom "$pkg/"
    rm -f "$pkg"/nnloom/_C*.so
    cp "$build"/_C*.so "$pkg/nnloom/"
    say "python$v: running the interleaving tests"
    (cd tests && PYTHONPATH="$pkg" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
        py/test_core_reads.py py/test_core_edits.py py/test_core_save.py \
        py/test_core_control.py py/test_core_errors.py py/test_core_resources.py \
        py/test_batch.py py/test_generate.py py/test_requests.py)
    rm -rf "$pkg"
    ran=$((ran + 1))
done
say "tested on $ran more interpreter(s)"
