#!/bin/bash
# Reward 1 when the fixed stats.mean passes every case of test_stats.py, else 0.
# The test imports the agent's stats.py, so the agent's code runs here: the verdict is taken from the exit status
# only, every process it may have left is killed, and the reward file is written last, from a clean directory.
mkdir -p /logs/verifier
cd /workdir || exit 0
timeout 20 python3 /tests/test_stats.py < /dev/null
status=$?
kill -9 -1 2> /dev/null  # every other process of this sandbox (the PID namespace's init is spared)
rm -rf /logs/verifier/reward.txt /logs/verifier/reward.json
if [ "$status" -eq 0 ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
