#!/usr/bin/env bash
# Client identity on an open router (issue 27): a batch job with its own key and two developers
# with theirs, on one host, no `user`; and five users sharing one placeholder key.
set -u
cd /work/wt/fairness
export PATH=$PWD/.venv/bin:$PATH
common=(--layouts routed --duration 60 --think 3 --max-tokens 256 --time-scale 2)
specroute bench compare --scenario mixed "${common[@]}" --interactive 2 --batch 16 --named-by api_key --out /tmp/identity/keys
SPECROUTE_CLASSIFY__PLACEHOLDER_KEYS='["*"]' specroute bench compare --scenario mixed "${common[@]}" --interactive 2 --batch 16 --named-by api_key --out /tmp/identity/keys-ignored
specroute bench compare --scenario mixed "${common[@]}" --interactive 5 --batch 0 --named-by nothing --out /tmp/identity/placeholder
specroute bench compare --scenario mixed "${common[@]}" --interactive 5 --batch 0 --named-by api_key --out /tmp/identity/own-keys
