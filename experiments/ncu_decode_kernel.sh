# Nsight Compute on two decode launches at one token (fused gate/up and q/k/v of an 8B model),
# lut lookup, dispatch's configuration: ncu's details and SASS pages in $OUT, summarised by
# experiments/ncu_sass_summary.py. Session 28's call 2 ran it at cbf6b3d (a 16-token tile);
# later trees dispatch one token as blocks_as_columns.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:.
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for shape in "4096 28672 1" "4096 6144 1"; do
  set -- $shape
  tag=$2
  $NCU --clock-control none --kernel-name regex:mosaic --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section SourceCounters \
    --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
    -o /tmp/rep$tag python experiments/one_nf4_call.py $1 $2 $3 lut > /tmp/ncu$tag.log 2>&1 || { tail -20 /tmp/ncu$tag.log; exit 1; }
  $NCU -i /tmp/rep$tag.ncu-rep --page details > $OUT/details$tag.txt
  $NCU -i /tmp/rep$tag.ncu-rep --page source --print-source sass --csv > $OUT/sass$tag.csv
  echo "== $shape"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|Stall|Registers Per|Shared Memory Config|Dynamic Shared|Grid Size|Block Size|L2 Hit|Mem Pipes|Warp Cycles Per Issued" $OUT/details$tag.txt | head -40
  python3 experiments/ncu_sass_summary.py $OUT/sass$tag.csv $(( $1 * $2 )) | head -60
done
