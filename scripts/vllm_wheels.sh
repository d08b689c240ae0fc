#!/usr/bin/env bash
# Prepares vLLM's wheels for the GPU machine, which has no registry and takes at most 64 MiB per device call
# (the working tree included). Run it here, in the root of the checkout that the device calls send:
#
#   bash scripts/vllm_wheels.sh          # download (if missing), verify, slim vllm, split, batch
#
# 1. downloads every `pypi` wheel of scripts/vllm_wheels.lock into .whl/vllm-dl/ (Python 3.12, manylinux
#    x86_64, --no-deps) and checks its size and sha256 against the lock;
# 2. SLIM=1 (default): makes the slim vllm wheel (`zip -d` of the members listed in SLIM_DROP below) and
#    checks it against the lock's `slim` line; SLIM=0 sends the registry's 304 MB wheel instead;
# 2b. FA2=1: adds vLLM's FlashAttention-2 library (the `fa2` line of the lock), which the slim wheel drops and
#    vLLM 0.26's TurboQuant caches need (vLLM forces FA2 for them), taken from the registry's wheel and
#    xz-compressed (docs/vllm-device.md gives its sizes): two more batches;
# 3. splits every file over PIECE_BYTES (default 36000000) with `split -b` into FILE.part-00, -01, ...;
# 4. packs the files and pieces into batches of at most BATCH_BYTES (default 44 MiB, so that a batch plus
#    the working tree stays under the 64 MiB per call) as .whl/vllm/b1, b2, ..., each with the manifest SET
#    (file, sha256, size, pieces of the whole set), and prints the folder to name in `carry` for each.
#
# On the GPU machine, one call per batch (scripts/vllm_device_install.sh reassembles, verifies, installs):
#   run(command="bash scripts/vllm_device_install.sh .whl/vllm/b1", carry=[".whl/vllm/b1"])
#
# Environment: LOCK, DL_DIR, OUT_DIR (defaults above), OFFLINE=1 (never download: fail on a missing or
# wrong file), PYTHON (the pip to download with).
set -euo pipefail
cd "$(dirname "$0")/.."
LOCK=${LOCK:-scripts/vllm_wheels.lock}
DL=${DL_DIR:-.whl/vllm-dl}
OUT=${OUT_DIR:-.whl/vllm}
SLIM=${SLIM:-1}
PIECE=${PIECE_BYTES:-36000000}
BATCH=${BATCH_BYTES:-46137344}
PY=${PYTHON:-python3}
# Members of the vllm wheel left out by SLIM=1, none of which the one-GPU runs of this project load:
# the FlashAttention-2 library (on Hopper vLLM picks FA3, _vllm_fa3_C, which stays), the MoE kernels (dense
# models only; vLLM imports them inside contextlib.suppress(ImportError)), the Rust frontend binary (used
# only with VLLM_RUST_FRONTEND_PATH), and DeepGEMM / the SM100 FMHA sources (block-fp8 GEMMs, Blackwell).
SLIM_DROP=('vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/_moe_C_stable_libtorch.abi3.so' 'vllm/vllm-rs'
           'vllm/third_party/deep_gemm/*' 'vllm/third_party/fmha_sm100/*')
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)
die() { echo "vllm_wheels: $*" >&2; exit 1; }
sha() { sha256sum "$1" | cut -d' ' -f1; }
lock_lines() { grep -v '^[[:space:]]*#' "$LOCK" | grep -v '^[[:space:]]*$'; }
[ -f "$LOCK" ] || die "no lock file $LOCK"
mkdir -p "$DL"

# 1. the registry's wheels, each checked against the lock
sendlist=()   # "file<TAB>path<TAB>sha" of what travels
while read -r name ver size sum file src; do
  [ "$src" = pypi ] || continue
  f=$DL/$file
  if [ ! -f "$f" ] || [ "$(stat -c %s "$f")" != "$size" ] || [ "$(sha "$f")" != "$sum" ]; then
    [ "${OFFLINE:-0}" = 1 ] && die "$f missing or not the locked file (OFFLINE=1: no download)"
    echo "vllm_wheels: downloading $name==$ver" >&2
    "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$DL" "$name==$ver" >&2
    [ -f "$f" ] || die "pip saved no $file for $name==$ver (see $LOCK)"
  fi
  [ "$(sha "$f")" = "$sum" ] || die "$file: sha256 $(sha "$f") is not the lock's $sum"
  [ "$name" = vllm ] && vllm_wheel=$f
  if [ "$name" = vllm ] && [ "$SLIM" = 1 ]; then continue; fi
  sendlist+=("$file"$'\t'"$f"$'\t'"$sum")
done < <(lock_lines)

# 2. the slim vllm wheel
if [ "$SLIM" = 1 ]; then
  read -r _ _ ssize ssum sfile _ < <(lock_lines | awk '$1 == "vllm" && $6 == "slim"') || die "no slim vllm line in $LOCK"
  mkdir -p "$DL/slim"
  s=$DL/slim/$sfile
  if [ ! -f "$s" ] || [ "$(sha "$s")" != "$ssum" ]; then
    cp "$DL/$sfile" "$s.tmp"
    zip -q -d "$s.tmp" "${SLIM_DROP[@]}" >/dev/null
    mv "$s.tmp" "$s"
  fi
  [ "$(sha "$s")" = "$ssum" ] || die "slim $sfile: sha256 $(sha "$s") is not the lock's $ssum (another zip?); SLIM=0 sends the registry's wheel"
  sendlist+=("$sfile"$'\t'"$s"$'\t'"$ssum")
fi

# 2b. the FlashAttention-2 library, compressed (checked against the lock before; after, on the device)
if [ "${FA2:-0}" = 1 ]; then
  read -r _ _ _ fsum ffile _ < <(lock_lines | awk '$6 == "fa2"') || die "no fa2 line in $LOCK"
  [ -n "${vllm_wheel:-}" ] || die "FA2=1 needs the registry's vllm wheel (its pypi line in $LOCK)"
  mkdir -p "$DL/fa2"
  so=$DL/fa2/$ffile
  if [ ! -f "$so" ] || [ "$(sha "$so")" != "$fsum" ]; then
    unzip -p "$vllm_wheel" "vllm/vllm_flash_attn/$ffile" > "$so.tmp" || die "no vllm/vllm_flash_attn/$ffile in $vllm_wheel"
    mv "$so.tmp" "$so"
  fi
  [ "$(sha "$so")" = "$fsum" ] || die "$ffile: sha256 $(sha "$so") is not the lock's $fsum"
  if [ ! -f "$so.xz" ] || [ "$(cat "$so.xz.of" 2>/dev/null)" != "$fsum" ]; then
    echo "vllm_wheels: compressing $ffile (once: the .xz is kept in $DL/fa2)" >&2
    xz -T2 -6 -c "$so" > "$so.xz.tmp" && mv "$so.xz.tmp" "$so.xz" && echo "$fsum" > "$so.xz.of"
  fi
  sendlist+=("$ffile.xz"$'\t'"$so.xz"$'\t'"$(sha "$so.xz")")
fi

# 3. split, 4. batch
rm -rf "$OUT"; mkdir -p "$OUT/.stage"
: > "$OUT/.stage/SET"
for entry in "${sendlist[@]}"; do
  IFS=$'\t' read -r file path sum <<< "$entry"
  size=$(stat -c %s "$path")
  if [ "$size" -gt "$PIECE" ]; then
    split -b "$PIECE" -d -a 2 "$path" "$OUT/.stage/$file.part-"
    n=$(ls "$OUT/.stage/$file".part-* | wc -l)
  else
    ln "$path" "$OUT/.stage/$file" 2>/dev/null || cp "$path" "$OUT/.stage/$file"
    n=0
  fi
  printf '%s %s %s %s\n' "$file" "$sum" "$size" "$n" >> "$OUT/.stage/SET"
done
"$PY" - "$OUT" "$BATCH" <<'EOF'
import os, sys
out, cap = sys.argv[1], int(sys.argv[2])
stage = os.path.join(out, ".stage")
setfile = os.path.join(stage, "SET")
room = cap - os.path.getsize(setfile)
items = sorted(((os.path.getsize(os.path.join(stage, f)), f) for f in os.listdir(stage) if f != "SET"), reverse=True)
batches = []  # first fit, largest first
for size, f in items:
    if size > room:
        sys.exit(f"vllm_wheels: {f} ({size} bytes) does not fit a batch of {cap} bytes; lower PIECE_BYTES")
    for b in batches:
        if b[0] + size <= room:
            b[0] += size; b[1].append(f); break
    else:
        batches.append([size, [f]])
for i, (_, files) in enumerate(batches, 1):
    d = os.path.join(out, f"b{i}")
    os.makedirs(d)
    for f in files:
        os.rename(os.path.join(stage, f), os.path.join(d, f))
    with open(setfile) as src, open(os.path.join(d, "SET"), "w") as dst:
        dst.write(src.read())
os.remove(setfile); os.rmdir(stage)
EOF
tree=$(git ls-files -co --exclude-standard -z 2>/dev/null | xargs -0 -r stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
nb=$(ls -d "$OUT"/b* | wc -l)
echo "vllm_wheels: $nb batches (working tree that travels with each: $((tree / 1048576)) MiB)"
for d in $(ls -d "$OUT"/b* | sort -V); do
  bs=$(du -cb "$d"/* | tail -1 | cut -f1)
  warn=""; [ $((bs + tree)) -ge 67108864 ] && warn="  WARNING: with the working tree over 64 MiB"
  echo "carry: $d  ($((bs / 1048576)) MiB, $(ls "$d" | wc -l) files)$warn"
done
