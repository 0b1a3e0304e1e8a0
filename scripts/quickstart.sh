#!/usr/bin/env bash
# The main job: set up from this repository, train the default (nano) V3 model on the Python standard
# library for a few minutes on the CPU, then generate a sample from the trained checkpoint.
#
#   scripts/quickstart.sh                 # RUN=runs/quickstart STEPS=300 THREADS=1 by default
#   RUN=runs/mine STEPS=800 THREADS=2 scripts/quickstart.sh
#
# Running it again continues (or just reports) the same run: `dsv3 train --resume`.
# THREADS=1: this 3M-parameter model gains little from a second thread, and two threads on two busy cores
# collapse (measured 4,800 -> 200 tokens/s whenever another process wanted a core); one thread is steady.
set -euo pipefail
cd "$(dirname "$0")/.."

RUN=${RUN:-runs/quickstart}
STEPS=${STEPS:-300}
THREADS=${THREADS:-1}
PY=.venv/bin/python

if [ ! -x "$PY" ]; then
    echo "== setting up .venv" >&2
    python3 -m venv .venv
    .venv/bin/pip install -c constraints.txt -e ".[test]"
fi

echo "== training: dsv3 train --preset nano --steps $STEPS --out $RUN" >&2
if [ -f "$RUN/run.json" ]; then
    "$PY" -m dsv3 train --resume "$RUN" --steps "$STEPS" --threads "$THREADS" --json > "$RUN.summary.json"
else
    mkdir -p "$(dirname "$RUN")"
    "$PY" -m dsv3 train --preset nano --steps "$STEPS" --batch-size 16 --seq-len 256 --lr 2e-3 \
        --eval-every 100 --save-every 100 --log-every 25 --threads "$THREADS" --out "$RUN" \
        --json > "$RUN.summary.json"
fi
"$PY" - "$RUN.summary.json" <<'PYEOF'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"== {s['step']} steps, {s['tokens']:,} tokens at {s['tokens_per_s']:,.0f} tokens/s: train loss "
      f"{s['first_loss']:.3f} -> {s['final_loss']:.3f}; held-out {s['val_loss']:.3f} nats/token = "
      f"{s['val_bpb']:.3f} bits/byte", file=sys.stderr)
PYEOF

echo "== sample from $RUN/latest" >&2
if "$PY" -m dsv3 generate --help > /dev/null 2>&1; then
    "$PY" -m dsv3 generate --model "$RUN/latest" --prompt "def" --max-new-tokens 120 \
        --temperature 0.8 --top-k 40 --seed 0
else
    "$PY" -m dsv3.train.sample "$RUN/latest" --prompt "def" --max-new-tokens 120
fi
