"""Running Megatron-Core's MoE token dispatchers and ``MoELayer`` on CPU gloo ranks, for the interop
tests and the side-by-side benchmark. Only ever imported inside those processes: the stand-ins
below replace a few CUDA entry points that Megatron-Core calls unconditionally.

- ``torch.cuda.current_device()`` returns the CPU device, ``torch.cuda.current_stream()`` /
  ``torch.cuda.Stream()`` return an object whose ``wait_stream`` / ``synchronize`` do nothing, and
  ``torch.cuda.stream(s)`` is a null context (the shared expert's overlap streams);
- gloo's uneven ``all_to_all_single`` and ``all_gather`` take Python lists of split sizes, not
  tensors or numpy arrays;
- without TransformerEngine ``moe_utils.te_general_gemm`` is set to ``None`` (the router checks it);
- ``torch.cuda.synchronize()`` does nothing, the CUDA RNG tracker's states are CPU RNG states (its
  ``fork`` only swaps them; dropout is off in the tests), and ``dist_checkpointing``'s writer writes its
  buckets in the calling process (its forked writer processes and its results manager cannot start from
  the daemonic ranks of a rank pool) without asking ``psutil`` (not a dependency) for its memory use;
- an all-gather with unequal sizes (ETP > 1) is done as a padded ``all_gather_into_tensor`` (the
  output tensors give the sizes), a reduce-scatter with unequal sizes as an all-to-all of the blocks
  and a local sum: the bytes and the collective count of the real ones.

Usage (inside a rank)::

    mc = megatron_on_cpu()                     # idempotent; returns the megatron.core module
    init_megatron(tp=1, ep=4, etp=1)           # parallel_state on the existing gloo world
    ...
    destroy_megatron()
"""

from __future__ import annotations

import contextlib
import queue
import types

import torch
import torch.distributed as dist

_PATCHED = False


class _Stream:
    def wait_stream(self, other):
        return None

    def synchronize(self):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return types.SimpleNamespace(synchronize=lambda: None, wait=lambda *a: None)


def _as_list(sizes):
    if sizes is None:
        return None
    if isinstance(sizes, torch.Tensor):
        return [int(v) for v in sizes.tolist()]
    return [int(v) for v in list(sizes)]


def _write_buckets_inline(transform_list, use_msc, rank, write_buckets, results_queue):
    """``FileSystemWriterAsync.write_preloaded_data_multiproc`` without processes: each bucket is written by
    its own ``write_preloaded_data`` in turn, and the results are reported in the same form."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results = {}
    for i, bucket in enumerate(write_buckets):
        local, count = queue.Queue(), queue.Queue()
        count.put(i)
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True)
        idx, res = local.get()
        if isinstance(res, Exception):
            results_queue.put(res)
            return
        results[idx] = res
    results_queue.put(results)


def megatron_on_cpu():
    """Install the CPU stand-ins (once per process) and return ``megatron.core``."""
    global _PATCHED
    import megatron.core as mc
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if _PATCHED:
        return mc
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.Stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.Event = lambda *a, **k: types.SimpleNamespace(record=lambda *a, **k: None, synchronize=lambda: None)
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _Stream()
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as mrandom

    filesystem_async._process_memory = lambda: 0
    filesystem_async._get_write_results_queue = queue.Queue
    filesystem_async.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(_write_buckets_inline)
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    elif getattr(moe_utils, "te_general_gemm", None) is not None and not torch.cuda.is_available():
        moe_utils.te_general_gemm = None

    a2a = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        return a2a(output, input, _as_list(output_split_sizes), _as_list(input_split_sizes), **kw)

    dist.all_to_all_single = all_to_all_single

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        # unequal sizes (ETP > 1): the output tensors give every rank's row count, so pad to the
        # largest, gather equal blocks, copy back the real rows (no extra collective)
        n = len(tensor_list)
        most = max(t.shape[0] for t in tensor_list)
        if all(t.shape[0] == most for t in tensor_list):
            return _gather(tensor_list, tensor.contiguous(), group=group, async_op=async_op)
        pad = tensor.new_zeros((most,) + tuple(tensor.shape[1:]))
        pad[: tensor.shape[0]] = tensor
        out = tensor.new_empty((n * most,) + tuple(tensor.shape[1:]))
        dist.all_gather_into_tensor(out, pad, group=group)
        for i, t in enumerate(tensor_list):
            t.copy_(out[i * most : i * most + t.shape[0]])
        return None

    _gather = dist.all_gather
    dist.all_gather = all_gather

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        # unequal sizes: an all-to-all sends block i to rank i (the bytes of a reduce-scatter), then
        # each rank sums the blocks it received
        assert op == dist.ReduceOp.SUM
        n, rows = len(input_list), output.shape[0]
        flat = [t.reshape(t.shape[0], -1) for t in input_list]
        whole = torch.cat(flat) if len(flat) > 1 else flat[0]
        recv = whole.new_empty((n * rows, whole.shape[1]))
        a2a(recv, whole.contiguous(), [rows] * n, [t.shape[0] for t in flat], group=group)
        output.copy_(recv.view(n, rows, -1).sum(0).reshape(output.shape))
        return None

    dist.reduce_scatter = reduce_scatter
    _PATCHED = True
    return mc


def init_megatron(*, tp: int, ep: int, etp: int, seed: int = 1234) -> None:
    """``parallel_state.initialize_model_parallel`` on the existing gloo world (PP 1, CP 1)."""
    mc = megatron_on_cpu()
    from megatron.core import parallel_state as mps

    mps.destroy_model_parallel()
    mps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        create_gloo_process_groups=False,
    )
    torch.manual_seed(seed)
    return mc


def destroy_megatron() -> None:
    """Forget Megatron-Core's groups (between layouts in a long-lived rank)."""
    from megatron.core import parallel_state as mps

    mps.destroy_model_parallel()


def megatron_moe_kept(
    *, hidden: int, experts: int, topk: int, ffn: int, tokens: int, dtype=torch.bfloat16, aux_loss_coeff: float = 0.01
):
    """What Megatron-Core's ``MoELayer`` keeps for backward on one rank (TP = EP = 1 on the running
    world, which must be initialized): SequentialMLP experts with the fused weighted SwiGLU, an fp32
    router with the Switch aux loss, the all-to-all dispatcher, ``dtype`` parameters and activations,
    on ``tokens`` tokens ``[tokens, 1, hidden]``. Returns the :meth:`folding.testing.kept_memory.KeptCensus.kept`
    entries (the layer's input, which its router keeps, included as ``"input"``)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from folding.testing.kept_memory import KeptCensus

    init_megatron(tp=1, ep=1, etp=1)
    try:
        cfg = TransformerConfig(
            num_layers=1,
            hidden_size=hidden,
            num_attention_heads=4,
            ffn_hidden_size=ffn,
            moe_ffn_hidden_size=ffn,
            num_moe_experts=experts,
            moe_router_topk=topk,
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=aux_loss_coeff,
            moe_router_dtype="fp32",
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            bias_activation_fusion=True,
            add_bias_linear=False,
            use_cpu_initialization=True,
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
        )
        spec = get_moe_module_spec(use_te=False, num_experts=experts, moe_grouped_gemm=False)
        layer = MoELayer(cfg, spec.submodules).to(dtype)
        layer.router.weight.data = layer.router.weight.data.float()  # the fp32 router
        x0 = torch.randn(tokens, 1, hidden, dtype=dtype, generator=torch.Generator().manual_seed(0))
        with KeptCensus(layer) as census:
            x = census.make(lambda: x0.clone().requires_grad_())
            y, _ = layer(x)
        return census.kept(y)
    finally:
        destroy_megatron()


class _CpuRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm with Megatron-Core's norm signature, accepted under sequence parallelism (Megatron's own
    torch norm wrapper refuses it; the weight is marked ``sequence_parallel`` as Megatron's fused norms do)."""

    def __init__(self, config, hidden_size, eps=1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def megatron_gpt_moe(
    *,
    tp: int,
    ep: int,
    etp: int,
    layers: int,
    hidden: int,
    heads: int,
    groups: int,
    head_dim: int,
    experts: int,
    topk: int,
    ffn: int,
    vocab: int,
    qk_norm: bool,
    eps: float = 1e-6,
    rope_base: int = 10000,
    seed: int = 1234,
):
    """A Megatron-Core ``GPTModel`` with MoE layers (local spec: SequentialMLP experts, RMSNorm, SwiGLU, RoPE,
    GQA, per-head q/k RMSNorm when ``qk_norm``; no biases, untied output layer, fp32, dropout off, sequence
    parallel when TP > 1) on the running world, in eval mode, after :func:`init_megatron`. Its forward
    ``model(ids_BS, positions_BS, None)`` returns the logits ``[B, S, vocab]`` gathered over TP."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    init_megatron(tp=tp, ep=ep, etp=etp, seed=seed)
    tracker = mrandom.get_cuda_rng_tracker()
    for name in ("model-parallel-rng", "expert-parallel-rng", "data-parallel-rng"):
        tracker.states_[name] = torch.get_rng_state()
    tracker._is_initialized = True
    cfg = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        ffn_hidden_size=ffn,
        moe_ffn_hidden_size=ffn,
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_router_pre_softmax=False,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        normalization="RMSNorm",
        layernorm_epsilon=eps,
        qk_layernorm=qk_norm,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bf16=False,
        init_method_std=0.1,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    layer = get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=qk_norm, normalization="RMSNorm")
    sub = layer.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = _CpuRMSNorm
    if qk_norm:
        sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = _CpuRMSNorm
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=_CpuRMSNorm),
        vocab_size=vocab,
        max_sequence_length=64,
        position_embedding_type="rope",
        rotary_base=rope_base,
        share_embeddings_and_output_weights=False,
        parallel_output=False,
    )
    return model.eval()
