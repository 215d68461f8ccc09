#!/bin/bash
# Writes /logs/verifier/reward.json: {"reward": share of photos renamed, ...}.
mkdir -p /logs/verifier
python3 /tests/check.py || echo '{"reward": 0.0}' > /logs/verifier/reward.json
