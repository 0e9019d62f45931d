"""``checkpoint.init_from_hf`` before any process group: a model that is not the source's fails with
every mismatching key and the overrides that fix it; a missing path or one combined with
``checkpoint.load`` is refused; the ``tools/convert_hf.py import`` file fills a model exactly as the
Hugging Face directory does (the distributed test trains from both)."""

import dataclasses

import pytest
import torch

from folding.checkpoint.from_hf import check_init_source, load_initial_weights
from folding.job.config import CheckpointConfig, ConfigError, JobConfig
from folding.job.validate import validate_job
from folding.model.presets import get_preset
from folding.moe.settings import LayerSettings
from folding.training.trainer import prepare
from tests.hf_checks import TRAINABLE_MIXTRAL as HF
from tests.hf_checks import TRAINABLE_MIXTRAL_PRESET as MODEL
from tests.hf_checks import randomized
from tests.optional import require

transformers = require("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf") / "mixtral")
    randomized(transformers.MixtralForCausalLM(transformers.MixtralConfig(**HF))).save_pretrained(path)
    return path


def _job(source, load=None, **model):
    return JobConfig(
        model=get_preset("mixtral_tiny", **{**MODEL, **model}),
        checkpoint=CheckpointConfig(init_from_hf=source, load=load),
    )


def test_matching_model_is_accepted_and_chosen(hf_dir):
    prep = prepare(_job(hf_dir), world_size=1, rank=0)
    assert prep.init_from_hf == hf_dir and prep.resume is None


def test_another_model_names_every_key_and_the_fix(hf_dir):
    job = _job(hf_dir, hidden_size=64, moe=dict(num_experts=8, ffn_hidden_size=16, topk=2))
    with pytest.raises(ConfigError) as e:
        prepare(job, world_size=1, rank=0)
    msg = str(e.value)
    assert "model.hidden_size: source 32, this job 64" in msg and "moe.num_experts: source 4, this job 8" in msg
    assert "Set model.hidden_size=32 moe.num_experts=4 (the source's values)" in msg, msg
    # routing that differs from the source's is refused too; training options are free
    with pytest.raises(ConfigError, match="moe.topk: source 2, this job 3"):
        check_init_source(hf_dir, _job(hf_dir, moe=dict(num_experts=4, ffn_hidden_size=16, topk=3)).model)
    free = _job(hf_dir, init_std=0.5, moe=dict(num_experts=4, ffn_hidden_size=16, aux_loss_coeff=0.1))
    assert check_init_source(hf_dir, free.model) == hf_dir
    # the context length is checked: the run's export writes it into config.json
    longer = _job(hf_dir, max_position_embeddings=HF["max_position_embeddings"] * 2)
    with pytest.raises(ConfigError) as e:
        check_init_source(hf_dir, longer.model)
    n = HF["max_position_embeddings"]
    assert f"model.max_position_embeddings: source {n}, this job {2 * n}" in str(e.value)
    assert f"Set model.max_position_embeddings={n} (the source's values)" in str(e.value)


def test_missing_source_and_load_together_are_refused(hf_dir, tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.init_from_hf=.*does not exist"):
        validate_job(_job(str(tmp_path / "nowhere")), world_size=1)
    with pytest.raises(ConfigError, match="checkpoint.init_from_hf=.*and checkpoint.load=.*both choose"):
        validate_job(_job(hf_dir, load=hf_dir), world_size=1)
    foreign = tmp_path / "notes.pt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    with pytest.raises(ConfigError, match="tools/convert_hf.py import"):
        prepare(_job(str(foreign)), world_size=1, rank=0)


def test_import_file_fills_the_model_like_the_directory(hf_dir, tmp_path):
    from folding.model.hf.weights import from_hf
    from folding.model.transformer import MoETransformer
    from tools import convert_hf

    pt = str(tmp_path / "engine.pt")
    assert convert_hf.main(["import", hf_dir, pt]) == 0
    job = _job(pt)
    assert prepare(job, world_size=1, rank=0).init_from_hf == pt
    model = MoETransformer(job.model, settings=LayerSettings(init_seed=5))
    load_initial_weights([model], pt)
    want = dict(from_hf(hf_dir).named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name
    with pytest.raises(ConfigError, match="model.num_layers: source 2, this job 3"):
        check_init_source(pt, dataclasses.replace(job.model, num_layers=3))


def test_weights_from_hf_get_a_fine_tuning_rate(hf_dir):
    """The demo's optim.lr (1.5e-3, for a random start of mixtral_tiny) is not applied to weights from Hugging
    Face: a job from checkpoint.init_from_hf that leaves optim.lr null fine-tunes at 1e-5 (min_lr lr/5) and a
    start-up line says so; a rate the job sets (command line, recipe) is kept and the line says that."""
    from folding.job.config import job_config_from_dict
    from folding.launch.model_from_hf import resolve_from_hf
    from tests.unit.test_config_job import compose_tree

    def job(*overrides):
        return job_config_from_dict(resolve_from_hf(compose_tree(*overrides)))

    scratch = job()
    assert (scratch.optim.lr, scratch.optim.min_lr) == (1.5e-3, 3e-4)
    assert not [n for n in scratch.notes if n.startswith("optim.lr")]
    for model in ("model=from_hf", "model=mixtral_tiny"):
        tuned = job(model, f"checkpoint.init_from_hf={hf_dir}")
        assert (tuned.optim.lr, tuned.optim.min_lr) == (1e-5, 2e-6), model
        assert [n for n in tuned.notes if n.startswith("optim.lr")] == [
            "optim.lr: 1e-05 (the fine-tuning default for weights from checkpoint.init_from_hf; from scratch it "
            "would be 0.0015; set optim.lr to choose), optim.min_lr 2e-06 (optim.lr / 5)"
        ]
    chosen = job("model=from_hf", f"checkpoint.init_from_hf={hf_dir}", "optim.lr=3e-5")
    assert (chosen.optim.lr, chosen.optim.min_lr) == (3e-5, 6e-6)
    assert (
        "optim.lr: 3e-05 (set by the job; for weights from checkpoint.init_from_hf the default is 1e-05)"
        in (chosen.notes[-1])
    )
    recipe = job("recipes=mixtral_8x7b", f"checkpoint.init_from_hf={hf_dir}")
    assert (recipe.optim.lr, recipe.optim.min_lr) == (1e-4, 1e-5)
