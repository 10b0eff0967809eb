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
