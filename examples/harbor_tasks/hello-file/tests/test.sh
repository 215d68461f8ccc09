#!/bin/bash
# Reward 1 when /workdir/hello.txt holds exactly "Hello, Harbor!" and a newline, else 0.
mkdir -p /logs/verifier
if printf 'Hello, Harbor!\n' | cmp -s - /workdir/hello.txt; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
