"""Reward 1 for a config.json equal to the requested object, 0.5 for valid JSON with other content, else 0."""

import json

try:
    with open("/workdir/config.json") as f:
        config = json.load(f)
except (OSError, ValueError):
    reward = 0.0
else:
    want = {"port": 8080, "debug": False, "name": "harbor"}
    same = config == want and all(type(config[k]) is type(want[k]) for k in want) if isinstance(config, dict) else False
    reward = 1.0 if same else 0.5
with open("/logs/verifier/reward.json", "w") as f:
    json.dump({"reward": reward}, f)
