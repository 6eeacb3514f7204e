"""The Learner end to end on the tiny model with a real Redis: steps, filters, acks, metrics."""

import dataclasses
import json
import logging
import time

import pytest
import torch

import broker
from broker import codec
from broker.channel import Publisher
from broker.images import ImageStore
from broker.names import Names
from learner.trainer import Learner
from learner.wiring import NullSender
from tests.support.learner import learner_config
from tests.unit.learner.groups import make_group, set_token


def _cfg(tiny_model_dir, redis_server, names, run_dir, **kw):
    defaults = {
        "algo.groups_per_step": 2,
        "optim.lr": 1e-3,
        "checkpoint.every": 1,
        "batching.max_tokens_per_microbatch": 160,
        "parallel.activation_checkpointing": True,
    }
    return learner_config(tiny_model_dir, redis_server, names, run_dir, **(defaults | kw))


class CallOrder(NullSender):
    """A NullSender that records the order of the learner's calls."""

    def __init__(self):
        self.calls = []

    def begin_write(self) -> float:
        self.calls.append("begin_write")
        return 0.0

    def sync(self, model, version: int, step: int = 0):
        self.calls.append("sync")


def _lose_image(scored):
    from broker.schemas import ImageRef

    scored.group.images = [ImageRef(sha256="0" * 64, width=56, height=56)]


def _drop_image(scored):
    scored.group.images = scored.group.images[:1]


def _lines(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_learner_trains_filters_and_acks(tiny_model_dir, redis_server, names, publish, tmp_path):
    cfg = _cfg(tiny_model_dir, redis_server, names, tmp_path)
    publish([1.0, 0.0, 0.5], seed=1)
    publish([0.3, 0.3, 0.3], seed=2)  # zero variance: skipped
    dup = publish([0.0, 1.0], seed=3, image=False)  # text-only group
    publish([0.0, 1.0], seed=3, group_id=dup.group.group_id)  # redelivered id: skipped
    publish([1.0, 0.0], seed=4, version=0)  # step 1 trains at step 1: staleness 1 (kept, K = 1)
    publish([0.0, 1.0, 1.0], seed=5, temperature=0.7)  # wrong temperature: dead-lettered
    publish([1.0, 0.0], seed=7, mutate=lambda g: set_token(g, sample=0, index=0, token=10**6))  # OOV
    publish([0.0, 1.0], seed=8, mutate=_lose_image)  # image not in the blob store: dead-lettered
    publish([1.0, 0.0], seed=9, n_images=2, mutate=_drop_image)  # 2 image pads, 1 image: dead-lettered
    publish([1.0, 0.0], seed=6, n_images=2)  # two images per sample
    sender = CallOrder()
    learner = Learner(cfg, sender=sender)
    before = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    learner.train()
    assert learner.state.step == 2 and learner.state.version == 2
    assert sender.calls == ["begin_write", "sync"] * 2  # AdamW's writes announced before each sync
    after = learner.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    skipped = learner.inbox.skipped
    assert skipped["zero_variance"] == 1 and skipped["duplicate"] == 1 and skipped["malformed"] == 4
    assert len(learner.inbox.consumed) == 9
    version = codec.decode(learner.transport.get_value(learner.names.learner_version))
    assert version.version == 2 and version.source == "learner"
    lines = _lines(tmp_path)
    assert [x["step"] for x in lines] == [1.0, 2.0]
    for key in (
        "mismatch_kl",
        "clipped_frac",
        "masked_frac",
        "entropy",
        "grad_norm",
        "reward_mean",
        "accuracy",
        "tokens_per_s",
        "mfu",
        "optimizer_copy_wait_s",  # a host-memory AdamW's copy waits (0 here: no GPU to copy from)
    ):
        assert key in lines[0], key
    assert lines[0]["mismatch_kl"] > 0  # behaviour logprobs were made up: the learner disagrees
    # Step 1 runs version 0's weights and every group was sampled at version 0: all of it is fresh, so
    # the engine-mismatch KL is the behaviour KL; step 2 (version 1) has no version-1 sample.
    assert lines[0]["fresh_tokens"] > 0
    assert lines[0]["mismatch_kl_fresh"] == pytest.approx(lines[0]["mismatch_kl"], rel=1e-4)
    assert lines[1]["fresh_tokens"] == 0 and "mismatch_kl_fresh" not in lines[1]  # NaN: left out of the line
    # acked once a second checkpoint holds them (keep 2, learner/inbox.py): step 2's groups wait
    assert learner.transport.pending(names.scored, Names.LEARNER) == 2
    learner.close()
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    hist = learner.registry.get_sample_value("parallax_learner_staleness_count")
    assert hist == 9.0  # every sample of the trained groups observed once (3 + 2, then 2 + 2)


def test_a_run_whose_every_group_is_rejected_fails_naming_why(
    tiny_model_dir, redis_server, names, publish, tmp_path, caplog
):
    # e.g. a generator that samples at another temperature: the learner trains nothing and must not end
    # as if its data had simply run out, without a word
    cfg = _cfg(tiny_model_dir, redis_server, names, tmp_path, idle_exit_s=1.0)
    for seed in (1, 2, 3):
        publish([1.0, 0.0], seed=seed, temperature=0.7)
    publish([0.5, 0.5], seed=4)  # zero variance: a routine skip, logged at INFO
    learner = Learner(cfg, sender=NullSender())
    with caplog.at_level(logging.INFO, logger="learner"):
        with pytest.raises(
            RuntimeError, match=r"trained no step.*3 malformed \(first: group .*temperature 0.7"
        ):
            learner.train()
    learner.close()
    warned = [
        r for r in caplog.records if r.levelno == logging.WARNING and "skipped a group" in r.getMessage()
    ]
    assert len(warned) == 1 and "(malformed)" in warned[0].getMessage()  # the first of its kind, once
    assert any("(zero_variance)" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    assert learner.state.step == 0


def test_a_run_of_uniform_groups_ends_with_a_warning_not_an_error(
    tiny_model_dir, redis_server, names, publish, tmp_path, caplog
):
    cfg = _cfg(tiny_model_dir, redis_server, names, tmp_path, idle_exit_s=1.0)
    publish([0.5, 0.5], seed=1)
    learner = Learner(cfg, sender=NullSender())
    with caplog.at_level(logging.WARNING, logger="learner"):
        learner.train()  # dynamic sampling skipped everything: nothing broken, nothing to train
    learner.close()
    assert learner.state.step == 0
    assert any("after 0 steps of this run (1 zero_variance" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("every", [100, 0])  # 0: only at the end
def test_learner_checkpoints_before_its_held_acks_fill_the_scored_stream(
    tiny_model_dir, redis_server, names, publish, tmp_path, every
):
    """Acks wait for a checkpoint, and the broker counts unacked entries against max_len: a learner
    holding them for `checkpoint.every` steps would block its reward service and then starve (a GPU
    run stopped at step 312 of 32 groups, 10,000 unacked). It checkpoints once half of max_len waits (a
    quarter while acks lag one checkpoint)."""
    cfg = _cfg(tiny_model_dir, redis_server, names, tmp_path, **{"checkpoint.every": every})
    for seed in range(4):
        publish([1.0, 0.0], seed=seed)
    learner = Learner(cfg, sender=NullSender())
    learner.transport.options = dataclasses.replace(learner.transport.options, max_len=4)
    learner.train()
    assert learner.state.step == 2
    checkpointed = [x.get("checkpoint_s", 0.0) > 0 for x in _lines(tmp_path)]
    assert checkpointed == [True, True]  # 2 groups a step: a quarter of max_len 4 (acks lag) after each
    assert learner.transport.pending(names.scored, Names.LEARNER) == 2  # half of max_len: never more
    learner.close()


def test_the_first_mini_batch_takes_pi_prox_from_its_own_forward(
    tiny_model_dir, redis_server, names, publish, tmp_path, monkeypatch
):
    """proximal = recompute: the no-grad pass runs over the mini-batches after the first; the first trains
    at the weights that define pi_prox, so its proximal logprobs are its own forward's, which equal a
    no-grad recompute at those weights (fp32)."""
    import learner.update as update

    cfg = _cfg(tiny_model_dir, redis_server, names, tmp_path, max_steps=1)
    cfg.algo.mini_batches, cfg.algo.proximal, cfg.algo.groups_per_step = 2, "recompute", 4
    for seed in range(4):
        publish([1.0, 0.0], seed=seed)
    learner = Learner(cfg, sender=NullSender())
    passes, pending, compared = [], [], []
    updater = learner.updater
    no_grad_pass, micro_step, loss = updater.no_grad_pass, updater.micro_step, update.policy_loss

    def record_pass(plans, module, attr):
        passes.append((attr, len(plans)))
        no_grad_pass(plans, module, attr)

    def check_micro_step(mb, denom, weights, first_update):
        if first_update and mb is not None:
            assert mb.proximal_logprobs is None  # no recompute for the first mini-batch
            with torch.no_grad():
                pending.append(updater.forward(learner.model, mb)[0])
        micro_step(mb, denom, weights, first_update)

    def capture_loss(config, batch, denom):
        if pending:  # the loss of a first-update micro-batch: its pi_prox against the recompute
            torch.testing.assert_close(batch.proximal_logprobs, pending.pop(), rtol=0, atol=1e-6)
            compared.append(True)
        return loss(config, batch, denom)

    monkeypatch.setattr(updater, "no_grad_pass", record_pass)
    monkeypatch.setattr(updater, "micro_step", check_micro_step)
    monkeypatch.setattr(update, "policy_loss", capture_loss)
    learner.train()
    assert learner.state.step == 1
    assert passes == [("proximal_logprobs", 1)]  # the second of two mini-batches only
    assert compared and not pending  # every first-update micro-batch was compared
    learner.close()


def test_samples_beyond_the_staleness_bound_are_dropped(
    tiny_model_dir, redis_server, names, publish, tmp_path, caplog
):
    cfg = _cfg(tiny_model_dir, redis_server, names, tmp_path, **{"algo.max_staleness": 0})
    for seed in range(4):
        publish([1.0, 0.0], seed=seed, version=0)  # all sampled at version 0; step 2 trains at version 1
    with caplog.at_level(logging.INFO, logger="learner.trainer"):
        learner = Learner(cfg, sender=NullSender())
    ready = [r.getMessage() for r in caplog.records if "learner ready in" in r.getMessage()]
    phases = (
        "model",
        "parallelism and reference",
        "optimizer",
        "broker and sender",
        "resume",
    )  # where a start-up's time goes
    assert len(ready) == 1 and all(f"{name} " in ready[0] for name in phases), ready
    learner.train()
    lines = _lines(tmp_path)
    assert [x["stale_samples"] for x in lines] == [0.0, 4.0]
    assert lines[0]["samples"] == 4.0 and lines[1]["samples"] == 0.0
    assert learner.state.step == 2
    learner.close()


def test_killed_learner_restarts_with_the_same_consumed_ids(
    tiny_model_dir, redis_server, names, publish, tmp_path
):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    sent = [publish([1.0, 0.0], seed=i).group.group_id for i in range(6)]  # three steps' worth
    cmd = [
        sys.executable,
        "-m",
        "learner",
        "--model",
        str(tiny_model_dir),
        "--broker.url",
        redis_server.url,
        "--broker.namespace",
        names.namespace,
        "--run-dir",
        str(tmp_path),
        "--weight-sync.no-enabled",
        "--max-steps",
        "100",
        "--idle-exit-s",
        "120",
        "--broker.claim-idle-s",
        "1",
        "--checkpoint.every",
        "2",
        "--algo.groups-per-step",
        "2",
        "--batching.max-tokens-per-microbatch",
        "160",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 90
        while not ((tmp_path / "metrics.jsonl").is_file() and len(_lines(tmp_path)) >= 3):
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the learner did not reach step 3"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    ckpt = json.loads((tmp_path / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert ckpt["step"] == 2 and len(ckpt["consumed"]) == 4 and set(ckpt["consumed"]) < set(sent)
    assert not (tmp_path / "checkpoints" / "step-00000003").exists()  # step 3 died with the process

    announced = codec.decode(broker.connect(redis_server.url).get_value(names.learner_version))
    assert announced.version == 3  # version 3 was published, then lost with the process
    # one group sampled by the lost version 3, one by the restored weights (announced as version 4)
    sent += [publish([0.0, 1.0], seed=10 + i, version=3 + i).group.group_id for i in range(2)]
    cfg = _cfg(
        tiny_model_dir,
        redis_server,
        names,
        tmp_path,
        max_steps=4,
        idle_exit_s=20.0,
        **{"checkpoint.every": 2, "broker.claim_idle_s": 1.0},
    )
    learner = Learner(cfg, sender=NullSender())
    assert learner.state.step == 2 and learner.inbox.consumed == set(ckpt["consumed"])
    assert learner.state.version == 4 and learner.state.extra["lost_versions"] == [[3, 3]]
    learner.train()  # step 3 again (re-delivered groups) and step 4 (new ones)
    assert learner.state.step == 4
    last = _lines(tmp_path)[-1]  # step 4 at version 5: the lost version's samples are stale, not fresh
    assert last["stale_samples"] == 2.0 and last["samples"] == 2.0
    assert all(x["staleness_max"] >= 0 for x in _lines(tmp_path) if "staleness_max" in x)
    assert learner.inbox.consumed == set(sent)
    assert learner.inbox.skipped["duplicate"] == 0  # nothing trained twice
    # acks lag one checkpoint (keep 2): the restarted learner checkpointed once (step 4), so all 8 groups,
    # steps 1-2's redelivered among them, wait for the next one; a fallback to step 2 would lose none
    assert learner.transport.pending(names.scored, Names.LEARNER) == 8
    learner.close()
    final = json.loads((tmp_path / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    assert sorted(final["consumed"]) == sorted(sent)


MODEL_CLASS = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}
"""The transformers class the learner must build for each family (config.json model_type)."""
MOVED = {
    "qwen2_5_vl": ("visual.blocks.0.", "language_model.layers.0.", "lm_head"),
    "qwen3_vl": (
        "visual.blocks.0.",
        "visual.deepstack_merger_list.0.",
        "language_model.layers.0.",
        "lm_head",
    ),
}
"""Parameters two steps must move in each family: vision tower, decoder, head (Qwen3-VL: DeepStack too)."""


def test_each_step_reaches_a_generator_bit_for_bit(
    family_model_dir, family_processor, redis_server, names, tmp_path
):
    """Each family (read from its config.json, nothing to choose) trains on groups of one and two images
    per prompt, and the learner's real weight sender gets every version to a receiver joining through the
    broker, bit for bit, under the family's names and layouts."""
    import weights
    from policy.loading import load_model
    from weights.follow import broker_resolver
    from weights.manifest import module_loader

    family = json.loads((family_model_dir / "config.json").read_text())["model_type"]
    cfg = _cfg(
        family_model_dir,
        redis_server,
        names,
        tmp_path,
        max_steps=2,
        weight_sync=weights.WeightSenderConfig(timeout_s=20.0),
    )
    transport = broker.connect(redis_server.url)
    publisher, store = Publisher(transport, names.scored), ImageStore(transport, names)
    for seed in range(4):  # one and two images per prompt
        group = make_group(family_processor, store, [1.0, 0.0, 0.5], seed=seed, n_images=1 + seed % 2)
        publisher.publish(group)
    learner = Learner(cfg)  # builds the weight sender and announces its rendezvous on the broker
    assert type(learner.hf).__name__ == MODEL_CLASS[family]
    before = {k: v.detach().clone() for k, v in learner.hf.state_dict().items()}
    replica = load_model(family_model_dir)
    receiver = weights.receiver(
        weights.WeightReceiverConfig(timeout_s=20.0),
        "gen-test",
        apply=module_loader(replica),
        resolve=broker_resolver(transport, names),
    ).start()
    try:
        deadline = time.monotonic() + 20
        while not learner.sender.members() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert learner.sender.members(), "the receiver did not join"
        learner.train()
        assert learner.state.step == 2
        assert receiver.wait_for(2, timeout_s=20)
        mine, theirs = learner.hf.state_dict(), replica.state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        assert receiver.stats.history[-2:] == [1, 2]
        moved = {k for k in before if not torch.equal(before[k], mine[k])}
        for part in MOVED[family]:
            assert any(part in k for k in moved), part
    finally:
        receiver.close()
        transport.close()
        learner.close()


def test_host_master_weights_train_bf16_parameters_and_resume(
    tiny_model_dir, redis_server, names, publish, tmp_path
):
    """optim.master_weights = host: bf16 parameters, fp32 master copy and moments in host memory; the
    parameters are the master rounded, and a restarted learner resumes the fp32 master from its checkpoint."""
    cfg = _cfg(tiny_model_dir, redis_server, names, tmp_path, **{"optim.master_weights": "host"})
    cfg.max_steps = 1
    for seed in range(2):
        publish([1.0, 0.0], seed=seed, image=False)
    learner = Learner(cfg, sender=NullSender())
    assert learner.master_weights == "host" and learner.param_dtype == torch.bfloat16
    params = [p for p in learner.model.parameters() if p.requires_grad]
    assert all(p.dtype == torch.bfloat16 for p in params)
    start = [learner.optimizer.state[p]["master"].clone() for p in params]
    learner.train()
    assert learner.state.step == 1
    masters = [learner.optimizer.state[p]["master"] for p in params]
    assert all(m.dtype == torch.float32 for m in masters)
    assert any(not torch.equal(a, b) for a, b in zip(start, masters))
    assert all(torch.equal(p.detach(), m.to(torch.bfloat16)) for p, m in zip(params, masters))
    saved = [m.clone() for m in masters]
    learner.close()
    resumed = Learner(cfg, sender=NullSender())
    assert resumed.state.step == 1
    again = [resumed.optimizer.state[p]["master"] for p in resumed.model.parameters() if p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(saved, again))
    resumed.close()


def test_the_kl_pass_beside_the_host_adamw_changes_nothing(
    tiny_model_dir, redis_server, names, publish, tmp_path, monkeypatch
):
    """overlap_ref (on for host-memory AdamW on a GPU; forced here): each later mini-batch's reference pass
    runs while the previous update's AdamW runs in a thread. Same groups, same result as the passes one
    after the other: the fp32 master weights and the step's metrics agree."""
    import learner.update as update

    kw = {"optim.master_weights": "host", "loss.kl_coef": 0.1, "algo.mini_batches": 3}
    kw |= {"algo.groups_per_step": 6, "algo.proximal": "recompute"}
    for seed in range(6):
        publish([1.0, 0.0] if seed % 2 else [0.0, 1.0], seed=seed)
    learners = [
        Learner(_cfg(tiny_model_dir, redis_server, names, tmp_path / name, **kw), sender=NullSender())
        for name in ("apart", "beside")
    ]
    apart, beside = learners
    for learner in learners:
        learner.peak_flops = 1e12  # a made-up peak: CPUs have none, so their MFU is 0
    beside.updater.overlap_ref = True
    assert not apart.updater.overlap_ref  # a CPU learner: off by default
    groups = apart._next_groups()
    assert groups and len(groups) == 6
    works, step_beside = [], update.step_beside

    def record(optimizer, work=None):
        works.append(work is not None)
        return step_beside(optimizer, work)

    monkeypatch.setattr(update, "step_beside", record)
    values = [learner.train_step(groups) for learner in learners]
    assert works == [False] * 3 + [True, True, False]  # apart, then beside: updates 0 and 1 carry a KL pass
    for a, b in zip(apart.model.parameters(), beside.model.parameters()):
        ma, mb = apart.optimizer.state[a]["master"], beside.optimizer.state[b]["master"]
        torch.testing.assert_close(mb, ma, rtol=0, atol=1e-6)
    for key in ("kl_ref", "ratio_mean", "clipped_frac", "grad_norm", "tokens"):
        assert values[1][key] == pytest.approx(values[0][key], rel=1e-5), key
    for v in values:  # the split of the step's time: disjoint parts of it
        parts = ("train_pass_s", "proximal_pass_s", "ref_pass_s", "optimizer_exposed_s")
        assert all(v[key] > 0 for key in parts) and sum(v[key] for key in parts) <= v["train_s"]
        assert v["mfu"] > 0 and v["train_pass_mfu"] == pytest.approx(
            v["mfu"] * v["train_s"] / v["train_pass_s"]
        )
    assert values[0]["optimizer_exposed_s"] == pytest.approx(
        values[0]["optimizer_s"], abs=0.05
    )  # nothing beside
    for learner in learners:
        learner.close()
