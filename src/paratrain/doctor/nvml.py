"""GPU telemetry while doctor measures: SM utilization, memory, power, clocks, throttle reasons, PCIe link.

Uses NVML through nvidia-ml-py (`pip install nvidia-ml-py`, the `gpu` extra). The import is optional:
without the package, or off GPU, the sampler reports why it is unavailable and doctor carries on.
"""

from __future__ import annotations

import statistics
import threading

# NVML clock-event (throttle) reason bits, from nvml.h
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# reasons that mean the GPU ran slower than it could because of power or heat
LIMITING_REASONS = {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                    "hw_power_brake_slowdown"}


def load_nvml():
    """The pynvml module, initialized, or None (not installed / no driver)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - any NVML failure means "no telemetry", never a failed run
        return None
    return pynvml


def decode_reasons(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


class NvmlSampler:
    """Samples one GPU on a background thread every `interval_s` between start() and stop()."""

    def __init__(self, device_index: int, interval_s: float = 0.1, nvml=None):
        self.nvml = nvml if nvml is not None else load_nvml()
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self.static: dict = {}
        self.handle = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.nvml is not None:
            try:
                self.handle = self.nvml.nvmlDeviceGetHandleByIndex(device_index)
                self.static = self._read_static()
            except Exception:  # noqa: BLE001
                self.handle = None

    @property
    def available(self) -> bool:
        return self.handle is not None

    def _read_static(self) -> dict:
        n, h = self.nvml, self.handle
        out = {}
        for key, fn in (("name", n.nvmlDeviceGetName), ("pcie_gen", n.nvmlDeviceGetCurrPcieLinkGeneration),
                        ("pcie_width", n.nvmlDeviceGetCurrPcieLinkWidth),
                        ("pcie_gen_max", n.nvmlDeviceGetMaxPcieLinkGeneration),
                        ("pcie_width_max", n.nvmlDeviceGetMaxPcieLinkWidth),
                        ("power_limit_w", n.nvmlDeviceGetEnforcedPowerLimit)):
            try:
                value = fn(h)
            except Exception:  # noqa: BLE001 - a field this GPU or driver does not report
                continue
            out[key] = value.decode() if isinstance(value, bytes) else value
        if "power_limit_w" in out:
            out["power_limit_w"] = out["power_limit_w"] / 1000.0
        try:
            out["sm_clock_max_mhz"] = n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM)
        except Exception:  # noqa: BLE001
            pass
        return out

    def sample_once(self) -> dict:
        n, h = self.nvml, self.handle
        util = n.nvmlDeviceGetUtilizationRates(h)
        mem = n.nvmlDeviceGetMemoryInfo(h)
        row = {"sm_util": float(util.gpu), "mem_util": float(util.memory), "mem_used_gib": mem.used / 2**30,
               "mem_total_gib": mem.total / 2**30}
        for key, fn in (("power_w", lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0),
                        ("sm_clock_mhz", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
                        ("mem_clock_mhz", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM)),
                        ("throttle_mask", lambda: n.nvmlDeviceGetCurrentClocksThrottleReasons(h))):
            try:
                row[key] = fn()
            except Exception:  # noqa: BLE001
                pass
        return row

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.sample_once())
            except Exception:  # noqa: BLE001 - stop sampling on the first failure, keep what we have
                return
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        if self.available and self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="paratrain-nvml")
            self._thread.start()

    def stop(self) -> dict | None:
        """Summary of the samples: means, minimums and maximums, throttle reasons seen, PCIe link."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2)
        return summarize(self.samples, self.static) if self.available else None


def summarize(samples: list[dict], static: dict) -> dict:
    out: dict = {"samples": len(samples), **static}
    for key in ("sm_util", "mem_util", "mem_used_gib", "power_w", "sm_clock_mhz", "mem_clock_mhz"):
        values = [s[key] for s in samples if key in s]
        if values:
            out[f"{key}_mean"] = statistics.fmean(values)
            out[f"{key}_min"] = min(values)
            out[f"{key}_max"] = max(values)
    reasons: dict[str, int] = {}
    for s in samples:
        for name in decode_reasons(int(s.get("throttle_mask", 0))):
            reasons[name] = reasons.get(name, 0) + 1
    out["throttle_reasons"] = {k: v / max(1, len(samples)) for k, v in sorted(reasons.items())}
    if samples:
        out["mem_total_gib"] = samples[0].get("mem_total_gib")
    return out
