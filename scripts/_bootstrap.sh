# Sourced by the scripts in this folder: make .venv ready for a set of extras.
#
# Idempotent and quiet on a second run: torch is installed only when the pinned
# CPU build is missing, and the project only when pyproject.toml or the extras
# changed since the last install (a stamp file in .venv records that).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
TORCH_PIN="2.13.0"

bootstrap() {
    local extras="$1"
    if [ ! -x "$PY" ]; then
        echo "bootstrap: creating $VENV" >&2
        python3 -m venv "$VENV"
        "$PY" -m pip install --quiet --upgrade pip
    fi
    local torch_version
    torch_version="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
    if [ "${torch_version%%+*}" != "$TORCH_PIN" ]; then
        echo "bootstrap: installing torch==$TORCH_PIN" >&2
        "$PY" -m pip install --quiet "torch==$TORCH_PIN"
    fi
    local digest stamp
    digest="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
    stamp="$VENV/.modelpool-installed-${extras//,/-}-$digest"
    if [ ! -f "$stamp" ]; then
        echo "bootstrap: installing modelpool[$extras]" >&2
        "$PY" -m pip install --quiet -e "$ROOT[$extras]" "torch==$TORCH_PIN"
        touch "$stamp"
    fi
}

# haproxy (Debian package) for scripts/scale-out and its short variant in the tests:
# installed when missing, where this user may (root, or passwordless sudo).
install_haproxy() {
    command -v haproxy >/dev/null 2>&1 && return 0
    local sudo=""
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo="sudo -n"
        else
            echo "bootstrap: haproxy is missing and this user cannot install it (apt-get install haproxy)" >&2
            return 1
        fi
    fi
    echo "bootstrap: installing haproxy (apt-get)" >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq haproxy >/dev/null
}
