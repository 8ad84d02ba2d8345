"""LGRR on an NVIDIA GPU: MPS thread percentage per client, and a pool of pre-created contexts.

UNTESTED ON HARDWARE: written on a CPU-only machine; no GPU was available to this change. It
implements ``shared.packing.governor.ShareControl`` two ways, as Gimbal §4.1/§6 describes:

- ``mps_client_env``: the environment of a worker started as an MPS client with
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (the MPS control daemon must run on the node). A change of
  share this way needs the worker restarted at a step boundary (checkpoint, relaunch).
- ``MpsContextPool``: one CUDA context per 10% step created up front with the driver API's
  execution affinity (``cuCtxCreate_v3`` with ``CU_EXEC_AFFINITY_TYPE_SM_COUNT``), so a squeeze or
  swell is a ``cuCtxSetCurrent`` (the paper measures 3.6 s per switch with its pool). Limitation:
  PyTorch submits to the device's primary context and its allocations live there; kernels launched
  under another context cannot touch them. Gimbal rewrote PyTorch's context management for that;
  this pool gives the driver half only, for a framework (or a custom PyTorch build) that launches
  through the current context.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Mapping

from shared.policies.packing import FULL, MIN_CAP, STEP

MPS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
_CU_EXEC_AFFINITY_TYPE_SM_COUNT = 0


def mps_client_env(percent: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a worker process that MPS caps at ``percent`` of the GPU's threads."""
    if not MIN_CAP <= percent <= FULL:
        raise ValueError(f"share {percent}% outside {MIN_CAP}..{FULL}")
    env = dict(os.environ if base is None else base)
    env[MPS_ENV] = str(int(percent))
    return env


def sm_count_for(percent: int, total_sms: int) -> int:
    """SMs a context gets at ``percent`` (at least one)."""
    return max(1, math.ceil(total_sms * percent / FULL))


class _SmCount(ctypes.Structure):
    _fields_ = [("val", ctypes.c_uint)]


class _AffinityUnion(ctypes.Union):
    _fields_ = [("smCount", _SmCount)]


class _ExecAffinityParam(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("param", _AffinityUnion)]


class CudaError(RuntimeError):
    pass


class MpsContextPool:
    """Contexts at 10..100% of the SMs, created once; ``set_share`` makes one current."""

    def __init__(self, device: int = 0, library: str = "libcuda.so.1") -> None:
        self._cu = ctypes.CDLL(library)
        self._check(self._cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(self._cu.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        sms = ctypes.c_int()
        self._check(
            self._cu.cuDeviceGetAttribute(ctypes.byref(sms), _CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
            "cuDeviceGetAttribute",
        )
        self.total_sms = sms.value
        self._contexts: dict[int, ctypes.c_void_p] = {}
        for percent in range(MIN_CAP, FULL + 1, STEP):
            param = _ExecAffinityParam(_CU_EXEC_AFFINITY_TYPE_SM_COUNT)
            param.param.smCount.val = sm_count_for(percent, self.total_sms)
            ctx = ctypes.c_void_p()
            self._check(
                self._cu.cuCtxCreate_v3(ctypes.byref(ctx), ctypes.byref(param), 1, 0, dev), "cuCtxCreate_v3"
            )
            self._contexts[percent] = ctx
        self._share = FULL
        self.set_share(FULL)

    @property
    def share(self) -> int:
        return self._share

    def set_share(self, percent: int) -> None:
        ctx = self._contexts[int(percent)]
        self._check(self._cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self._share = int(percent)

    def close(self) -> None:
        for ctx in self._contexts.values():
            self._cu.cuCtxDestroy_v2(ctx)
        self._contexts.clear()

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise CudaError(f"{what} failed: CUresult {rc}")
