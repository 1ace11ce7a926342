#!/bin/sh
# The native capture core (native/: Rust + PyO3, the module tideline_native) as a wheel in OUT_DIR:
#
#   docker/build-native.sh OUT_DIR
#
# The image's builder stage runs it (docker/Dockerfile), and tests/tideline/test_docker_image.py runs it the
# same way, installs the wheel into a fresh venv and imports it there. Needs cargo and maturin on PATH; the
# wheel is abi3 (CPython >= 3.11), tagged for the glibc of the machine that builds it. CARGO_TARGET_DIR, when
# set, is where cargo builds (the test reuses native/target).
set -eu
out=${1:?usage: docker/build-native.sh OUT_DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
maturin build --release --manifest-path "$root/native/Cargo.toml" --out "$out"
