"""For test_streaming: peak RSS growth of a synchronous save of a large strided tensor (KiB)."""

import sys

import torch

import resurgo


def peak_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


big = torch.arange(64 << 20, dtype=torch.float32).reshape(8192, 8192).t()  # 256 MiB, transposed
assert not big.is_contiguous()
save = resurgo.save  # imports resurgo's modules (lazily loaded) before the measurement
open("/proc/self/clear_refs", "w").write("5")  # reset the peak to the current RSS
before = peak_kib()
save({"big": big}, sys.argv[1])
print(peak_kib() - before)
