#!/usr/bin/env bash
# Everything the test suite needs beyond cargo: the SmolLM2 model (scripts/fetch-model.sh), the
# official `openai` Python client, which the OpenAI-API test drives against a real daemon, and
# `jsonschema`, which checks its JSON schema answers independently of dcd.
#
#   scripts/setup-tests.sh && cargo test --workspace --release --locked
set -euo pipefail
cd "$(dirname "$0")/.."

# Keep in step with OPENAI_PIN and JSONSCHEMA_PIN in tests/tests/openai_api.rs.
OPENAI_PIN="openai==3.57.0"
JSONSCHEMA_PIN="jsonschema==4.26.0"

scripts/fetch-model.sh
if ! python3 -c 'import openai, sys; sys.exit(openai.__version__ != sys.argv[1])' "${OPENAI_PIN#openai==}" 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check "$OPENAI_PIN"
fi
if ! python3 -c 'import importlib.metadata as m, sys; sys.exit(m.version("jsonschema") != sys.argv[1])' "${JSONSCHEMA_PIN#jsonschema==}" 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check "$JSONSCHEMA_PIN"
fi
# The NAT test (tests/tests/nat.rs) builds network namespaces with `ip` and `iptables`: as root
# on a Debian-like machine, install them if they are missing.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    missing=()
    command -v ip >/dev/null || missing+=(iproute2)
    command -v iptables >/dev/null || missing+=(iptables)
    if [ ${#missing[@]} -gt 0 ]; then
        apt-get install -y -q "${missing[@]}" >/dev/null || apt-get update -q >/dev/null &&
            apt-get install -y -q "${missing[@]}" >/dev/null
    fi
fi
