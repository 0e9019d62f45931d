"""``tools/megatron_args.py``: Megatron-LM's Mixtral 8x7B pretraining command becomes overrides that the dry
run accepts (the published layout, TP1 EP8 PP4 VPP8 ETP1 on 64 GPUs); a flag without an equivalent is
refused by name; the special flags follow Megatron-LM's semantics; the table names only real keys and the
docs list every flag."""

import os
import subprocess
import sys

import pytest

from folding.interop.megatron.args import MegatronArgsError, convert
from folding.interop.megatron.flags import FLAGS, MEGATRON_DEFAULTS, leaf_synonyms
from folding.launch import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Megatron-LM's Mixtral 8x7B MoE training example (megatron/core/transformer/moe/README.md) with the
# published parallel mapping (TP1 EP8 PP4 VPP8, ETP1, alltoall, bf16, MBS1, GBS256, seq 4096) and the
# flags of examples/mixtral/train_mixtral_8x7b_distributed.sh.
MIXTRAL_8X7B = """
torchrun --nproc_per_node 8 --nnodes 8 --node_rank 0 --master_addr localhost --master_port 6000 pretrain_gpt.py
--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768 --num-layers 32
--hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01
--attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 --no-masked-softmax-fusion
--no-position-embedding --rotary-base 1000000
--num-experts 8 --expert-model-parallel-size 8 --expert-tensor-parallel-size 1
--moe-router-load-balancing-type aux_loss --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm
--moe-permute-fusion --moe-token-dispatcher-type alltoall
--tokenizer-type Llama2Tokenizer --tokenizer-model /models/mixtral/tokenizer.model
--data-path /data/mixtral_text_document --split 99990,8,2
--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000
--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16
--overlap-grad-reduce --overlap-param-gather
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1
--sequence-parallel --use-distributed-optimizer
--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save /ckpt/mixtral
--load /ckpt/mixtral --tensorboard-dir /ckpt/mixtral/tensorboard --no-load-rng --async-save
""".split()


def _run(*args, script="tools.megatron_args"):
    cmd = [sys.executable, "-m", script, *args] if not script.endswith(".py") else [sys.executable, script, *args]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


def test_mixtral_8x7b_command_gives_overrides_the_dry_run_accepts():
    p = _run(*MIXTRAL_8X7B)
    assert p.returncode == 0, p.stderr
    overrides = p.stdout.split()
    assert overrides[0] == "model=mixtral_8x7b"  # the sizes are the preset's
    for item in (
        "parallel.tp=1",
        "parallel.pp=4",
        "parallel.vpp=8",  # 32 layers / (PP4 x 1 layer per virtual stage)
        "parallel.ep=8",
        "parallel.etp=1",
        "parallel.world_size=64",  # 8 per node x 8 nodes
        "moe.aux_loss_coeff=0.01",  # the preset's is Hugging Face's 0.02
        "train.precision=bf16",
        "train.global_batch_size=256",
        "optim.beta2=0.999",  # Megatron-LM's default, not folding's 0.95
        "optim.distributed=true",
        "data.paths=[/data/mixtral_text_document]",
        "data.split=[99990,8,2]",
        "checkpoint.dir=/ckpt/mixtral",
        "checkpoint.async_save=true",
    ):
        assert item in overrides, (item, overrides)
    assert not any(o.startswith(("moe.dispatcher=", "model.rope_theta=")) for o in overrides)  # as the preset
    assert "# --no-load-rng: ignored; nothing in this job draws random numbers" in p.stderr
    assert "# --moe-grouped-gemm:" in p.stderr and "# --tokenizer-type Llama2Tokenizer:" in p.stderr
    # the data are the cluster's: the dry run refuses the missing files by name, and checks the rest on the
    # embedded corpus, whose 1,227 documents need a split that gives valid and test some
    from folding.job.config import ConfigError
    from folding.launch.dry_run import dry_run_report
    from tests.unit.test_config_job import job

    with pytest.raises(ConfigError, match=r"data.paths entry '/data/mixtral_text_document'.*data.paths=\[\]"):
        dry_run_report(job(*overrides, "train.dry_run=true"), world_size=64)
    with pytest.raises(ConfigError, match=r"data.split='99990,8,2' gives the 'valid' split no documents.*98,1,1"):
        dry_run_report(job(*overrides, "data.paths=[]"), world_size=64)
    here = [*overrides, "data.paths=[]", "data.split=[98,1,1]", "train.dry_run=true"]
    dry = _run(*here, script=os.path.join(ROOT, "examples", "pretrain_mixtral.py"))
    assert dry.returncode == 0, dry.stderr
    assert "dry run: mixtral_8x7b on 64 ranks" in dry.stdout
    assert "attention TP1 CP1 DP16 PP4 VPP8 | MoE ETP1 EP8 EDP2 PP4" in dry.stdout
    assert "global 256 x seq 4096, micro-batch 1" in dry.stdout and "dispatcher alltoall" in dry.stdout


# NVIDIA's examples/mixtral/train_mixtral_8x7b_distributed.sh as written (its own small sizes; mock data; the
# logging block a user's copy carries: tensorboard, timers, params norm, zeros in the gradient, an exit timer,
# the checkpoint strictness), launched on 2 GPUs of 1 node (the flags after pretrain_gpt.py)
NVIDIA_MIXTRAL_SCRIPT = """
--use-mcore-models --disable-bias-linear --seq-length 256 --max-position-embeddings 2048 --num-layers 2
--hidden-size 256 --ffn-hidden-size 896 --num-attention-heads 2 --init-method-std 0.01 --attention-dropout 0.0
--hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 --no-masked-softmax-fusion
--no-position-embedding --rotary-base 1000000
--num-experts 2 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
--moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
--tokenizer-type Llama2Tokenizer --tokenizer-model /workspace/Megatron-LM/tokenizer.model --mock-data
--split 99990,8,2
--micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters 7 --min-lr 1.0e-5 --weight-decay 0.1
--clip-grad 1.0
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 2
--use-distributed-optimizer --sequence-parallel
--eval-iters 10 --no-load-optim --no-load-rng
--log-params-norm --log-num-zeros-in-grad --timing-log-level 2 --tensorboard-log-interval 1
--log-validation-ppl-to-tensorboard --exit-duration-in-mins 230 --dist-ckpt-strictness log_all
--accumulate-allreduce-grads-in-fp32
""".split()


def test_nvidia_mixtral_script_flags_translate_as_written():
    """Every flag of the script either sets a key or is a note (none changes what is computed without a key);
    --no-load-optim and --no-load-rng without --load are notes; --load naming a Megatron checkpoint starts from
    its weights with a fresh optimizer (a note), and --no-load-optim with --load = --save (the run's own
    checkpoints, which always restore the optimizer) is refused."""
    conv = convert(NVIDIA_MIXTRAL_SCRIPT, world_size=2, config_dir=os.path.join(ROOT, "configs"))
    noted = {note.split(":")[0].split()[0] for note in conv.notes}
    for flag in (
        "--log-params-norm",
        "--log-num-zeros-in-grad",
        "--timing-log-level",
        "--tensorboard-log-interval",
        "--log-validation-ppl-to-tensorboard",
        "--exit-duration-in-mins",
        "--dist-ckpt-strictness",
        "--accumulate-allreduce-grads-in-fp32",
        "--no-load-optim",
        "--no-load-rng",
    ):
        assert flag in noted, (flag, conv.notes)
    assert conv.values["parallel.ep"] == 2 and conv.values["parallel.world_size"] == 2
    conv = convert([*NVIDIA_MIXTRAL_SCRIPT, "--load", "/ckpt"], world_size=2)
    assert conv.values["checkpoint.init_from_megatron"] == "/ckpt" and "checkpoint.load" not in conv.values
    assert any(n.startswith("--load: checkpoint.init_from_megatron starts from") for n in conv.notes), conv.notes
    with pytest.raises(MegatronArgsError, match="--no-load-optim: folding always restores the optimizer state"):
        convert([*NVIDIA_MIXTRAL_SCRIPT, "--save", "/ckpt", "--load", "/ckpt"], world_size=2)


def test_unsupported_flags_are_refused_by_name():
    p = _run("--tensor-model-parallel-size", "2", "--fp16", "--use-torch-fsdp2", "--moe-token-dispatcher-type", "flex")
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unsupported Megatron-LM flags (no equivalent in folding): ")
    assert "--fp16, --use-torch-fsdp2" in lines[0] and "--moe-token-dispatcher-type flex: no equivalent" in lines[0]
    assert "--tensor-model-parallel-size" not in lines[0]


def test_one_line_and_only_given():
    p = _run("--one-line", "--only-given", "--world-size", "16", "--tensor-model-parallel-size", "2", "--lr", "3e-4")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == (
        "python examples/pretrain_mixtral.py parallel.tp=2 parallel.etp=2 parallel.world_size=16 optim.lr=0.0003"
    )


def test_pipeline_layout_maps_to_its_key():
    """``--pipeline-model-parallel-layout`` becomes ``parallel.pipeline_layout`` (quoted for Hydra; shell-quoted in
    the one-line command) with or without the number of virtual stages, the result composes into a job that
    validates (vpp 4 from 32 stages on PP8), and Megatron-LM's conflicting flags are refused with it."""
    from folding.job.validate import validate_job
    from tests.unit.test_config_job import job

    layout = ["--pipeline-model-parallel-size", "8", "--pipeline-model-parallel-layout", "Et|(tt|)*30mL"]
    sizes = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "64"]
    for extra in ([], ["--num-virtual-stages-per-pipeline-rank", "4"]):
        out = convert([*layout, *sizes, "--expert-tensor-parallel-size", "1", *extra])
        assert "parallel.pipeline_layout='Et|(tt|)*30mL'" in out.overrides
        assert out.values.get("parallel.vpp") == (4 if extra else None)
        j = job("model=deepseek_v3", *out.overrides, "train.global_batch_size=1024", "train.seq_length=4096")
        lay = validate_job(j, world_size=1024)
        assert (lay.pp, lay.vpp, lay.pipeline_layout) == (8, 4, "Et|(tt|)*30mL")
    p = _run("--one-line", "--only-given", *layout)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[-1] == "'parallel.pipeline_layout='\"'\"'Et|(tt|)*30mL'\"'\"''"
    for flag, value in (
        ("--decoder-last-pipeline-num-layers", "1"),
        ("--decoder-first-pipeline-num-layers", "1"),
        ("--num-layers-per-virtual-pipeline-stage", "2"),
    ):
        with pytest.raises(MegatronArgsError, match=f"lists every stage's layers: drop {flag}"):
            convert([*layout, "--num-layers", "61", flag, value])


ARCH = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear"]


def _values(*argv, **kw):
    return convert(list(argv), **kw).values


def test_special_flags_follow_megatron_semantics():
    base = [*ARCH, "--num-experts", "4", "--num-layers", "8", "--pipeline-model-parallel-size", "2"]
    assert _values(*base, "--num-layers-per-virtual-pipeline-stage", "2")["parallel.vpp"] == 2
    with pytest.raises(MegatronArgsError, match="divisible"):
        convert([*base, "--num-layers-per-virtual-pipeline-stage", "3"])
    v = _values("--num-attention-heads", "8", "--num-query-groups", "2")
    assert v["model.num_kv_heads"] == 8  # without --group-query-attention the groups are ignored
    assert (
        _values("--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2")[
            "model.num_kv_heads"
        ]
        == 2
    )
    assert _values("--ffn-hidden-size", "96")["moe.ffn_hidden_size"] == 96
    assert _values("--ffn-hidden-size", "96", "--moe-ffn-hidden-size", "32")["moe.ffn_hidden_size"] == 32
    v = _values("--data-path", "0.3", "/d/a", "0.7", "/d/b", "--split", "969, 30, 1")
    assert v["data.paths"] == ["/d/a", "/d/b"] and v["data.weights"] == [0.3, 0.7] and v["data.split"] == [969, 30, 1]
    assert _values("--train-iters", "1000", "--lr-warmup-fraction", "0.01")["optim.warmup_steps"] == 10
    v = _values("--train-iters", "1000", "--lr-decay-style", "WSD", "--lr-wsd-decay-style", "minus_sqrt",
                "--lr-wsd-decay-iters", "200")  # fmt: skip
    assert (v["optim.decay_style"], v["optim.wsd_decay_shape"], v["optim.wsd_decay_fraction"]) == ("wsd", "sqrt", 0.2)
    assert _values("--recompute-granularity", "full", "--recompute-method", "uniform")["train.recompute"] == "full"
    v = _values("--recompute-activations")
    assert (v["train.recompute"], v["train.recompute_modules"]) == ("none", ["core_attn"])  # selective's default
    v = _values("--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj", "mlp", "moe_act")
    assert (v["train.recompute"], v["train.recompute_modules"]) == ("none", ["mla_up_proj", "mlp", "moe_act"])
    v = _values(*ARCH, "--num-experts", "4", "--num-layers", "8", "--moe-layer-freq", "([0]*3+[1]*5)")
    assert v["model.mlp_only_layers"] == (0, 1, 2)
    v = _values(*ARCH, "--num-experts", "4", "--num-layers", "4", "--moe-layer-freq", "2")
    assert v["model.mlp_only_layers"] == (1, 3)
    v = _values("--fine-grained-activation-offloading", "--offload-modules", "expert_fc1", "moe_act")
    assert v["train.offload_modules"] == ["expert_fc1", "moe_act"]
    assert "train.offload_modules" not in _values("--offload-modules", "expert_fc1")  # ignored without the switch
    v = _values("--seed", "7", "--distributed-timeout-minutes", "2", "--tokenizer-type", "HuggingFaceTokenizer",
                "--tokenizer-model", ROOT, "--save", "/a", "--load", "/b")  # fmt: skip
    assert (v["train.seed"], v["data.seed"], v["train.collective_timeout_s"]) == (7, 7, 120.0)
    assert (v["data.tokenizer"], v["checkpoint.dir"]) == (ROOT, "/a")  # a local path
    assert v["checkpoint.init_from_megatron"] == "/b" and "checkpoint.load" not in v  # Megatron's --load: its weights
    v = _values("--save", "/a", "--load", "/a", "--pretrained-checkpoint", "/p")  # Megatron-LM's fine-tuning habit
    assert (v["checkpoint.dir"], v["checkpoint.init_from_megatron"]) == ("/a", "/p")
    assert _values("--tensor-model-parallel-size", "4", "--expert-model-parallel-size", "2")["parallel.etp"] == 4
    for argv, needle in [
        (["--recompute-granularity", "full", "--recompute-method", "block"], "--recompute-method block"),
        (["--recompute-granularity", "selective", "--recompute-modules", "attention"], "--recompute-modules attention"),
        (["--fine-grained-activation-offloading", "--offload-modules", "router"], "--offload-modules router"),
        ([*ARCH, "--num-experts", "4", "--num-layers", "8", "--moe-layer-freq", "([0]*3+[1]*4)"], "--moe-layer-freq"),
        (["--lr-decay-style", "inverse-square-root"], "inverse-square-root: no equivalent"),
        (["--num-layers", "4", "--num-experts", "4", "--swiglu"], "no --normalization: the model would have LayerNorm"),
        ([*ARCH, "--num-layers", "4"], "no --num-experts"),
        (["--bf16", "true"], "--bf16 takes no value"),
        (["train.steps=3"], "comes before any flag"),
    ]:
        with pytest.raises(MegatronArgsError, match=needle):
            convert(argv)


def test_dropout_and_vocabulary_padding_follow_megatron():
    v = _values("--hidden-dropout", "0.05", "--attention-dropout", "0.0")
    assert (v["model.hidden_dropout"], v["model.attention_dropout"]) == (0.05, 0.0)
    # the padding multiple is N x TP, as Megatron-LM pads: a property of the model here
    v = _values("--make-vocab-size-divisible-by", "64", "--tensor-model-parallel-size", "4")
    assert v["model.make_vocab_size_divisible_by"] == 256
    result = convert([*ARCH, "--num-layers", "2", "--num-experts", "4", "--tensor-model-parallel-size", "2"])
    assert result.values["model.make_vocab_size_divisible_by"] == 256  # Megatron-LM's 128 when absent, x TP2
    assert any("--make-vocab-size-divisible-by 128 (Megatron-LM default) with TP 2" in n for n in result.notes)
    assert "model.make_vocab_size_divisible_by" not in _values("--seed", "1")  # no model defined: nothing padded
    with pytest.raises(MegatronArgsError, match="--hidden-dropout 'x' is not a valid value"):
        convert(["--hidden-dropout", "x"])


def test_activation_fp8_input_store_maps_to_its_key_and_needs_a_recipe():
    from folding.job.config import ConfigError
    from tests.unit.test_config_job import job

    out = convert(["--activation-func-fp8-input-store"])
    assert out.values["moe.fp8_act_input_store"] is True and "moe.fp8_act_input_store=true" in out.overrides
    j = job(*out.overrides, "moe.fp8_recipe=mxfp8", "moe.expert_backend=emulated")
    assert j.model.moe.fp8_act_input_store and j.model.moe.fp8_recipe == "mxfp8"
    with pytest.raises(ConfigError, match="moe.fp8_act_input_store=True: .* moe.fp8_recipe is null"):
        job(*out.overrides)


def test_a_model_without_a_preset_is_named_and_tied_as_megatron_ties():
    argv = [*ARCH, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "4",
            "--ffn-hidden-size", "32", "--vocab-size", "512", "--lr", "1e-3", "--train-iters", "4"]  # fmt: skip
    result = convert(argv, config_dir=os.path.join(ROOT, "configs"))
    v = result.values
    assert result.preset is None and v["model.name"] == "megatron" and v["model.tie_embeddings"] is True
    assert v["model.rope_theta"] == 10000.0 and v["moe.aux_loss_coeff"] == 0.0 and v["moe.dispatcher"] == "allgather"
    assert "moe.topk" not in v  # Megatron-LM's default top-2 is the base preset's already
    assert v["optim.decay_style"] == "linear" and v["optim.warmup_steps"] == 0 and v["logging.interval"] == 100
    # Megatron-LM's dropout (0.1 each) and vocabulary padding (128 x TP) when the command relies on them
    assert v["model.hidden_dropout"] == v["model.attention_dropout"] == 0.1
    assert v["model.make_vocab_size_divisible_by"] == 128
    assert any("model.hidden_dropout" in n for n in result.notes)
    status = cli.check_command_line(
        [*result.overrides, "train.global_batch_size=4", "train.micro_batch_size=1", "train.seq_length=16"],
        config_dir=os.path.join(ROOT, "configs"),
        world_size=1,
    )
    assert status is None  # the converted job validates


def test_the_table_names_real_keys_and_the_docs_list_every_flag():
    keys = set(cli.schema_keys())
    assert {f.key for f in FLAGS.values() if f.key} <= keys
    assert {k for k, _, _ in MEGATRON_DEFAULTS} <= keys
    assert set(leaf_synonyms().values()) <= keys
    doc = open(os.path.join(ROOT, "docs", "megatron.md")).read()
    missing = [flag for flag in FLAGS if f"`{flag}`" not in doc]
    assert not missing, missing
