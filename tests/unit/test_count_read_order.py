"""The order around a dispatch's count read (one process, ``parallel.overlap_moe_comm``'s layer setting).

The count read is the dropless dispatch's one device-to-host read: on a GPU the host blocks there until
the counts have arrived. The shared expert needs no counts, so it is issued before that read (its
kernels then run while the counts travel and the host waits). The read is not a hand-over point of an
overlap pair (a third point per MoE layer in the forward lane only would unbalance the lanes:
``folding.moe.dispatch.host_sync.read_counts``). The trace records, per lane, when a shared expert
starts and when a host read starts (whatever the engine calls it: ``host_sync.to_host`` or
``host_sync.start_read``), and the order audit (:func:`folding.testing.overlap_audit.audit`) counts the
compute operations issued before each.
"""

import pytest
import torch

from folding.moe.config import MoEConfig
from folding.moe.dispatch import host_sync
from folding.moe.layer import build_moe_layer
from folding.moe.settings import LayerSettings
from folding.overlap.runtime import OverlapRuntime
from folding.parallel.groups import ProcessGroups
from folding.testing import overlap_audit

H, T, E = 16, 12, 4


def _layer():
    cfg = MoEConfig(num_experts=E, topk=2, ffn_hidden_size=8, shared_expert_ffn_hidden_size=8, aux_loss_coeff=0.0)
    return build_moe_layer(
        cfg,
        hidden_size=H,
        groups=ProcessGroups.single(),
        settings=LayerSettings(init_seed=3, overlap_comm=True),
    )


@pytest.fixture
def runtime():
    """The overlap runtime the tests run the layer under, current for the test's duration."""
    rt = OverlapRuntime()
    with rt.active():
        yield rt
    rt.close()


@pytest.fixture
def trace(monkeypatch, runtime):
    """``(event, lane, ops)`` per shared-expert start and per host read, ``ops`` the audit's operation
    count so far."""
    log = []

    def mark(what):
        log.append((what, runtime.running_lane(), overlap_audit._op_count[0]))

    for name in ("to_host", "start_read"):
        real = getattr(host_sync, name, None)
        if real is not None:

            def read(*a, _real=real, **k):
                mark("read")
                return _real(*a, **k)

            monkeypatch.setattr(host_sync, name, read)
    return log, mark


def _watch_shared(layer, mark):
    real = layer.shared_expert.forward

    def forward(*a, **k):
        mark("shared")
        return real(*a, **k)

    layer.shared_expert.forward = forward


def test_the_shared_expert_is_issued_before_the_count_read(trace, runtime):
    log, mark = trace
    layer = _layer()
    _watch_shared(layer, mark)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(0))
    with overlap_audit.audit(runtime):
        layer(x)
    assert [e for e, _, _ in log] == ["shared", "read"], log
    assert log[0][2] < log[1][2]  # operations were issued between them: the shared expert's


def test_in_a_pair_each_lane_issues_its_shared_expert_before_its_count_read(trace, runtime):
    log, mark = trace
    layer = _layer()
    _watch_shared(layer, mark)
    xs = [torch.randn(T, H, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]
    ref = [layer(x) for x in xs]  # outside a pair: the reference outputs
    log.clear()
    before = runtime.stats.hand_overs
    with torch.no_grad():
        out = runtime.run_pair(lambda: layer(xs[0]), lambda: layer(xs[1]))
    for lane in (0, 1):
        assert [e for e, la, _ in log if la == lane] == ["shared", "read"], log
    assert runtime.stats.hand_overs == before  # one rank, no token exchange: the read hands nothing over
    assert all(torch.equal(a, b) for a, b in zip(out, ref))  # the same numbers bitwise
