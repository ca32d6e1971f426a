"""``mypy src/olmax`` held to a ratchet: the errors each file may still have, per error code, are in
``.mypy-baseline.json``. A file with more errors of a code than its baseline fails the check (the
new errors are printed); one with fewer is reported, so that the baseline is lowered
(``--update`` writes the current counts). The baseline only shrinks: new code is checked in full.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / ".mypy-baseline.json"
ERROR = re.compile(r"^(?P<file>[^:]+):\d+(?::\d+)?: error: .*\[(?P<code>[a-z-]+)\]$")


def mypy_errors() -> tuple[Counter, list[str]]:
    proc = subprocess.run([sys.executable, "-m", "mypy", "src/olmax"], cwd=ROOT, capture_output=True,
                          text=True)
    if proc.returncode not in (0, 1):
        sys.exit(f"mypy failed to run (exit {proc.returncode}):\n{proc.stderr or proc.stdout}")
    lines = [line for line in proc.stdout.splitlines() if ERROR.match(line)]
    return Counter(f"{m['file']} [{m['code']}]" for m in map(ERROR.match, lines)), lines


def main(argv: list[str]) -> int:
    counts, lines = mypy_errors()
    if "--update" in argv:
        BASELINE.write_text(json.dumps(dict(sorted(counts.items())), indent=1) + "\n")
        print(f"mypy ratchet: {sum(counts.values())} errors written to {BASELINE.name}")
        return 0
    allowed = Counter(json.loads(BASELINE.read_text()))
    worse = {k: (n, allowed[k]) for k, n in counts.items() if n > allowed[k]}
    better = {k: (counts[k], n) for k, n in allowed.items() if counts[k] < n}
    for key, (n, limit) in sorted(worse.items()):
        print(f"mypy: {key}: {n} errors, the baseline allows {limit}")
        for line in lines:
            if key == "{} [{}]".format(*ERROR.match(line).group("file", "code")):
                print(f"    {line}")
    for key, (n, limit) in sorted(better.items()):
        print(f"mypy: {key}: {n} errors, fewer than the baseline's {limit}: lower it "
              f"(scripts/lint --update)")
    print(f"mypy ratchet: {sum(counts.values())} errors in src/olmax, baseline "
          f"{sum(allowed.values())}; {len(worse)} file/code pairs over it")
    return 1 if worse or better else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
