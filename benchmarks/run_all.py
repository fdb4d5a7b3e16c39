"""Run every benchmark and print their tables (`make bench`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

for script in ("bench_per_sample.py", "bench_engine_vs_flower.py", "bench_engine_modes.py",
               "bench_least_squares.py", "bench_fixed_features.py", "bench_projected.py",
               "bench_deployment.py"):
    print(f"## {script}\n", flush=True)
    subprocess.run([sys.executable, str(HERE / script)], check=True)
    print(flush=True)
