#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv inside this checkout and install into it
# torch==2.13.0 first, then pipeblocks itself (editable) with its test tools and the
# Hugging Face extras (transformers, safetensors and tokenizers for --hf and --save-hf;
# datasets for --data of a save_to_disk directory). Each checkout
# has its own environment: the system's Python is never touched (Debian refuses pip there)
# and two clones never re-point each other's `pipeblocks`.
#
# A second run is quick: when the stamp in .venv matches pyproject.toml, the torch pin and
# this checkout's path, and .venv's pipeblocks is this checkout's, pip is not run.
#
# Environment:
#   PYTHON                      interpreter that creates .venv (default python3, 3.10 or newer)
#   PIPEBLOCKS_TORCH_INDEX_URL  where torch comes from, e.g. https://download.pytorch.org/whl/cpu
#                               for the CPU-only build (default: pip's own index, which gives
#                               the CUDA build on Linux; it runs on CPU too)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
TORCH="torch==2.13.0"
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.pipeblocks-setup"

say() { echo "setup: $*" >&2; }

digest() {  # sha256 of stdin
    if command -v sha256sum >/dev/null 2>&1; then sha256sum | cut -d' ' -f1; else shasum -a 256 | cut -d' ' -f1; fi
}

# What .venv was last set up for; any change (a new dependency, another torch) reinstalls.
want=$({ cat pyproject.toml; echo "$TORCH ${PIPEBLOCKS_TORCH_INDEX_URL:-}"; pwd; } | digest)

installed_here() {  # .venv has torch and *this* checkout's pipeblocks
    local origin
    origin=$("$VENV/bin/python" -c "import importlib.util as u; s = u.find_spec('pipeblocks'); \
print(s.origin if s and u.find_spec('torch') else '')" 2>/dev/null) || return 1
    [ "$origin" = "$PWD/src/pipeblocks/__init__.py" ]
}

if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && installed_here; then
    say "reusing $VENV (up to date)"
    exit 0
fi

if ! { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "" 2>/dev/null; }; then
    if ! command -v "$PYTHON" >/dev/null 2>&1; then
        say "error: no '$PYTHON' found: install Python 3.10 or newer (Debian/Ubuntu: apt-get install python3 python3-venv)"
        exit 1
    fi
    if ! "$PYTHON" -c "import sys; sys.exit(sys.version_info < (3, 10))" 2>/dev/null; then
        say "error: $PYTHON is $("$PYTHON" --version 2>&1); pipeblocks needs 3.10 or newer (set PYTHON=python3.x)"
        exit 1
    fi
    # Debian and Ubuntu ship venv's ensurepip in a separate package.
    if ! "$PYTHON" -c "import venv, ensurepip" 2>/dev/null; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            say "$PYTHON cannot create a virtual environment: installing python3-venv with apt-get"
            apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
        fi
        if ! "$PYTHON" -c "import venv, ensurepip" 2>/dev/null; then
            say "error: $PYTHON cannot create a virtual environment (no venv/ensurepip module)."
            say "On Debian or Ubuntu run:  sudo apt-get install python3-venv   then run this script again."
            exit 1
        fi
    fi
    if [ -e "$VENV" ]; then
        if [ ! -f "$VENV/pyvenv.cfg" ]; then
            say "error: $PWD/$VENV exists but is not a virtual environment: move it away and run this again"
            exit 1
        fi
        say "recreating $VENV (its interpreter no longer runs: was the checkout moved?)"
        rm -rf "$VENV"
    fi
    say "creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
say "installing $TORCH into $VENV${PIPEBLOCKS_TORCH_INDEX_URL:+ from $PIPEBLOCKS_TORCH_INDEX_URL}"
if [ -n "${PIPEBLOCKS_TORCH_INDEX_URL:-}" ]; then
    "${pip[@]}" --index-url "$PIPEBLOCKS_TORCH_INDEX_URL" "$TORCH"
else
    "${pip[@]}" "$TORCH"
fi
say "installing pipeblocks (editable) and its test tools into $VENV"
"${pip[@]}" -e ".[test,hf,datasets]"
echo "$want" >"$STAMP"
say "ready: 'source $VENV/bin/activate', or run $VENV/bin/pipeblocks directly"
