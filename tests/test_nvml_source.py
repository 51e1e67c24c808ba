"""NvmlSource against nvidia-ml-py itself, with only the driver calls replaced.

The real `pynvml` module stays: its error classes (NVMLError_Timeout, NVMLError_NotSupported, ...), its
ctypes structures and its constants. What cannot exist here, the driver, is replaced by functions that
answer the way the driver does: memory in bytes, `usedGpuMemory` None where the driver cannot attribute
memory (containers, WDDM), NVMLError_Timeout from nvmlEventSetWait when no event is pending,
NVMLError_NotSupported for ECC on GPUs without it, NVMLError_GPU_IS_LOST once a GPU has fallen off the bus.
"""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest

from prime_train.kit.gpu import MIB, GpuProcess, NvmlSource


class FakeDriver:
    """What the NVIDIA driver answers for a list of GPUs, patched under the real pynvml's API."""

    def __init__(self, gpus: list[dict]):
        self.gpus = gpus
        self.pending_xids: dict[int, list[int]] = {}
        self.lost: set[int] = set()
        self.shutdowns = 0

    def _gpu(self, handle):
        if handle.index in self.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self.gpus[handle.index]

    def install(self, monkeypatch) -> None:
        nvml = pynvml

        def not_supported():
            raise nvml.NVMLError(nvml.NVML_ERROR_NOT_SUPPORTED)

        def memory(handle):
            g = self._gpu(handle)
            mem = nvml.c_nvmlMemory_t()
            mem.total, mem.used = g["total_bytes"], g["used_bytes"]
            mem.free = mem.total - mem.used
            return mem

        def utilization(handle):
            util = nvml.c_nvmlUtilization_t()
            util.gpu, util.memory = self._gpu(handle)["util"], 0
            return util

        def ecc(handle, error_type, counter_type):
            value = self._gpu(handle).get("ecc")
            return not_supported() if value is None else value

        def processes(handle):
            return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self._gpu(handle)["procs"]]

        def event_wait(event_set, timeout_ms):
            pending = self.pending_xids.get(event_set.index)
            if not pending:
                raise nvml.NVMLError(nvml.NVML_ERROR_TIMEOUT)
            return SimpleNamespace(eventType=nvml.nvmlEventTypeXidCriticalError, eventData=pending.pop(0))

        calls = {
            "nvmlInit": lambda: None,
            "nvmlShutdown": lambda: setattr(self, "shutdowns", self.shutdowns + 1),
            "nvmlDeviceGetCount": lambda: len(self.gpus),
            "nvmlDeviceGetHandleByIndex": lambda i: SimpleNamespace(index=i),
            "nvmlDeviceGetUUID": lambda h: self._gpu(h)["uuid"],
            "nvmlDeviceGetName": lambda h: self._gpu(h)["name"],
            "nvmlDeviceGetMemoryInfo": memory,
            "nvmlDeviceGetUtilizationRates": utilization,
            "nvmlDeviceGetPowerUsage": lambda h: self._gpu(h)["power_mw"],
            "nvmlDeviceGetTemperature": lambda h, sensor: self._gpu(h)["temp"],
            "nvmlDeviceGetTotalEccErrors": ecc,
            "nvmlDeviceGetComputeRunningProcesses": processes,
            "nvmlDeviceGetCurrentClocksEventReasons": lambda h: self._gpu(h).get("clock_reasons", 0),
            "nvmlEventSetCreate": lambda: SimpleNamespace(index=None),
            "nvmlDeviceRegisterEvents": lambda h, types, event_set: setattr(event_set, "index", h.index),
            "nvmlEventSetWait": event_wait,
            "nvmlEventSetFree": lambda event_set: None,
        }
        for name, fn in calls.items():
            assert hasattr(nvml, name), f"pynvml has no {name}: the fake would hide an API change"
            monkeypatch.setattr(nvml, name, fn)


def h100(**kw) -> dict:
    gpu = {
        "uuid": "GPU-5f1c0a2e-0000-4000-8000-000000000000",
        "name": "NVIDIA H100 80GB HBM3",
        "total_bytes": 81559 * MIB,
        "used_bytes": 518 * MIB,
        "util": 0,
        "power_mw": 72000,
        "temp": 31,
        "ecc": 0,
        "procs": [(3129046, None)],  # a host PID, memory not attributable inside the container
    }
    return {**gpu, **kw}


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver([h100(), h100(uuid="GPU-5f1c0a2e-0000-4000-8000-000000000001", ecc=None)])
    fake.install(monkeypatch)
    return fake


def test_readings_convert_bytes_and_keep_unattributed_memory_unknown(driver):
    source = NvmlSource()
    assert source.error is None
    first, second = source.read()
    assert (first.index, first.name, first.utilization_pct) == (0, "NVIDIA H100 80GB HBM3", 0.0)
    assert first.memory_used_mib == 518.0 and first.memory_total_mib == 81559.0
    assert first.power_w == 72.0 and first.temperature_c == 31.0
    assert first.processes == [GpuProcess(3129046, None)]
    assert first.ecc_uncorrected == 0
    assert second.ecc_uncorrected is None  # NotSupported costs only that field


def test_attributed_process_memory_is_converted_from_bytes(driver):
    driver.gpus[0]["procs"] = [(4242, 60710 * MIB)]
    assert NvmlSource().read()[0].processes == [GpuProcess(4242, 60710.0)]


def test_xids_are_drained_once_and_the_timeout_means_none_pending(driver):
    source = NvmlSource()
    driver.pending_xids[1] = [13, 79]
    assert [r.xid for r in source.read()] == [[], [13, 79]]
    assert [r.xid for r in source.read()] == [[], []]  # NVMLError_Timeout: nothing new


def test_clock_event_reasons_are_named(driver):
    driver.gpus[0]["clock_reasons"] = 0x1 | 0x40
    assert NvmlSource().read()[0].throttle_reasons == ["gpu_idle", "hw_thermal_slowdown"]


def test_a_lost_gpu_reads_as_unknown_fields_not_an_exception(driver):
    source = NvmlSource()
    driver.lost.add(1)
    lost = source.read()[1]
    assert (lost.utilization_pct, lost.memory_used_mib, lost.processes, lost.uuid) == (None, None, [], "")


def test_close_shuts_nvml_down_once(driver):
    source = NvmlSource()
    source.close()
    source.close()
    assert driver.shutdowns == 1 and source.read() == []
