"""The transfer audit counts what a GPU would copy: hand cases with 0, 1 and 2 in each direction."""

import torch

from folding.testing.transfer_audit import TransferAudit


def _audit(fn):
    x = torch.randn(4, 3, requires_grad=True)  # born before the audit: a device tensor
    with TransferAudit() as audit:
        fn(x)
    return audit.h2d, audit.d2h


def test_device_only_work_counts_nothing():
    def fn(x):
        idx = torch.arange(4, device=x.device)  # built on the device
        y = x.index_select(0, idx.flip(0)) * 2.0 + torch.zeros_like(x)
        y.sum().backward()

    assert _audit(fn) == (0, 0)


def test_host_built_index_meeting_the_device_is_one_copy():
    def fn(x):
        idx = torch.tensor([3, 2, 1, 0])  # host list -> host tensor
        x.index_select(0, idx).sum().backward()  # meets x: one H2D

    assert _audit(fn) == (1, 0)


def test_two_host_tensors_and_an_explicit_move():
    def fn(x):
        offs = torch.tensor([1, 3]).cumsum(0)  # host work stays on the host
        offs.to(x.device)  # one H2D
        torch.tensor([0.5, 1.0, 2.0], device=x.device)  # host data copied: one H2D

    assert _audit(fn) == (2, 0)


def test_reads_of_device_tensors_are_d2h_and_of_host_tensors_are_not():
    def fn(x):
        x.sum().item()  # one D2H
        torch.tensor([1, 2]).tolist()  # host: free

    assert _audit(fn) == (0, 1)

    def fn2(x):
        (x > 0).sum(0).tolist()  # one D2H
        if x.abs().sum() > 0:  # bool() of a device tensor: one D2H
            pass

    assert _audit(fn2) == (0, 2)


def test_events_name_the_op_and_the_line():
    x = torch.randn(2)
    with TransferAudit() as audit:
        x + torch.ones(2)
    assert audit.h2d == 1
    kind, op, where = audit.events[0]
    assert kind == "H2D" and "test_transfer_audit.py" in where
