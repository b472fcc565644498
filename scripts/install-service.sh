#!/usr/bin/env bash
# Installs dcd as a systemd service: the binary in /usr/local/bin, a system user `dcd`, the
# unit config/dcd.service, /etc/dcd/dcd.toml (from config/dcd.toml, with the model set), then
# enables and starts it. --uninstall reverses that (keeping /var/lib/dcd and /etc/dcd unless
# --purge). --dry-run prints every action instead of doing it (no root needed).
#
#   sudo scripts/install-service.sh --model smollm2-135m
#   sudo scripts/install-service.sh --binary ./dcd --model /srv/models/my-model.gguf
#   scripts/install-service.sh --dry-run --model smollm2-135m
#   sudo scripts/install-service.sh --uninstall [--purge]
#
# --model takes an installed model's name (smollm2-135m is fetched into /var/lib/dcd if it
# is missing) or a path: a GGUF file or a Hugging Face folder is copied into
# /var/lib/dcd/models/<name>/, because the service cannot read home directories.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PREFIX_BIN=/usr/local/bin
UNIT=/etc/systemd/system/dcd.service
CONF_DIR=/etc/dcd
CONF=$CONF_DIR/dcd.toml
DATA=/var/lib/dcd
USER_NAME=dcd

dry=0
uninstall=0
purge=0
binary=
model=

usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
    echo
    echo "options: [--dry-run] [--uninstall [--purge]] [--binary PATH] [--model M]"
}

while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) dry=1 ;;
        --uninstall) uninstall=1 ;;
        --purge) purge=1 ;;
        --binary) binary=${2:?--binary needs a path}; shift ;;
        --binary=*) binary=${1#*=} ;;
        --model) model=${2:?--model needs a model}; shift ;;
        --model=*) model=${1#*=} ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install-service: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

die() { echo "install-service: $*" >&2; exit 1; }

# Runs a command, or prints it with --dry-run.
run() {
    if [ $dry = 1 ]; then
        printf '+'
        printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}

# Writes stdin to a file (mode, owner:group), or prints what would be written.
write_file() {
    local path=$1 mode=$2 owner=$3
    if [ $dry = 1 ]; then
        echo "+ write $path (mode $mode, owner $owner):"
        sed 's/^/|   /'
    else
        local tmp
        tmp=$(mktemp)
        cat >"$tmp"
        install -m "$mode" -o "${owner%:*}" -g "${owner#*:}" "$tmp" "$path"
        rm -f "$tmp"
    fi
}

if [ $dry = 0 ] && [ "$(id -u)" != 0 ]; then
    die "run as root (sudo), or with --dry-run to see what it would do"
fi
if [ $dry = 0 ] && ! command -v systemctl >/dev/null; then
    die "systemctl not found: this script needs systemd"
fi

if [ $uninstall = 1 ]; then
    echo "# uninstalling the dcd service"
    run systemctl disable --now dcd.service || true
    run rm -f "$UNIT"
    run systemctl daemon-reload
    run rm -f "$PREFIX_BIN/dcd"
    if [ $purge = 1 ]; then
        run rm -rf "$CONF_DIR" "$DATA"
    else
        echo "# keeping $CONF_DIR and $DATA (identity key, models); --purge removes them"
    fi
    if [ $dry = 1 ] || id -u "$USER_NAME" >/dev/null 2>&1; then
        run userdel "$USER_NAME"
    fi
    echo "# done"
    exit 0
fi

# The binary: --binary, else a release build in this checkout, else dcd on PATH.
if [ -z "$binary" ]; then
    for b in "$here/target/release/dcd" "$(command -v dcd || true)"; do
        if [ -n "$b" ] && [ -x "$b" ]; then binary=$b; break; fi
    done
fi
[ -n "$binary" ] || die "no dcd binary: build it (cargo build --release -p dcd) or give --binary PATH"
[ -x "$binary" ] || die "--binary $binary is not an executable file"
binary=$(cd "$(dirname "$binary")" && pwd)/$(basename "$binary")
[ -n "$model" ] || die "give --model M (an installed model's name, a GGUF file or a model folder)"
[ -f "$here/config/dcd.service" ] && [ -f "$here/config/dcd.toml" ] \
    || die "config/dcd.service and config/dcd.toml not found next to this script"

echo "# installing the dcd service (binary $binary, model $model)"
run install -m 0755 "$binary" "$PREFIX_BIN/dcd"
if [ $dry = 1 ] || ! id -u "$USER_NAME" >/dev/null 2>&1; then
    run useradd --system --home-dir "$DATA" --no-create-home --shell /usr/sbin/nologin \
        --comment "DaisyChain daemon" "$USER_NAME"
fi
run install -d -m 0750 -o "$USER_NAME" -g "$USER_NAME" "$DATA" "$DATA/models"
run install -d -m 0755 "$CONF_DIR"

# The model: a path is copied into the store; a name must be installed there (smollm2-135m
# is fetched when missing).
if [ -e "$model" ]; then
    name=$(basename "$model")
    name=${name%.gguf}
    name=$(printf '%s' "$name" | tr -c 'A-Za-z0-9._-' '-')
    run install -d -m 0750 -o "$USER_NAME" -g "$USER_NAME" "$DATA/models/$name"
    if [ -d "$model" ]; then
        run cp -r "$model/." "$DATA/models/$name/"
    else
        run cp "$model" "$DATA/models/$name/"
    fi
    run chown -R "$USER_NAME:$USER_NAME" "$DATA/models/$name"
    model=$name
elif [ "$model" = smollm2-135m ]; then
    if [ $dry = 1 ] || [ ! -d "$DATA/models/$model" ]; then
        run runuser -u "$USER_NAME" -- env HOME="$DATA" DCD_DATA_DIR="$DATA" \
            bash "$here/scripts/fetch-model.sh"
    fi
elif [ $dry = 0 ] && [ ! -d "$DATA/models/$model" ]; then
    echo "# warning: $DATA/models/$model does not exist yet: install the model there" >&2
fi

if [ $dry = 0 ] && [ -e "$CONF" ]; then
    echo "# keeping the existing $CONF"
else
    {
        echo "# Written by scripts/install-service.sh; every setting is documented below."
        printf 'model = "%s"\n\n' "$model"
        cat "$here/config/dcd.toml"
    } | write_file "$CONF" 0640 "root:$USER_NAME"
fi

sed "s#^ExecStart=/usr/local/bin/dcd #ExecStart=$PREFIX_BIN/dcd #" "$here/config/dcd.service" \
    | write_file "$UNIT" 0644 root:root
run systemctl daemon-reload
run systemctl enable --now dcd.service
echo "# done: 'dcd status' shows the daemon, 'journalctl -u dcd' its log"
