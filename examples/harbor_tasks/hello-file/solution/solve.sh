#!/bin/bash
echo 'Hello, Harbor!' > /workdir/hello.txt
