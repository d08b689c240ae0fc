#!/usr/bin/env bash
# Runs on the GPU machine: installs vLLM from the batches that scripts/vllm_wheels.sh made, one device call
# per batch (each names its batch in `carry`):
#
#   bash scripts/vllm_device_install.sh .whl/vllm/b1      # call 1: copies b1 to ~/vllmwhl
#   bash scripts/vllm_device_install.sh .whl/vllm/b2      # call 2: appends b2 ... and so on
#
# Every call copies its batches into $VLLM_WHL_DIR (default ~/vllmwhl, outside the working tree, so it
# survives the next call's fresh tree) and counts what the manifest SET still lacks. The call that completes
# the set `cat`s the split pieces back, verifies each wheel's size and sha256 against SET and against the
# committed scripts/vllm_wheels.lock, installs them with `pip install --no-index --no-deps --target
# $VLLM_SITE` (default ~/site), puts a compressed library of the set (`FILE.xz`, FA2=1 of vllm_wheels.sh)
# into vllm's package after checking it against the lock's line for FILE, and runs the import check
# (scripts/vllm_import_check.py). A later call with the set installed only runs the check. Use it with: export PYTHONPATH=$VLLM_SITE:$PWD
#
# Environment: VLLM_WHL_DIR, VLLM_SITE, LOCK (default scripts/vllm_wheels.lock), PYTHON (default python3),
# IMPORT_CHECK (the command run after the install; default the vLLM import check).
set -euo pipefail
cd "$(dirname "$0")/.."
W=${VLLM_WHL_DIR:-$HOME/vllmwhl}
SITE=${VLLM_SITE:-$HOME/site}
LOCK=${LOCK:-scripts/vllm_wheels.lock}
PY=${PYTHON:-python3}
CHECK=${IMPORT_CHECK:-"$PY scripts/vllm_import_check.py"}
die() { echo "vllm_device_install: $*" >&2; exit 1; }
sha() { sha256sum "$1" | cut -d' ' -f1; }
mkdir -p "$W"
for d in "$@"; do
  [ -d "$d" ] || die "no batch folder $d (name it in carry)"
  cp -f "$d"/* "$W"/
  echo "vllm_device_install: copied $(ls "$d" | wc -l) files of $d to $W"
done
[ -f "$W/SET" ] || die "no SET manifest in $W: copy a batch first"

if [ -f "$SITE/.vllm_set" ] && cmp -s "$SITE/.vllm_set" "$W/SET"; then
  echo "vllm_device_install: this set is already installed in $SITE"
  PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH} $CHECK
  exit
fi

missing=0
while read -r file sum size n; do
  [ -f "$W/$file" ] && continue
  if [ "$n" -gt 0 ]; then
    for i in $(seq 0 $((n - 1))); do
      p=$(printf '%s.part-%02d' "$file" "$i")
      [ -f "$W/$p" ] || { echo "  missing $p"; missing=$((missing + 1)); }
    done
  else
    echo "  missing $file"; missing=$((missing + 1))
  fi
done < "$W/SET"
if [ "$missing" -gt 0 ]; then
  echo "vllm_device_install: $missing files still to come (carry the next batch)"
  exit 0
fi

while read -r file sum size n; do
  if [ "$n" -gt 0 ] && [ ! -f "$W/$file" ]; then
    parts=()
    for i in $(seq 0 $((n - 1))); do parts+=("$W/$(printf '%s.part-%02d' "$file" "$i")"); done
    cat "${parts[@]}" > "$W/$file.tmp" && mv "$W/$file.tmp" "$W/$file" && rm -f "${parts[@]}"
  fi
  [ "$(stat -c %s "$W/$file")" = "$size" ] || die "$file: $(stat -c %s "$W/$file") bytes, SET says $size"
  got=$(sha "$W/$file")
  [ "$got" = "$sum" ] || die "$file: sha256 $got, SET says $sum"
  case $file in *.xz) continue ;; esac  # a compressed library: the lock holds its content's sha256 (below)
  awk -v f="$file" -v s="$sum" '!/^[[:space:]]*#/ && $5 == f && $4 == s {ok=1} END {exit !ok}' "$LOCK" \
    || die "$file (sha256 $sum) is not in $LOCK"
done < "$W/SET"
echo "vllm_device_install: $(wc -l < "$W/SET") wheels verified against SET and $LOCK"

rm -rf "$SITE"; mkdir -p "$SITE"
files=()
libs=()
while read -r file _; do case $file in *.xz) libs+=("$file") ;; *) files+=("$W/$file") ;; esac; done < "$W/SET"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${files[@]}"
for x in ${libs[@]+"${libs[@]}"}; do  # e.g. FlashAttention-2 for TurboQuant: into vllm/vllm_flash_attn/
  lib=${x%.xz}
  read -r _ _ _ lsum _ < <(awk -v f="$lib" '!/^[[:space:]]*#/ && $5 == f && $6 == "fa2"' "$LOCK") \
    || die "$lib is not in $LOCK"
  dest=$SITE/vllm/vllm_flash_attn/$lib
  mkdir -p "$(dirname "$dest")"
  "$PY" -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$W/$x" "$dest.tmp"
  [ "$(sha "$dest.tmp")" = "$lsum" ] || { rm -f "$dest.tmp"; die "$lib: sha256 after xz is not the lock's $lsum"; }
  mv "$dest.tmp" "$dest"; chmod 755 "$dest"
  echo "vllm_device_install: $lib into $(dirname "$dest")"
done
cp "$W/SET" "$SITE/.vllm_set"
echo "vllm_device_install: installed into $SITE"
PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH} $CHECK
