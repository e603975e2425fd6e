"""Memory bandwidth denominators: a device-to-device copy measured in the same run, and datasheets.

The copy moves `nbytes` and reads + writes each byte once, so achieved bandwidth counts 2x the
buffer size per copy (the convention of STREAM's "copy" and of nvbandwidth's device-local copy).
"""

from __future__ import annotations

import statistics
import time

import torch

DATASHEET_TB_S = {"H100": 3.35, "H200": 4.8, "B200": 8.0, "A100": 2.04, "MI300X": 5.3}


def copy_bandwidth_gb_s(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Median achieved bandwidth of `dst.copy_(src)` in GB/s (read + write)."""
    if device.type == "cpu":
        nbytes = min(nbytes, 256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 2):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times[2:]) / 1e9


def datasheet_tb_s(device: torch.device) -> tuple[str, float] | None:
    """(name, TB/s) for a known GPU, matched on the device name; None on a CPU or unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    for key, bw in DATASHEET_TB_S.items():
        if key in name:
            # the PCIe H100 has 2.0 TB/s HBM2e; the SXM part 3.35 TB/s HBM3
            if key == "H100" and "PCIE" in name:
                return "H100 PCIe", 2.0
            return key, bw
    return None
