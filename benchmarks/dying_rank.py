"""How long the other processes of a `dsv3 train` take to stop when one dies or hangs: a 4-process torchrun
(`--ep 4 --dp-shard fsdp`, the nano preset on this repository's sources) whose rank 2 gets SIGKILL (it dies)
or SIGSTOP (it hangs, which torchrun cannot see; `--dist-timeout` bounds it) after its third step.

    .venv/bin/python benchmarks/dying_rank.py --json      # both cases, about 3 minutes on 2 cores

Prints per case: seconds from the signal to the first survivor's `error:` line and to torchrun's exit, the
survivors' error lines and torchrun's exit status."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from dsv3.testing.launch import rank_pid, train_steps_done

CASES = {"SIGKILL": [], "SIGSTOP": ["--dist-timeout", "10"]}




def run_case(sig: str, flags: list[str], out: Path, data: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "dsv3",
           "train", "--preset", "nano", "--data", data, "--out", str(out), "--device", "cpu", "--steps", "1000",
           "--batch-size", "4", "--seq-len", "128", "--log-every", "1", "--save-every", "1000", "--ep", "4",
           "--gpus-per-node", "2", "--dp-shard", "fsdp", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), ln.rstrip()) for ln in proc.stderr))
    reader.start()
    try:
        while train_steps_done(out) < 3:
            if proc.poll() is not None:
                sys.exit(f"error: the run ended before its third step:\n{lines[-20:]}")
            time.sleep(0.2)
        os.kill(rank_pid(out, 2), getattr(signal, sig))
        sent = time.monotonic()
        proc.wait(timeout=600)
        ended = time.monotonic()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join()
    errors = [(t, ln) for t, ln in lines if ln.startswith("error: ")]
    return {"signal": sig, "flags": flags, "first_error_s": round(errors[0][0] - sent, 1) if errors else None,
            "torchrun_exit_s": round(ended - sent, 1), "exit_status": proc.returncode,
            "errors": [ln for _, ln in errors]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[1] / "src" / "dsv3"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_case(sig, flags, Path(tmp) / sig, args.data) for sig, flags in CASES.items()]
    if args.json:
        print(json.dumps(results))
        return
    for r in results:
        print(f"{r['signal']}: first error line {r['first_error_s']} s after the signal, torchrun exit "
              f"{r['torchrun_exit_s']} s (status {r['exit_status']}); {len(r['errors'])} error lines")


if __name__ == "__main__":
    main()
