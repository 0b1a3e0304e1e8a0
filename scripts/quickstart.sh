#!/usr/bin/env bash
# The main job: set up from this repository, train the default (nano) V3 model on the Python standard
# library for a few minutes on the CPU, then generate a sample from the trained checkpoint.
#
#   scripts/quickstart.sh                 # RUN=runs/quickstart STEPS=300 THREADS=1 by default
#   RUN=runs/mine STEPS=800 THREADS=2 scripts/quickstart.sh
#
# Running it again continues (or just reports) the same run: `dsv3 train --resume`; a run stopped before
# its first checkpoint starts afresh. Ctrl-C stops training after the current step and saves a checkpoint.
# THREADS=1: this 3M-parameter model gains little from a second thread, and two threads on two busy cores
# collapse (measured 4,800 -> 200 tokens/s whenever another process wanted a core); one thread is steady.
set -euo pipefail
cd "$(dirname "$0")/.."

RUN=${RUN:-runs/quickstart}
STEPS=${STEPS:-300}
THREADS=${THREADS:-1}
EXTRA_TRAIN_ARGS=${EXTRA_TRAIN_ARGS:-}  # more `dsv3 train` options (the tests pass a tiny model and corpus)
PY=.venv/bin/python

if [ ! -x "$PY" ]; then
    echo "== setting up .venv" >&2
    python3 -m venv .venv
    .venv/bin/pip install -c constraints.txt -e ".[test]"
fi

# The step of the run's newest checkpoint (RUN/checkpoints/step-NNNNNN), empty when it has none.
saved_step() {
    local newest
    newest=$(ls "$RUN/checkpoints" 2>/dev/null | grep -E '^step-[0-9]+$' | sort | tail -n 1 || true)
    [ -n "$newest" ] && echo $((10#${newest#step-}))
    return 0
}

trap 'rm -f "$RUN.summary.json.tmp"' EXIT
# `dsv3 train` prints the outcome on stderr (or, stopped early, where its last checkpoint is); the JSON
# summary is written beside the run folder only when the command ends normally.
if [ -f "$RUN/run.json" ]; then  # a run folder with no complete checkpoint yet is started afresh
    step=$(saved_step)
    if [ -z "$step" ]; then
        echo "== training afresh (the run stopped before its first checkpoint): dsv3 train --resume $RUN" >&2
    elif [ "$step" -ge "$STEPS" ]; then
        echo "== $RUN is trained to step $step already: dsv3 train --resume $RUN reports it" >&2
    else
        echo "== resuming $RUN from step $step to $STEPS: dsv3 train --resume $RUN --steps $STEPS" >&2
    fi
    "$PY" -m dsv3 train --resume "$RUN" --steps "$STEPS" --threads "$THREADS" $EXTRA_TRAIN_ARGS \
        --json > "$RUN.summary.json.tmp"
else
    echo "== training: dsv3 train --preset nano --steps $STEPS --out $RUN" >&2
    mkdir -p "$(dirname "$RUN")"
    "$PY" -m dsv3 train --preset nano --steps "$STEPS" --batch-size 16 --seq-len 256 --lr 2e-3 \
        --eval-every 100 --save-every 100 --log-every 25 --threads "$THREADS" --out "$RUN" \
        $EXTRA_TRAIN_ARGS --json > "$RUN.summary.json.tmp"
fi
mv "$RUN.summary.json.tmp" "$RUN.summary.json"
if ! grep -q '"stopped": "completed"' "$RUN.summary.json"; then  # Ctrl-C or SIGTERM: it saved and said where
    echo "== training stopped before step $STEPS; run scripts/quickstart.sh again to continue" >&2
    exit 130
fi

echo "== sample from $RUN/latest" >&2
"$PY" -m dsv3 generate --model "$RUN/latest" --prompt "def" --max-new-tokens 120 --temperature 0.8 --top-k 40 \
    --seed 0
