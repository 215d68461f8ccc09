#!/bin/bash
printf '{"port": 8080, "debug": false, "name": "harbor"}\n' > /workdir/config.json
