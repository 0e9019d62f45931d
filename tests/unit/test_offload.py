"""Activation offloading's bookkeeping (``folding.memory.offload``), on CPU where the host tier is a separate
storage: what moves is storages, each copied once while it lives and comes back bit for bit as the views
that were saved; a storage freed (its address reused) or changed in place is a new copy; the layer below is
prefetched when backward reaches a layer. The numbers of whole layers and layouts are checked in
``test_kept_memory.py`` and the equivalence suite."""

import gc

import torch

from folding.memory.offload import LayerGroup, Offloader, offload_region


def _group():
    return LayerGroup(Offloader(frozenset({"core_attn"})), None)


def test_views_of_one_storage_move_once_and_come_back_as_saved():
    g = _group()
    base = torch.arange(24.0).reshape(4, 6)
    a, b = g.pack(base[1:3]), g.pack(base.t())
    assert len(g.handles) == 1  # one storage, one copy
    ua, ub = g.unpack(a), g.unpack(b)
    assert torch.equal(ua, base[1:3]) and torch.equal(ub, base.t())
    assert ua.stride() == base[1:3].stride() and ub.stride() == base.t().stride()
    assert ua.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()  # the device copy, not the source


def test_a_storage_changed_in_place_or_freed_is_copied_again():
    g = _group()
    t = torch.ones(64)
    first = g.pack(t)
    t.mul_(3)  # in place after the first save: a second save must not read the first copy
    second = g.pack(t)
    assert first.handle is not second.handle
    assert torch.equal(g.unpack(first), torch.ones(64)) and torch.equal(g.unpack(second), torch.full((64,), 3.0))
    handle = second.handle
    del t, first, second
    gc.collect()
    # the source storage is gone: its address may come back for another tensor, which the handle is not
    assert not handle.copies(torch.zeros(64))


def test_parameters_and_empty_tensors_stay():
    g = _group()
    w = torch.nn.Parameter(torch.randn(4, 4))
    assert g.pack(w) is w and g.pack(torch.empty(0)) is not None and not g.handles


def _two_layers(off, x):
    h = x
    with off.forward_pass():
        for _ in range(2):
            with off.layer() as finish:
                with offload_region("moe_act"):
                    h = finish(torch.sin(h) * 2)
    return h


def test_a_layer_prefetches_the_one_below_when_backward_reaches_it(monkeypatch):
    prefetched = []
    real = LayerGroup.prefetch
    monkeypatch.setattr(LayerGroup, "prefetch", lambda self: prefetched.append(len(self.handles)) or real(self))
    x0 = torch.randn(8, 16)
    x = x0.clone().requires_grad_()
    off = Offloader(frozenset({"moe_act"}))
    h = _two_layers(off, x)
    assert len(off.host_tensors()) == 2  # each layer's saved sin input, in the host tier
    h.sum().backward()
    assert prefetched == [1]  # the upper layer's backward brought the lower layer's one storage back
    plain = x0.clone().requires_grad_()
    _two_layers(Offloader(frozenset()), plain).sum().backward()
    assert torch.equal(x.grad, plain.grad)  # bit for bit the run without offloading
