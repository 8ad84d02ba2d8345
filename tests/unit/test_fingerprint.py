"""Fingerprints: equal values agree, any change in bytes or layout disagrees, odd objects are None."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis.extra import numpy as hnp

from kernel_replica.fingerprint import fingerprint


def test_numpy_value_layout_and_dtype() -> None:
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    assert fingerprint(a) == fingerprint(a.copy())
    b = a.copy()
    b[3, 5] += 1
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(a) != fingerprint(a.astype(np.float64))
    assert fingerprint(a) != fingerprint(a.reshape(6, 4))
    assert fingerprint(a) != fingerprint(np.asfortranarray(a))  # same values, other strides
    assert fingerprint(a[:, ::2]) == fingerprint(a.copy()[:, ::2])  # non-contiguous: by value
    assert fingerprint(np.zeros((0, 3))) != fingerprint(np.zeros((3, 0))) is not None
    assert fingerprint(np.float64(1.0)) is not None and fingerprint(np.array(3)) == fingerprint(np.array(3))


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(np.int16, hnp.array_shapes(max_dims=3, max_side=8)))
def test_numpy_views_fingerprint_by_value(arr: np.ndarray) -> None:
    view = arr[::-1][..., ::2]
    twin = arr.copy()[::-1][..., ::2]  # same layout, other memory
    assert fingerprint(view) == fingerprint(twin) is not None
    if twin.size:
        twin.flat[-1] = ~twin.flat[-1]  # always a different value, never overflows
        assert fingerprint(view) != fingerprint(twin)


def test_torch_tensors() -> None:
    t = torch.randn(8, 16)
    assert fingerprint(t) == fingerprint(t.clone())
    u = t.clone()
    u[0, 0] += 1
    assert fingerprint(t) != fingerprint(u)
    assert fingerprint(t) != fingerprint(t.to(torch.float64))
    assert fingerprint(t) != fingerprint(t.clone().requires_grad_())
    assert fingerprint(t.T) == fingerprint(t.clone().T)  # non-contiguous, hashed in row blocks
    assert fingerprint(t.T) != fingerprint(t.T.contiguous())  # strides are part of the layout
    assert fingerprint(torch.tensor([1 + 2j]).conj()) != fingerprint(torch.tensor([1 + 2j]))
    assert fingerprint(torch.zeros(0)) is not None
    assert fingerprint(t.to(torch.bfloat16)) is not None


def test_module_and_optimizer_state() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    fm, fo = fingerprint(model), fingerprint(opt)
    assert fm is not None and fo is not None and fingerprint(model) == fm
    model.train(False)  # not in the state_dict, still state
    assert fingerprint(model) != fm
    model.train(True)
    assert fingerprint(model) == fm
    model(torch.randn(8, 4)).sum().backward()  # running stats and grads change
    assert fingerprint(model) != fm
    fm = fingerprint(model)
    opt.step()
    assert fingerprint(model) != fm and fingerprint(opt) != fo
    fo = fingerprint(opt)
    opt.param_groups[0]["lr"] = 0.5  # a hyperparameter, not a tensor
    assert fingerprint(opt) != fo


def test_generic_objects_and_unfingerprintable() -> None:
    assert fingerprint({"a": [1, 2]}) == fingerprint({"a": [1, 2]})
    assert fingerprint({"a": [1, 2]}) != fingerprint({"a": [1, 3]})
    mixed: dict[str, Any] = {"w": np.ones(3), "t": torch.ones(2)}
    f = fingerprint(mixed)
    mixed["w"][0] = 2
    assert f is not None and fingerprint(mixed) != f
    assert fingerprint(threading.Lock()) is None
    assert fingerprint(x for x in range(3)) is None
    with open(__file__) as fh:
        assert fingerprint(fh) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensor_matches_host_bytes() -> None:
    t = torch.randn(1024, 1024, device="cuda")
    assert fingerprint(t) == fingerprint(t.clone())
    assert fingerprint(t.T) == fingerprint(t.clone().T)
    u = t.clone()
    u[-1, -1] += 1
    assert fingerprint(u) != fingerprint(t)
