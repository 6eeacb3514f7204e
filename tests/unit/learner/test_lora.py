"""LoRA on the learner (tiny model, real Redis): settings refused by name, only the adapter trained,
checkpointed and resumed, resume refused across LoRA and full weights, the PEFT-format export."""

import json

import pytest
import torch

from learner.config import LearnerConfig
from learner.lora_config import LoraConfig
from learner.trainer import Learner
from runtime.config import ConfigError, validate
from tests.unit.learner.test_trainer import CallOrder, _cfg


def _lora_cfg(tiny_model_dir, redis_server, names, run_dir, rank=4, **kw):
    cfg = _cfg(tiny_model_dir, redis_server, names, run_dir, **kw)
    cfg.lora = LoraConfig(rank=rank, alpha=8.0)
    cfg.weight_sync.enabled = True  # the guard is on; the sender is a stand-in
    return cfg


def test_negative_rank_and_missing_targets_are_refused(tiny_model):
    from learner.lora import target_regex

    cfg = LearnerConfig(model="m")
    cfg.lora.rank = -1
    with pytest.raises(ConfigError, match="lora.rank must be >= 0"):
        validate(cfg)
    with pytest.raises(ValueError, match=r"no linear layer \['w_proj'\]"):
        target_regex(tiny_model, LoraConfig(rank=4, target_modules=["q_proj", "w_proj"]))
    with pytest.raises(ValueError, match="vision tower has no linear layer"):
        target_regex(tiny_model, LoraConfig(rank=4, vision=True, vision_target_modules=["nope"]))


def test_targets_default_to_the_language_model(tiny_model_dir):
    from learner.lora import add_adapter
    from policy.loading import load_model

    model = load_model(tiny_model_dir)
    add_adapter(model, LoraConfig(rank=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n and "language_model" in n for n in trainable)
    assert {n.split(".lora_")[0].rpartition(".")[2] for n in trainable} == set(LoraConfig().target_modules)
    vision = load_model(tiny_model_dir)
    add_adapter(vision, LoraConfig(rank=4, vision=True))
    assert any("visual" in n for n, p in vision.named_parameters() if p.requires_grad)


def test_lora_trains_the_adapter_alone_and_resumes(tiny_model_dir, redis_server, names, publish, tmp_path):
    cfg = _lora_cfg(tiny_model_dir, redis_server, names, tmp_path)
    for seed in range(4):
        publish([1.0, 0.0, 0.5], seed=seed)
    learner = Learner(cfg, sender=CallOrder())
    before = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    learner.train()
    assert learner.state.step == 2
    after = learner.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".lora_B." in k or ".lora_A." in k for k in changed)
    opt_params = [p for g in learner.optimizer.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in opt_params)
    assert len(opt_params) == sum(".lora_" in k for k in before)
    ckpt = learner.checkpointer.latest()
    from safetensors.torch import load_file

    saved = load_file(str(ckpt / "model.safetensors"))
    assert saved and all(".lora_" in k for k in saved)
    assert all(".lora_" in k.split("/")[0] for k in load_file(str(ckpt / "optim.safetensors")))
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["extra"]["lora"]["rank"] == 4 and state["extra"]["adapter_digests"]["2"]
    learner.close()
    exported = tmp_path / "hf"
    assert {p.name for p in exported.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}

    resumed = Learner(cfg, sender=CallOrder())
    assert resumed.state.step == 2
    for k, v in resumed.model.state_dict().items():
        assert torch.equal(v, after[k]), k
    assert resumed.guard.published[2] == learner.guard.published[2]
    resumed.close()

    with pytest.raises(ValueError, match="resume it with --lora.rank 4"):
        Learner(_cfg(tiny_model_dir, redis_server, names, tmp_path), sender=CallOrder())
    with pytest.raises(ValueError, match="asks for"):
        Learner(_lora_cfg(tiny_model_dir, redis_server, names, tmp_path, rank=8), sender=CallOrder())


def test_full_checkpoint_is_not_resumed_with_lora(tiny_model_dir, redis_server, names, publish, tmp_path):
    publish([1.0, 0.0], seed=1)
    publish([0.0, 1.0], seed=2)
    full = Learner(_cfg(tiny_model_dir, redis_server, names, tmp_path, max_steps=1))
    full.train()
    full.close()
    with pytest.raises(ValueError, match="holds full weights"):
        Learner(_lora_cfg(tiny_model_dir, redis_server, names, tmp_path), sender=CallOrder())


def test_export_loads_in_peft_and_merges(tiny_model_dir, redis_server, names, tmp_path, tiny_processor):
    from peft import PeftModel

    from policy.loading import load_model

    cfg = _lora_cfg(tiny_model_dir, redis_server, names, tmp_path)
    cfg.lora.export_merged = True
    learner = Learner(cfg, sender=CallOrder())
    with torch.no_grad():  # a trained adapter: B away from zero
        for name, p in learner.hf.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    learner._export()
    ids = torch.tensor([tiny_processor.tokenizer("the answer is 42")["input_ids"]])
    learner.hf.eval()
    with torch.no_grad():
        want = learner.hf(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(load_model(tiny_model_dir), str(tmp_path / "hf")).eval()
        merged = load_model(tmp_path / "hf-merged")
        assert torch.allclose(loaded(input_ids=ids).logits, want, atol=1e-5)
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-4)
        base = load_model(tiny_model_dir)(input_ids=ids).logits
    assert not torch.allclose(base, want, atol=1e-3)
    learner.close()


def test_fsdp2_sharded_lora_step_equals_one_process(tiny_model_dir, tmp_path):
    """Two gloo ranks shard the adapted model with FSDP2 (fp32 adapter, frozen base) and take the same step
    as one process; the exported adapters agree."""
    import multiprocessing as mp
    import socket

    from safetensors.torch import load_file

    from tests.unit.learner.lora_procs import lora_step

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    args = [(str(tiny_model_dir), str(tmp_path / "fsdp"), r, 2, port) for r in range(2)]
    ranks = [ctx.Process(target=lora_step, args=a, daemon=True) for a in args]
    for p in ranks:
        p.start()
    lora_step(str(tiny_model_dir), str(tmp_path / "one"))
    for p in ranks:
        p.join(timeout=180)
    assert [p.exitcode for p in ranks] == [0, 0]
    sharded = load_file(str(tmp_path / "fsdp" / "adapter_model.safetensors"))
    single = load_file(str(tmp_path / "one" / "adapter_model.safetensors"))
    assert sharded.keys() == single.keys() and len(single) > 10
    for name, tensor in single.items():
        assert torch.allclose(sharded[name], tensor, atol=1e-6), name
    b_name, b = next((n, t) for n, t in single.items() if ".lora_B." in n)
    start = torch.linspace(-0.05, 0.05, b.numel()).reshape(b.shape)
    assert (b - start).abs().max() > 1e-3, b_name  # the step moved the adapter
