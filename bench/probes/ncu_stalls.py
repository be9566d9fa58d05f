"""Where a kernel's warps wait, from Nsight Compute's source page (kernels_ncu.py's doc makes it):

    python3 bench/probes/ncu_stalls.py source.csv [TOP]

For each kernel: its stall samples by reason (share of all samples), then the TOP instructions
(default 8) holding the most samples, with their offset in the kernel, their main reasons and how
often they ran. A warp's sample is charged to the instruction it waits to issue, so a load that
waits on `long_sb` waits on an earlier load's scoreboard, not on its own data.
"""

import collections
import csv
import sys

ALL = "Warp Stall Sampling (All Samples)"


def kernels(path: str):
    """(kernel name, header, rows) per kernel section of the CSV; a kernel profiled twice (`-c`)
    is reported once."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"] + [len(rows)]
    seen = set()
    for s, e in zip(starts, starts[1:]):
        name, header = rows[s][1], rows[s + 1]
        if name not in seen:
            seen.add(name)
            yield name, header, [r for r in rows[s + 2 : e] if len(r) == len(header)]


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
    for name, header, body in kernels(path):
        col = {h: j for j, h in enumerate(header)}
        # reason -> column: all samples of each stall reason (not the not-issued ones)
        reasons = {h[6:]: j for h, j in col.items() if h.startswith("stall_") and "(Not" not in h}
        samples = [int(r[col[ALL]] or 0) for r in body]
        total = sum(samples)
        by_reason = collections.Counter(
            {k: sum(int(r[j] or 0) for r in body) for k, j in reasons.items()}
        )
        base = int(body[0][0], 16)
        print(f"{name}: {len(body)} instructions, {total} samples")
        print("  " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_reason.most_common(6)))
        for n, r in sorted(zip(samples, body), key=lambda p: -p[0])[:top]:
            main_reasons = sorted(((int(r[j] or 0), k) for k, j in reasons.items()), reverse=True)
            why = ", ".join(f"{k} {v}" for v, k in main_reasons[:2] if v)
            print(
                f"  +{int(r[0], 16) - base:05x} {100 * n / total:5.1f}%  {r[1][:58]:58s}"
                f"  ({why}; ran {r[col['Instructions Executed']]} times)"
            )


if __name__ == "__main__":
    main()
