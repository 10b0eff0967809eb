# Sourced by the scripts in this folder: make a virtual environment ready for a set of extras.
#
# The interpreter is $PYTHON (default: python3). Its environment is $MODELPOOL_VENV when
# that is set, else .venv when it is the machine's default python3, and .venv-3.X for any
# other version, so that testing another version never rebuilds the default one. Only the versions named in pyproject.toml's
# classifiers are accepted: those are the ones the project tests.
#
# torch is the pinned release. Without an NVIDIA GPU it is the CPU build (torch==X+cpu,
# about 190 MB), which PyTorch publishes on its own index, not on PyPI: a local wheel or a
# mirror that pip's configuration names is taken first, then $MODELPOOL_TORCH_CPU_INDEX.
# When neither has it for this Python, the script says so and installs PyPI's build,
# which runs on a CPU too but pulls about 4 GB of CUDA libraries.
#
# Idempotent and quiet on a second run: torch is installed only when the pinned release
# is missing, and the project only when pyproject.toml or the extras changed since the
# last install (a stamp file in the environment records that).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_PIN="2.13.0"
# llama-cpp-python (the llama_cpp backend, modelpool[llama]): PyPI has no CPU wheel, so it
# is compiled once, by build_llama_cpp_wheel below, into this folder, and every venv of
# every Python installs that wheel (ctypes bindings: nothing in it is tied to one Python).
LLAMA_CPP_PIN="0.3.36"
LLAMA_CPP_WHEELS="${MODELPOOL_WHEEL_CACHE:-$HOME/.cache/modelpool/wheels}"
TORCH_CPU_INDEX="${MODELPOOL_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

# The Python versions the project supports and tests, from pyproject.toml, one per line.
supported_pythons() {
    grep -o '"Programming Language :: Python :: 3\.[0-9]*"' "$ROOT/pyproject.toml" |
        grep -o '3\.[0-9]*'
}

# "3.X" for an interpreter, or nothing when it cannot run.
python_version() {
    "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true
}

# The version .venv has, or would be made with (python3).
default_python_version() {
    if [ -x "$ROOT/.venv/bin/python" ]; then
        python_version "$ROOT/.venv/bin/python"
    else
        python_version python3
    fi
}

# The newest pyenv interpreter of version 3.X ($PYENV_ROOT/versions/3.X.*), or nothing.
pyenv_python() {
    local version="$1" candidate
    while read -r candidate; do
        if [ -n "$candidate" ] && [ "$(python_version "$candidate")" = "$version" ]; then
            echo "$candidate"
            return
        fi
    done < <(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/$version".*/bin/python"$version" \
        2>/dev/null | sort -V -r)
}

# Sets PY_VERSION, VENV and PY for $PYTHON, or exits with the reason. Without $PYTHON it
# is .venv's own Python (the one a user made it with), or python3 for a new .venv.
select_python() {
    local python="${PYTHON:-}"
    if [ -z "$python" ] && [ -x "$ROOT/.venv/bin/python" ]; then
        python="$ROOT/.venv/bin/python"
    fi
    python="${python:-python3}"
    PY_VERSION="$(python_version "$python")"
    if [ -z "$PY_VERSION" ] && [[ "$python" =~ ^python(3\.[0-9]+)$ ]]; then
        # Not on PATH: where scripts/test-pythons also looks.
        local found
        found="$(pyenv_python "${BASH_REMATCH[1]}")"
        if [ -n "$found" ]; then
            python="$found"
            PY_VERSION="$(python_version "$python")"
        fi
    fi
    if [ -z "$PY_VERSION" ]; then
        echo "bootstrap: cannot run the interpreter '$python' (neither on PATH nor under" \
            "${PYENV_ROOT:-$HOME/.pyenv}/versions)" >&2
        exit 2
    fi
    if ! supported_pythons | grep -qx "$PY_VERSION"; then
        echo "bootstrap: $python is Python $PY_VERSION; modelpool supports and tests" \
            "$(supported_pythons | tr '\n' ' ')(pyproject.toml's classifiers)" >&2
        exit 2
    fi
    if [ -n "${MODELPOOL_VENV:-}" ]; then
        VENV="$MODELPOOL_VENV"
    elif [ "$PY_VERSION" = "$(default_python_version)" ]; then
        VENV="$ROOT/.venv"
    else
        VENV="$ROOT/.venv-$PY_VERSION"
    fi
    PY="$VENV/bin/python"
    PYTHON_FOR_VENV="$python"
}

has_nvidia_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}

install_torch() {
    if has_nvidia_gpu; then
        echo "bootstrap: installing torch==$TORCH_PIN (NVIDIA GPU found: PyPI's CUDA build)" >&2
        "$PY" -m pip install --quiet "torch==$TORCH_PIN"
        return
    fi
    echo "bootstrap: installing torch==$TORCH_PIN+cpu (no NVIDIA GPU)" >&2
    # Sources pip is configured with first, so that an unreachable PyTorch index costs
    # nothing when a local wheel or mirror has the build.
    if "$PY" -m pip install --quiet "torch==$TORCH_PIN+cpu" >/dev/null 2>&1; then
        return
    fi
    local log
    log="$(mktemp)"
    if "$PY" -m pip install --quiet --retries 1 --timeout 30 \
        --extra-index-url "$TORCH_CPU_INDEX" "torch==$TORCH_PIN+cpu" >"$log" 2>&1; then
        rm -f "$log"
        return
    fi
    local why="has none for this Python"
    if grep -qE 'NameResolutionError|NewConnectionError|ConnectTimeout|connection broken|Could not fetch URL' "$log"; then
        why="is unreachable"
    fi
    echo "bootstrap: no CPU build of torch $TORCH_PIN for Python $PY_VERSION: not in pip's" \
        "configured sources, and $TORCH_CPU_INDEX $why." >&2
    echo "bootstrap: installing PyPI's torch==$TORCH_PIN instead: it runs on the CPU but" \
        "brings about 4 GB of CUDA libraries. A mirror of the CPU index avoids that:" \
        "MODELPOOL_TORCH_CPU_INDEX=<url>." >&2
    rm -f "$log"
    "$PY" -m pip install --quiet "torch==$TORCH_PIN"
}

bootstrap() {
    local extras="$1"
    select_python
    if [ -x "$PY" ] && [ "$(python_version "$PY")" != "$PY_VERSION" ]; then
        echo "bootstrap: $VENV has Python $(python_version "$PY"), not $PY_VERSION: rebuilding" >&2
        rm -rf "$VENV"
    fi
    if [ ! -x "$PY" ]; then
        echo "bootstrap: creating $VENV (Python $PY_VERSION)" >&2
        "$PYTHON_FOR_VENV" -m venv "$VENV"
        "$PY" -m pip install --quiet --upgrade pip
    fi
    local torch_version
    torch_version="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
    if [ "${torch_version%%+*}" != "$TORCH_PIN" ]; then
        install_torch
    fi
    # Before the project: pip would otherwise compile llama.cpp itself, natively (below).
    if extra_packages "$extras" | tr ',' '\n' | grep -qx ' *llama-cpp-python'; then
        install_llama_cpp
    fi
    local digest stamp
    # The checkout's path is in the stamp too: a venv outside the checkout
    # ($MODELPOOL_VENV) gets the project installed again, editable, from each checkout.
    digest="$({ cat "$ROOT/pyproject.toml"; echo "$ROOT"; } | sha256sum | cut -c1-16)"
    stamp="$VENV/.modelpool-installed-${extras//,/-}-$digest"
    # Another checkout sharing the venv may have installed itself over this one since.
    if [ -f "$stamp" ] && ! "$PY" -c 'import modelpool, sys
sys.exit(not modelpool.__file__.startswith(sys.argv[1]))' "$ROOT/src/" 2>/dev/null; then
        rm -f "$stamp"
    fi
    if [ ! -f "$stamp" ]; then
        echo "bootstrap: installing modelpool[$extras] into $VENV, once (pip is quiet until" \
            "it is done; a minute or more the first time): $(extra_packages "$extras")" >&2
        "$PY" -m pip install --quiet -e "$ROOT[$extras]" "torch==$TORCH_PIN"
        touch "$stamp"
    fi
}

# The packages the extras bring, nested modelpool[...] extras followed, comma-separated:
# named before an install that may take minutes without a word from pip.
extra_packages() {
    "$PY" - "$ROOT/pyproject.toml" "$1" <<'PYTHON'
import re
import sys
import tomllib

with open(sys.argv[1], "rb") as pyproject:
    extras = tomllib.load(pyproject)["project"]["optional-dependencies"]
todo, seen, names = sys.argv[2].split(","), set(), []
while todo:
    extra = todo.pop(0)
    if extra in seen or extra not in extras:
        continue
    seen.add(extra)
    for requirement in extras[extra]:
        nested = re.fullmatch(r"modelpool\[([^\]]+)\]", requirement)
        if nested:
            todo.extend(nested.group(1).split(","))
            continue
        name = re.match(r"[A-Za-z0-9_.-]+", requirement)
        if name and name.group(0) not in names:
            names.append(name.group(0))
print(", ".join(names))
PYTHON
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

# The CMake flags llama.cpp is compiled with: a portable build, never a native one.
# GGML_NATIVE (its default) compiles for the build machine's own CPU (-march=native): on
# the machine this project is developed on that enables AMX, which its sandbox does not
# allow, and the first decode crashes (SIGSEGV); a cached wheel would also crash on any
# older CPU it is copied to. Instead, on x86-64, the x86-64-v3 level (AVX2, FMA, F16C,
# BMI2: Intel Haswell / AMD Zen and later, 2013 on), without AVX-512 or AMX; elsewhere
# (aarch64) the compiler's generic target. OpenMP off: ggml's own thread pool, no libgomp
# in the worker processes. No libcurl (modelpool never downloads through llama.cpp).
# MODELPOOL_LLAMA_CMAKE_ARGS adds flags (e.g. -DGGML_CUDA=on for a CUDA build).
llama_cpp_cmake_args() {
    local args="-DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF"
    args+=" -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF"
    args+=" -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF"
    if [ "$(uname -m)" = "x86_64" ]; then
        args+=" -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
        args+=" -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF"
        args+=" -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF"
        args+=" -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    fi
    echo "$args ${MODELPOOL_LLAMA_CMAKE_ARGS:-}"
}

# The cached llama-cpp-python wheel, or nothing.
llama_cpp_wheel() {
    ls "$LLAMA_CPP_WHEELS"/llama_cpp_python-"$LLAMA_CPP_PIN"-*.whl 2>/dev/null | head -n 1
}

# Compiles llama-cpp-python==$LLAMA_CPP_PIN into $LLAMA_CPP_WHEELS, once: 2 to 4 minutes on
# this project's 2-core machine. Needs a C++ compiler and cmake (Debian: build-essential cmake).
build_llama_cpp_wheel() {
    local cores started
    cores="$(nproc)"
    started="$(date +%s)"
    mkdir -p "$LLAMA_CPP_WHEELS"
    echo "bootstrap: compiling llama-cpp-python $LLAMA_CPP_PIN once, with portable CPU flags," \
        "on $cores cores (2 to 4 minutes on 2), into $LLAMA_CPP_WHEELS" >&2
    CMAKE_ARGS="$(llama_cpp_cmake_args)" CMAKE_BUILD_PARALLEL_LEVEL="$cores" \
        "$PY" -m pip wheel --quiet --no-deps --no-binary llama-cpp-python \
        -w "$LLAMA_CPP_WHEELS" "llama-cpp-python==$LLAMA_CPP_PIN"
    echo "bootstrap: llama-cpp-python compiled in $(($(date +%s) - started)) s" >&2
}

install_llama_cpp() {
    local installed
    installed="$("$PY" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || true)"
    if [ "$installed" = "$LLAMA_CPP_PIN" ]; then
        return
    fi
    if [ -z "$(llama_cpp_wheel)" ]; then
        build_llama_cpp_wheel
    fi
    "$PY" -m pip install --quiet "$(llama_cpp_wheel)"
}
