#!/usr/bin/env bash
# Runs on the GPU machine after scripts/gpu-run.sh has unpacked the bundle: Nsight Compute's view of the
# tensor-core decode product, one launch at 1 token and one at 64 tokens on 4096 x 14336, for each format
# named (default BF16 Q4_K). Writes $OUT/ncu-FORMAT.txt and prints the lines that say where time goes,
# then the instruction mix of each format's 1-token kernels (streamed and staged) from the library's SASS.
set -uo pipefail
B=/tmp/he/bundle
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats"
for f in "${@:-BF16 Q4_K}"; do
  # Each timed case is 3 warm-up launches and 7 x 50 timed ones: skip 3, then the 64-token case's first.
  for skip in 3 356; do
    ncu --clock-control none --kernel-name regex:"mmvq?_kernel" --launch-skip "$skip" --launch-count 1 $sections \
      "$B/examples/bench_decode" --kernels-only --no-matvec --mmv-only "$f" >> "$OUT/ncu-$f.txt" 2>&1
  done
  echo "== $f"
  grep -E "mmvq?_kernel|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Stall" "$OUT/ncu-$f.txt" | head -40
done
cuobjdump -sass "$B/libhostembed.so" > /tmp/he/mmv-sass.txt 2>/dev/null
python3 - /tmp/he/mmv-sass.txt ${@:-BF16 Q4_K} <<'PY'
import collections, re, sys
text = open(sys.argv[1]).read()
names = {"BF16": "MmaBF16"}
for f in sys.argv[2:]:
    reader = names.get(f, "Q" + f)
    for staged in "01":
        # One token a launch, no GLU: Li1ELb0ELb<staged>.
        pat = re.compile(r"Function : (\S*mmvq?_kernelINS_\d+%sELi1ELb0ELb%sE\S*)\n(.*?)(?=\n\s*Function :|\Z)" % (reader, staged), re.S)
        for m in pat.finditer(text):
            ops = collections.Counter(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", m.group(2)))
            print(f, "staged" if staged == "1" else "streamed", sum(ops.values()), "instructions:",
                  " ".join(f"{k} {v}" for k, v in ops.most_common(24)))
PY
