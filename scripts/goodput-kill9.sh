#!/usr/bin/env bash
# The default job (`prime-train run`, its embedded config) with one kill -9: the trainer is SIGKILLed once the
# step-AT checkpoint exists, the supervisor resumes it, and the run's closing lines give its goodput (productive
# time of the wall time, and where the rest went). Issue 35's goodput figure; scripts/gpu-check.sh part "goodput".
#
#   bash scripts/goodput-kill9.sh [DIR] [AT]      # DIR: a new directory (default: a fresh one under /tmp); AT 100
set -u
dir=${1:-$(mktemp -d /tmp/pt-goodput.XXXXXX)}
at=${2:-100}
# never emptied or removed here: a directory that holds anything is refused
if [[ -e $dir && -n $(ls -A "$dir" 2>/dev/null) ]]; then
  echo "$dir is not empty: give a new directory" >&2
  exit 78
fi
mkdir -p "$dir" || exit 78
run="$dir/default"
python3 -m prime_train run --run.output_dir "$dir" --run.name default &
sup=$!
until [[ -d $run/checkpoints/step-$at ]]; do
  kill -0 "$sup" 2>/dev/null || { echo "the run ended before its step-$at checkpoint"; wait "$sup"; exit 1; }
  sleep 0.2
done
trainer=$(python3 - "$run/events.jsonl" <<'PY'
import json, sys
events = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print([e["pid"] for e in events if e.get("event") == "process_started" and e.get("process") == "trainer"][-1])
PY
)
kill -9 "$trainer" && echo "== killed the trainer (pid $trainer) once checkpoints/step-$at existed"
wait "$sup"
rc=$?
echo "== run exit: $rc"
python3 -m prime_train status "$run" 2>&1 | grep -i -E "goodput|step|restart|attempt" | head -20
exit "$rc"
