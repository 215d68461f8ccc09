#!/bin/bash
# Reward 1 when /workdir/answer.txt holds the expected count (surrounding whitespace ignored), else 0.
mkdir -p /logs/verifier
answer=$(tr -d '[:space:]' < /workdir/answer.txt 2>/dev/null)
expected=$(tr -d '[:space:]' < /tests/expected.txt)
if [ -n "$answer" ] && [ "$answer" = "$expected" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
