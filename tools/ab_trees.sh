#!/usr/bin/env bash
# A/B trees from the committed patches, on the CPU before a GPU call: ab/<name>/ is this checkout's HEAD (the code,
# tests and tools) with tools/ab/<name>.patch applied. Carry "ab" to the GPU and name the trees in AB_TREES
# (tools/h200.sh's ab-bench and ab-tests stages).
# Usage: bash tools/ab_trees.sh [NAME...]   (no name: every patch in tools/ab/)
set -euo pipefail
cd "$(dirname "$0")/.."
names=("$@")
[ "${#names[@]}" -gt 0 ] || mapfile -t names < <(ls tools/ab/*.patch | xargs -n1 basename | sed 's/\.patch$//')
for name in "${names[@]}"; do
  rm -rf "ab/$name" && mkdir -p "ab/$name"
  git archive HEAD common impl_triton impl_ninetoothed tests tools pyproject.toml | tar -x -C "ab/$name"
  git apply --directory="ab/$name" "tools/ab/$name.patch"
  echo "ab/$name"
done
