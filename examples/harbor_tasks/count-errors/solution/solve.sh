#!/bin/bash
grep -c ERROR /workdir/app.log > /workdir/answer.txt
