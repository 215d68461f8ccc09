#!/bin/bash
# Writes /logs/verifier/reward.json: 1 for the exact config, 0.5 for other valid JSON, 0 otherwise.
mkdir -p /logs/verifier
python3 /tests/check.py || echo '{"reward": 0.0}' > /logs/verifier/reward.json
