#!/usr/bin/env bash
# The peer comparison (BENCHMARKS.md): our worker against the Camunda 7 external task client on
# the same real engine and the same scripted model, rounds interleaved (worker, Camunda client
# sequential, Camunda client as several clients) so that the machine's load falls on all three
# alike; prints every run and the medians per side.
#
#   bench/peer-comparison.sh ENGINE_URL ENGINE_PID STORE_ADMIN_URL MODEL_MS [TASKS] [ROUNDS]
#
# Before: the engine started outside this repository (docs/REAL_ENGINE.md);
# `cargo build --release --bin abada-agent-worker --example engine_bench --example camunda_bridge`;
# `(cd bench/camunda-peer && mvn -q package)`; a PostgreSQL admin URL for the worker's run store
# (`eval "$(scripts/test-postgres start)"` gives ABADA_TEST_DATABASE_URL). JAVA selects the
# launcher of the Camunda client (default: java on PATH).
set -euo pipefail
if [ $# -lt 4 ]; then
  sed -n '2,14p' "$0" >&2
  exit 2
fi
engine_url=$1 engine_pid=$2 store=$3 model_ms=$4 tasks=${5:-200} rounds=${6:-3}
cd "$(dirname "$0")/.."
bench=target/release/examples/engine_bench
common=(--engine-url "$engine_url" --engine-pid "$engine_pid" --slots 8 --tasks "$tasks"
        --model-latency-ms "$model_ms")
out=$(mktemp -d)
for r in $(seq 1 "$rounds"); do
  echo "== round $r: worker" >&2
  "$bench" "${common[@]}" --workers 1 --store-admin-url "$store" | tee -a "$out/worker"
  echo "== round $r: camunda sequential" >&2
  "$bench" "${common[@]}" --peer camunda --camunda-mode sequential --java "${JAVA:-java}" \
    | tee -a "$out/camunda-sequential"
  echo "== round $r: camunda clients" >&2
  "$bench" "${common[@]}" --peer camunda --camunda-mode clients --java "${JAVA:-java}" \
    | tee -a "$out/camunda-clients"
done
for side in worker camunda-sequential camunda-clients; do
  echo "medians of $rounds runs: $side"
  awk '$2 == "=" { v[$1] = v[$1] " " $3 }
       END { for (k in v) print k, v[k] }' "$out/$side" | sort | while read -r key values; do
    printf '  %s = %s   (runs:%s)\n' "$key" \
      "$(tr ' ' '\n' <<<"$values" | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {
         if (NR % 2) print a[(NR+1)/2]; else print (a[NR/2] + a[NR/2+1]) / 2 }')" " $values"
  done
done
rm -rf "$out"
