"""For test_convert: peak RSS growth (KiB) of one conversion, in a fresh process.

usage: convert_memory.py SRC DST TO [key=value ...]   (values: ints, or strings for 'only')
Prints the growth of the peak resident set (VmHWM) over the conversion, then the report as JSON.
"""

import json
import sys
from dataclasses import asdict

import resurgo


def peak_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


src, dst, to = sys.argv[1:4]
options = {}
for arg in sys.argv[4:]:
    name, value = arg.split("=", 1)
    options[name] = int(value) if value.isdigit() else value
convert = resurgo.convert  # imports torch and resurgo's modules (lazily loaded) before the measurement
open("/proc/self/clear_refs", "w").write("5")  # reset the peak to the current RSS
before = peak_kib()
report = convert(src, dst, to=to, **options)
print(peak_kib() - before)
print(json.dumps(asdict(report)))
