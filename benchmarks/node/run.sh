#!/usr/bin/env bash
# Run the scaling benchmarks on the many-core machine (no network), from the repository root, with
# what benchmarks/node/pack.sh carried: a venv over the system Python (it has torch), the carried
# wheels, pyfuse3 built against the carried libfuse3 (if that fails the native engine runs alone),
# then scale (1..N concurrent torch.save savers, both engines, vs /dev/shm) and restore (1 and 4
# readers vs ext4 cold), then threadcpu (8 savers: the daemon's CPU by thread, WRITE pieces adopted
# and copied) and passthrough (READ replies vs FUSE passthrough, staging into a memfd). Results go
# to $OUT (or benchmarks/results/node/).
#
#   bash benchmarks/node/run.sh [full|quick|setup]       CARRY=benchmarks/node/carry OUT=/somewhere
set -euo pipefail
root=$(pwd)
carry=${CARRY:-$root/benchmarks/node/carry}
out=${OUT:-$root/benchmarks/results/node}
venv=${VENV:-/tmp/ckptfs-node-venv}
mode=${1:-full}
mkdir -p "$out"
python3 -m venv --system-site-packages "$venv"
pip=("$venv/bin/pip" install -q --no-index --find-links "$carry/wheels")
"${pip[@]}" trio crc32c boto3 setuptools wheel
engines=native
lib=$carry/libfuse/root/usr/lib/x86_64-linux-gnu
if [ -d "$lib" ]; then
    # pkg-config answers for the carried libfuse3 (the machine may have no pkg-config, or no .pc)
    shim=$venv/shim && mkdir -p "$shim"
    cat > "$shim/pkg-config" <<SHIM
#!/bin/sh
case "\$*" in
  *--modversion*) echo 3.14.0 ;;
  *--atleast-version*) exit 0 ;;
  *--cflags*) echo "-I$carry/libfuse/root/usr/include/fuse3 -D_FILE_OFFSET_BITS=64" ;;
  *--libs*) echo "-L$lib -Wl,-rpath,$lib -lfuse3 -lpthread" ;;
esac
SHIM
    chmod +x "$shim/pkg-config"
    [ -e "$lib/libfuse3.so" ] || ln -sf libfuse3.so.3 "$lib/libfuse3.so"
    if PATH=$shim:$PATH "${pip[@]}" --no-build-isolation "$carry"/sdist/pyfuse3-*.tar.gz >"$out/pyfuse3-build.log" 2>&1 \
        && "$venv/bin/python" -c "import pyfuse3"; then
        engines=pyfuse3,native
    else
        echo "pyfuse3 did not build (see $out/pyfuse3-build.log): the native engine runs alone"
    fi
fi
"${pip[@]}" --no-deps --no-build-isolation -e "$root"
export PATH=$venv/bin:$PATH CKPTFS_BENCH_RESULTS=$out
python -c "import ckptfs.daemon, trio, crc32c" && echo "ckptfs ready, engines: $engines"
[ "$mode" = setup ] && exit 0
cores=$(nproc)
writers=1,2,4,8; [ "$cores" -ge 16 ] && writers=1,2,4,8,16
if [ "$mode" = quick ]; then
    scale=(--writers 1,8 --per-writer 256M --repeats 1)
    restore=(--size 512M --repeats 1)
else
    scale=(--writers "$writers" --per-writer 1G --repeats 2)
    restore=(--size 1G --repeats 2)
fi
python benchmarks/scale.py --parts absorb --saver torch --engines "$engines" "${scale[@]}" 2>&1 | tee "$out/scale.log"
python benchmarks/restore.py --readers 1,4 --engines "$engines" "${restore[@]}" 2>&1 | tee "$out/restore.log"
# where the native engine's CPU goes with 8 ranks saving at once, and how many WRITE pieces it copied
# (docs/ENGINE.md "Not done yet": concurrent writers)
python benchmarks/probes/threadcpu.py --tensor-mib 64.5 --tensors 4 --saves 2 --writers 8 --memory 8G 2>&1 \
    | tee "$out/threadcpu.log" || true
# FUSE passthrough vs READ replies for data in memory, and the price of staging a file into a memfd
# (docs/ENGINE.md "Not done yet": passthrough)
python benchmarks/probes/passthrough.py --size 1G --readers 8 --threads "$cores" --repeats 2 2>&1 \
    | tee "$out/passthrough.log" || true
# the round trip over /dev/fuse against FUSE over io_uring, callers and queue threads on one CPU and not
# (docs/ENGINE.md "Not done yet": FUSE over io_uring)
for placement in "" "--pin" "--client-cpu 1" "--client-cpu 1 --pin"; do
    read -r -a opts <<< "$placement"
    python benchmarks/probes/uringfloor.py --n 5000 --rounds 4 "${opts[@]}" 2>&1 | tee -a "$out/uringfloor.log" || true
done
python benchmarks/report.py >/dev/null 2>&1 || true
