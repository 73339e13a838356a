"""What the memory picture costs: matplotlib's import, the first picture and the next ones.

Each measurement runs in a fresh interpreter (so an import is really paid) and draws the 2000-point
timeline of the demo model's estimate (``resource_guard.demo.build``), the picture the monitor writes
at the end of a run. Prints a table; always exits 0.

    python benchmarks/memory_picture.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import json, sys, time
    from resource_guard.demo import build
    from resource_guard import estimate_memory
    import resource_guard.report.tensorboard as tb
    model, optimizer, batch = build()
    est = estimate_memory(model, optimizer, batch, lambda m, b: m(*b))
    before = set(sys.modules)
    t0 = time.perf_counter()
    import matplotlib.figure, matplotlib.backends.backend_agg
    t1 = time.perf_counter()
    first = tb.memory_picture(est.timeline, 256 * 2**20)
    t2 = time.perf_counter()
    again = []
    for _ in range(3):
        a = time.perf_counter()
        tb.png_bytes(tb.memory_picture(est.timeline, 256 * 2**20))
        again.append(time.perf_counter() - a)
    print(json.dumps({
        "import_s": t1 - t0, "first_s": t2 - t1, "next_s": min(again),
        "points": len(est.timeline), "modules": len(set(sys.modules) - before),
        "pyplot": "matplotlib.pyplot" in sys.modules,
    }))
    """
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="fresh interpreters to run (default 3)")
    args = parser.parse_args()
    rows = []
    for _ in range(args.repeat):
        done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            print(done.stderr[-2000:])
            return
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(f"memory picture, {rows[0]['points']} timeline points, median of {len(rows)} fresh interpreters")
    print(f"{'what':<44}{'seconds':>10}")
    print(f"{'import matplotlib.figure + Agg (lazy)':<44}{med('import_s'):>10.3f}")
    print(f"{'first picture after the import':<44}{med('first_s'):>10.3f}")
    print(f"{'each further picture + PNG':<44}{med('next_s'):>10.3f}")
    print(f"{'modules imported':<44}{med('modules'):>10.0f}")
    print(f"pyplot imported: {any(r['pyplot'] for r in rows)}")


if __name__ == "__main__":
    main()
