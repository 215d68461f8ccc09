#!/bin/bash
# Reward 1 when the fixed stats.mean passes every case of test_stats.py, else 0.
mkdir -p /logs/verifier
cd /workdir || exit 0
if python3 /tests/test_stats.py; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
