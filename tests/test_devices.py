"""Device choice (geomscope/devices.py): the CPU by any spelling, and one line for a device that is not
here."""

from __future__ import annotations

import pytest

from geomscope.errors import InputError


@pytest.mark.parametrize("spec", ["cpu", "auto", "CPU", None])
def test_resolve_device_cpu(spec):
    from geomscope.devices import resolve_device

    assert resolve_device(spec).type == "cpu"


@pytest.mark.parametrize(
    "spec,match",
    [
        ("cuda:1", "no CUDA device"),
        ("cuda", "no CUDA device"),
        ("tpu", "not a device|not supported"),
        ("gpu0", "not a device"),
    ],
)
def test_resolve_device_refuses_what_is_not_here(spec, match):
    import torch

    from geomscope.devices import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this check is about a machine without CUDA")
    with pytest.raises(InputError, match=match):
        resolve_device(spec)
