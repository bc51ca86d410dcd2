#!/usr/bin/env bash
# Makes build/pyenv, a virtual environment holding the Python clients pinned
# in tests/clients/requirements.txt (the official `openai` client and
# langchain-openai, from PyPI), for the router tests (tests/proc.h
# py_clients_ready) and tools/load.sh. Idempotent and safe to run from
# several processes at once: under a lock, it does nothing when the
# environment's stamp (a copy of the requirements, written after a good
# install) matches the file; otherwise it makes the environment afresh.
# Needs python3 with venv (Debian: python3-venv, tools/deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=build/pyenv
REQ=tests/clients/requirements.txt
mkdir -p build
exec 9>build/pyenv.lock
flock 9
if [ -x "$ENV/bin/python" ] && cmp -s "$REQ" "$ENV/tandem-requirements.txt"; then exit 0; fi
echo "pyenv: installing $(grep -v '^#' "$REQ" | tr '\n' ' ')into $ENV" >&2
rm -rf "$ENV"
python3 -m venv "$ENV"
"$ENV/bin/python" -m pip install --disable-pip-version-check --no-input -q --retries 2 --timeout 30 -r "$REQ"
"$ENV/bin/python" -c 'import openai, langchain_openai, pydantic'
cp "$REQ" "$ENV/tandem-requirements.txt"
