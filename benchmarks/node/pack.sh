#!/usr/bin/env bash
# Pack what the many-core benchmark machine lacks (it has no network) into benchmarks/node/carry/:
# wheels of ckptfs's Python dependencies for its Python, pyfuse3's source (it has no wheel) and
# Debian's libfuse3 headers and library to build it against. Run here (with network), then carry
# the folder to the machine together with the checkout and run benchmarks/node/run.sh there.
#
#   bash benchmarks/node/pack.sh [OUT]        NODE_PYTHON=3.12 (the machine's Python, default 3.12)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/carry}
py=${NODE_PYTHON:-3.12}
pip=${PIP:-pip3}
rm -rf "$out"
mkdir -p "$out/wheels" "$out/sdist" "$out/libfuse"
# What the machine lacks (field-notes: it has torch, numpy, psutil, prometheus-client, rich, safetensors).
deps=(trio crc32c boto3 setuptools wheel)
"$pip" download -q --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$out/wheels" "${deps[@]}"
# pyfuse3's sdist ships the generated C file: no Cython needed, only a compiler and libfuse3.
"$pip" download -q --no-deps --no-binary :all: -d "$out/sdist" pyfuse3  # the index pip is configured with
(cd "$out/libfuse" && apt-get download libfuse3-dev libfuse3-3 >/dev/null 2>&1 \
    && for d in *.deb; do dpkg-deb -x "$d" root && rm "$d"; done)
du -sh "$out"
