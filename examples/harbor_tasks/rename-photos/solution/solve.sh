#!/bin/bash
cd /workdir/photos && for f in *.JPG; do mv "$f" "${f%.JPG}.jpg"; done
