#!/usr/bin/env bash
# Installs every Debian package pdcluster's build and tests use, and the Python
# packages of the tests. Idempotent and non-interactive; run as root (or with
# sudo available).
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git python3 python3-pip unzip
  libopenmpi-dev openmpi-bin          # MPI: the cluster's transport and launcher
  libboost-dev                        # Boost.Asio + Boost.Beast: HTTP/1.1 and SSE
  nlohmann-json3-dev                  # JSON, MessagePack/CBOR protocol messages
  catch2                              # unit and integration tests
  libopenblas-dev                     # CPU GEMM
  libxxhash-dev                       # KV checksums, prefix-block hashes
  libcli11-dev                        # command-line parsing
  libspdlog-dev                       # logging
  prometheus-cpp-dev                  # the router's /metrics (its core library only)
  libpcre2-dev                        # Unicode regexes for the tokenizer's pre-tokenizer
  libssl-dev                          # OpenSSL's libcrypto: the cluster secret's HMAC (link proofs)
  iproute2                            # ip, tc: network-namespace hosts of tests/cluster/test_multihost.py
  python3-clang-14                    # libclang: scripts/check_structure.py (class and function size limits)
)

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "setup.sh: all ${#PACKAGES[@]} packages already installed"
else
  echo "setup.sh: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# xgrammar's C++ core (from its PyPI source package, checked by sha256): the
# grammar engine of structured output and tool calls. Built once into .deps/.
bash "$(dirname "${BASH_SOURCE[0]}")/build_xgrammar.sh"

# Python packages (PyPI), for the python3 on PATH (the one CMake's FindPython3
# picks for the cluster tests). Schemathesis: the API fuzz suite
# (tests/cluster/test_fuzz.py, ctest cluster.fuzz_api), which skips when it
# cannot import it, so a failed install is a warning, not an error.
SCHEMATHESIS_VERSION=4.32.5
if python3 -c 'import schemathesis' 2>/dev/null; then
  echo "setup.sh: schemathesis already installed"
else
  echo "setup.sh: installing schemathesis ${SCHEMATHESIS_VERSION}"
  python3 -m pip install --quiet --disable-pip-version-check --break-system-packages \
      "schemathesis==${SCHEMATHESIS_VERSION}" ||
    echo "setup.sh: warning: could not install schemathesis; cluster.fuzz_api will be skipped"
fi
# The official OpenAI client: the structured-output and tool-call tests
# (tests/cluster/test_structured.py) talk to the cluster through it, as users do.
OPENAI_VERSION=3.63.0
if python3 -c 'import openai' 2>/dev/null; then
  echo "setup.sh: openai already installed"
else
  echo "setup.sh: installing openai ${OPENAI_VERSION}"
  python3 -m pip install --quiet --disable-pip-version-check --break-system-packages "openai==${OPENAI_VERSION}" ||
    echo "setup.sh: warning: could not install openai; cluster.structured_* will be skipped"
fi
echo "setup.sh: done"
