#!/usr/bin/env bash
# Another Triton for the lent GPU machine, whose image has 3.6 only: run here, then carry its parts.
#
#   bash tools/carry_triton.sh [VERSION]     (default 3.9.0, the newest pyproject.toml allows)
#
# The wheel (about 290 MB) is over a call's 64 MiB, so it goes in parts: downloaded for the machine's
# Python 3.12 on x86-64, less what our kernels never load there (the AMD backend's code generator,
# CUPTI, Blackwell's ptxas, the instrumentation test library), packed with xz and split into parts of
# at most 55 MB under .triton-carry/ (ignored: add `/.triton-carry/` to .git/info/exclude). Each part
# travels in a call of its own to the same warm machine, each call a few seconds apart (a machine left
# idle 30 s goes back, and its parts with it):
#
#   run(carry=[".whl", ".triton-carry/part-aa"], command="bash tools/h200.sh triton-part")
#   run(carry=[".whl", ".triton-carry/part-ab"], command="bash tools/h200.sh triton-part triton-install")
#
# after which, on that machine, `TRITON_CARRIED=1 bash tools/h200.sh STAGE...` runs any stage under it.
set -euo pipefail
version=${1:-3.9.0}
out=.triton-carry
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$work" "triton==$version"
mkdir -p "$work/site"
(cd "$work/site" && unzip -q "$work"/triton-*.whl)
rm -rf "$work/site/triton/backends/amd/lib/libtriton_amd_codegen.so" \
       "$work/site/triton/backends/nvidia/lib/cupti" "$work/site/triton/backends/nvidia/lib/cupti-blackwell" \
       "$work/site/triton/backends/nvidia/bin/ptxas-blackwell" "$work"/site/triton/instrumentation/*.so
rm -rf "$out"; mkdir -p "$out"
tar -cf - -C "$work/site" . | xz -6 -T0 | split -b 55M - "$out/part-"
echo "$version" > "$out/VERSION"
ls -l "$out"
