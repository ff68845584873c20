#!/usr/bin/env bash
# One command of the GPU plan on a lent GPU machine (benchmarks/gpu_plan.py says what each measures), as the device
# tool runs it from the repository root with .whl carried (make gpu-wheels):
#
#     bash benchmarks/gpu_plan.sh profile|serve|reliability|qwen21 [--budget-s S]
#
# Installs the carried wheels (.whl/profile or .whl/serve, whichever came) into /tmp/site, checking their hashes and
# versions, then runs the command with its JSON and log under $OUT.
set -uo pipefail
started=$(date +%s.%N)  # the command's limits count from here, the install included
command=${1:?which command: profile, serve, reliability or qwen21}
shift
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
OUT=${OUT:-/tmp/gpu-plan}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
for bundle in "${GPU_PLAN_WHEELS:-.whl}"/*/; do
	[ -f "$bundle/part-01/wheelhouse.py" ] || continue
	"$PYTHON" "$bundle/part-01/wheelhouse.py" install "$bundle" --target /tmp/site --ignore-requires-python \
		> "$OUT/install.log" 2>&1 || { tail -40 "$OUT/install.log"; exit 1; }
	export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
done
# The replicas Ray starts import omni_ray and deployments from here (they inherit this environment).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PYTHON" -m benchmarks.gpu_plan "$command" --out "$OUT" --started-at "$started" "$@" 2>&1 | tee "$OUT/$command.log"
