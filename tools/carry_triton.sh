#!/usr/bin/env bash
# Another Triton for the lent GPU machine, whose image has 3.6 only: run here, then carry its parts.
#
#   bash tools/carry_triton.sh [VERSION]     (default 3.9.0, the newest pyproject.toml allows)
#
# The wheel (about 290 MB) is over a call's 64 MiB: it is downloaded for the machine's Python 3.12 on
# x86-64, less what our kernels never load there (the AMD backend's code generator, CUPTI, the legacy ptxas,
# which 3.9 runs for GPUs before sm_90 only, the instrumentation test library) and its libraries' debug
# information, packed with xz and split into parts of at most 60 MiB under .triton-carry/ (ignored: add
# `/.triton-carry/` to .git/info/exclude). The ptxas kept is the one 3.9 compiles sm_90 with (ptxas-blackwell,
# CUDA 13): the legacy one (12.9) in its place crashed on the warp-specialised one pass's causal, grouped build.
# 3.9.0 packs into one part of 57 MiB, which (with the 3.4 MB tree) just travels with the working tree in one call:
#
#   run(carry=[".whl", ".triton-carry/part-aa"], command="bash tools/h200.sh triton-part triton-install && ...")
#
# More parts travel in a call each to the same warm machine, a few seconds apart (a machine left idle 30 s
# goes back, and its parts with it), the last call's stages `triton-part triton-install`.
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
       "$work/site/triton/backends/nvidia/bin/ptxas" "$work"/site/triton/instrumentation/*.so
# (the shared libraries' debug information is most of the wheel: libtriton.so 500 MB -> 192 MB without it, which
# brings the packed wheel under one part)
strip --strip-unneeded "$work"/site/triton/_C/*.so
rm -rf "$out"; mkdir -p "$out"
tar -cf - -C "$work/site" . | xz -6 -T0 | split -b 60M - "$out/part-"
echo "$version" > "$out/VERSION"
ls -l "$out"
