#!/usr/bin/env bash
# Downloads the wheels the lent GPU machine lacks (scripts/gpu/wheels.txt: pinned, no dependencies resolved here;
# tests/test_gpu_wheels.py checks the set is closed) into .gpu_wheels/ (git-ignored), for Python 3.12 on x86-64
# Linux. Run it in the checkout the device tool sends, then name the folder in the call's carry:
#   bash scripts/gpu_wheels.sh && run(command="bash scripts/gpu_check.sh", carry=[".gpu_wheels"])
# Fails, keeping the previous folder, when a download fails or the set is over 60 MiB (a call carries 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.gpu_wheels
LIMIT=$((60 * 1024 * 1024))
mapfile -t SPECS < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' scripts/gpu/wheels.txt | awk '{print $1}')
TMP="$DEST.tmp$$"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP"
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$TMP" "${SPECS[@]}"
count=$(find "$TMP" -name '*.whl' | wc -l)
if [ "$count" -ne "${#SPECS[@]}" ]; then
  echo "gpu_wheels: ${#SPECS[@]} pinned names but $count wheels in $TMP" >&2
  exit 1
fi
size=$(find "$TMP" -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s}')
if [ "$size" -ge "$LIMIT" ]; then
  echo "gpu_wheels: $((size / 1024 / 1024)) MiB of wheels, over the 60 MiB a device call can spare" >&2
  exit 1
fi
rm -rf "$DEST"
mv "$TMP" "$DEST"
ls -l "$DEST"
awk -v s="$size" -v n="$count" 'BEGIN {printf "gpu_wheels: %d wheels, %.1f MiB in .gpu_wheels/\n", n, s / 1048576}'
