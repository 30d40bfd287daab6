"""Per-step summary of the clock log gpu_run.sh keeps: SM clock min/median/max, median power, peak
temperature and the clock-event reasons seen while each step ran.

    python scripts/clock_summary.py clocks.csv steps.txt

clocks.csv: `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,
clocks_event_reasons.active --format=csv,noheader,nounits -lms 200` lines; steps.txt: lines
"YYYY/MM/DD HH:MM:SS.mmm <step>", a step running until the next one starts (the last to the log's
end). Two runs of the same kernels timed apart can then be told apart by the card's clocks.
"""

from __future__ import annotations

import datetime
import statistics
import sys


def parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text.strip(), "%Y/%m/%d %H:%M:%S.%f")


def main(clocks_path: str, steps_path: str) -> None:
    samples = []  # (time, sm MHz, watts, celsius, reasons)
    with open(clocks_path) as f:
        for line in f:
            fields = [x.strip() for x in line.split(",")]
            try:
                samples.append((parse_time(fields[0]), float(fields[1]), float(fields[2]), float(fields[3]),
                                fields[4] if len(fields) > 4 else ""))
            except (ValueError, IndexError):
                continue  # a header, a cut-off last line or "[N/A]"
    steps = []
    with open(steps_path) as f:
        for line in f:
            date, clock, name = line.split(maxsplit=2)
            steps.append((parse_time(f"{date} {clock}"), name.strip()))
    if not samples or not steps:
        print("no clock samples" if not samples else "no steps marked")
        return
    ends = [t for t, _ in steps[1:]] + [samples[-1][0] + datetime.timedelta(seconds=1)]
    print("| step | s | SM MHz min / median / max | W median | C max | reasons |")
    print("|---|---|---|---|---|---|")
    for (begin, name), end in zip(steps, ends):
        inside = [s for s in samples if begin <= s[0] < end]
        if not inside:
            continue
        mhz = [s[1] for s in inside]
        reasons = sorted({s[4] for s in inside if s[4] and s[4] != "0x0000000000000000"})
        print(f"| {name} | {(end - begin).total_seconds():.0f} | {min(mhz):.0f} / {statistics.median(mhz):.0f} / "
              f"{max(mhz):.0f} | {statistics.median(s[2] for s in inside):.0f} | {max(s[3] for s in inside):.0f} | "
              f"{' '.join(reasons) or '-'} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
