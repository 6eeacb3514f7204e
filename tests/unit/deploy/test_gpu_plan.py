"""GPU layout planning (deploy.gpus.layout.plan_gpus) and the roles' configs it gives (deploy/plan.py);
the preflight checks are in test_preflight_checks.py.

CPU only: the GPUs are described, never used.
"""

from __future__ import annotations

import dataclasses

import pytest

from deploy.gpus.estimate import DecoderShape, activation_bytes_per_token, learner_need_gib, learner_room_gib
from deploy.gpus.indices import GpuInfo, LayoutError, assign_gpus
from deploy.gpus.layout import GpuPlan, gpu_env, plan_gpus, plan_recompute, plan_reference
from deploy.gpus.packs import fit_pack, largest_pack
from deploy.launcher import task_shorthand
from deploy.plan import CPU_KV_CACHE_GB, LaunchConfig, host_adamw_threads, role_configs
from deploy.preflight import (
    restrict_visible,
)
from runtime.config import load_config


def h200s(n: int, gib: float = 139.8) -> list[GpuInfo]:
    return [GpuInfo(i, i, gib, "NVIDIA H200") for i in range(n)]


def test_no_gpus_is_the_cpu_layout():
    plan = plan_gpus("", "", [])
    assert plan.kind == "cpu" and plan.weight_transport == "broadcast"
    assert plan.learner_gpus == plan.generator_gpus == "" and plan.engines == ()


def test_one_shared_gpu_uses_cuda_ipc_and_splits_memory():
    plan = plan_gpus("0", "0", h200s(1), n_params=200_000_000, gpu_memory_utilization=0.3)
    assert plan.kind == "shared" and plan.weight_transport == "cuda-ipc"
    assert plan.learner_gpus == plan.generator_gpus == "0" and plan.engines == ((0,),)
    assert plan.generator_gib == pytest.approx(0.3 * 139.8)
    assert 0 < plan.learner_gib < 139.8 * 0.7


def test_split_layout_broadcasts_one_engine_per_gpu():
    plan = plan_gpus("0-5", "6-7", h200s(8), n_params=8_300_000_000)
    assert plan.kind == "split" and plan.weight_transport == "broadcast"
    assert plan.learner_gpus == "0,1,2,3,4,5" and plan.generator_gpus == "6,7"
    assert plan.engines == ((6,), (7,))


def test_tensor_parallel_generators_group_their_gpus():
    plan = plan_gpus("0-3", "4-7", h200s(8), tp=2)
    assert plan.engines == ((4, 5), (6, 7))
    with pytest.raises(LayoutError, match="--generator.tp 3 does not divide"):
        plan_gpus("0-3", "4-7", h200s(8), tp=3)


def test_indices_follow_cuda_visible_devices():
    visible = restrict_visible(h200s(8), "4,5,6")
    assert [(g.index, g.physical) for g in visible] == [(0, 4), (1, 5), (2, 6)]
    plan = plan_gpus("0", "1-2", visible)
    assert plan.learner_gpus == "4" and plan.engines == ((5,), (6,))


def test_a_missing_gpu_index_names_the_gpus_there_are():
    with pytest.raises(LayoutError, match=r"GPU index 3 does not exist: this machine shows GPUs 0, 1"):
        plan_gpus("0", "3", h200s(2))
    with pytest.raises(LayoutError, match="shows no GPU"):
        plan_gpus("0", "0", [])


@pytest.mark.parametrize(
    ("learner", "generator"),
    [("0-1", "1-2"), ("0-1", "0-1"), ("0", "0-1")],
)
def test_overlapping_layouts_are_refused(learner, generator):
    with pytest.raises(LayoutError, match="is in both --learner.gpus and --generator.gpus"):
        plan_gpus(learner, generator, h200s(4))


def test_one_side_only_or_garbage_is_refused():
    with pytest.raises(LayoutError, match="--learner.gpus is set but --generator.gpus is not"):
        plan_gpus("0", "", h200s(1))
    with pytest.raises(LayoutError, match="is not a GPU list"):
        plan_gpus("zero", "1", h200s(2))
    with pytest.raises(LayoutError, match="names a GPU twice"):
        plan_gpus("0,0", "1", h200s(2))


def test_a_7b_learner_does_not_fit_next_to_vllm_on_one_gpu():
    with pytest.raises(LayoutError, match=r"learner needs at least .* GiB .* lower --generator.engine"):
        plan_gpus("0", "0", h200s(1), n_params=8_300_000_000, kl=True, gpu_memory_utilization=0.5)
    # sharded over six GPUs it fits, and so do host master weights next to vLLM
    assert plan_gpus("0-5", "6-7", h200s(8), n_params=8_300_000_000, kl=True).kind == "split"
    host = plan_gpus(
        "0", "0", h200s(1), n_params=8_300_000_000, kl=True, gpu_memory_utilization=0.5, master_weights="host"
    )
    assert host.kind == "shared" and host.learner_gib < 0.5 * 139.8


def test_vllm_share_must_hold_the_weights():
    with pytest.raises(LayoutError, match="raise --generator.engine.gpu-memory-utilization"):
        plan_gpus("0-5", "6", h200s(8), n_params=8_300_000_000, gpu_memory_utilization=0.1)


QWEN_7B, QWEN_3B = DecoderShape(28, 3584, 18944), DecoderShape(36, 2048, 11008)
N_7B, N_3B = 8_292_166_656, 3_754_622_976


def test_activation_estimate_matches_the_h200_calibration():
    # selective checkpointing, per token of a training pack: measured 2.2 MB at 3B and 2.5-2.7 MB at 7B
    assert activation_bytes_per_token(QWEN_3B, True, "selective") == pytest.approx(2.2e6, rel=0.02)
    assert activation_bytes_per_token(QWEN_7B, True, "selective:20") == pytest.approx(3.0e6, rel=0.02)
    full = activation_bytes_per_token(QWEN_7B, True, "full")
    kept = activation_bytes_per_token(QWEN_7B, False, "selective")
    assert full < activation_bytes_per_token(QWEN_7B, True, "selective") < kept
    assert activation_bytes_per_token(None, True, "selective") == 0.0


def _shared_h200(n_params, shape, pack_tokens, util=0.3):
    return plan_gpus(
        "0",
        "0",
        h200s(1, 140.4),
        n_params=n_params,
        kl=True,
        master_weights="auto",
        gpu_memory_utilization=util,
        pack_tokens=pack_tokens,
        token_bytes=activation_bytes_per_token(shape, True, "selective"),
    )


def test_a_shared_gpu_caps_the_packs_that_do_not_fit():
    # 7B beside vLLM at 0.3 of one H200: 16k packs ran out of memory there, 8k ran (docs/benchmarks.md)
    plan = _shared_h200(N_7B, QWEN_7B, 16384)
    assert plan.pack_tokens == 8192 and plan.pack_capped_from == 16384
    assert "training packs capped at 8192 tokens (the config's 16384" in plan.describe()
    assert _shared_h200(N_7B, QWEN_7B, 4096).pack_tokens == 4096  # a smaller pack is kept as it is
    # 3B: 16k packs ran beside vLLM; the config's size stays and the plan says nothing of it
    three = _shared_h200(N_3B, QWEN_3B, 16384)
    assert (three.pack_tokens, three.pack_capped_from) == (16384, 0) and "capped" not in three.describe()
    with pytest.raises(LayoutError, match=r"too little for the activations of a 1024-token training pack"):
        _shared_h200(N_7B, QWEN_7B, 16384, util=0.5)
    # without a shape (or a config pack size) nothing is capped
    assert (
        plan_gpus(
            "0",
            "0",
            h200s(1),
            n_params=N_7B,
            kl=True,
            master_weights="auto",
            gpu_memory_utilization=0.3,
            pack_tokens=16384,
        ).pack_tokens
        == 16384
    )


def test_the_layout_steps_alone_index_checks_memory_estimate_and_pack_fitting():
    sides = assign_gpus("1", "0", restrict_visible(h200s(4), "2,3"))
    assert (
        sides.kind == "split" and [g.physical for g in sides.learner] == [3] and sides.memory_gib() == 139.8
    )
    assert assign_gpus("", "", []).kind == "cpu"
    # a shared GPU also holds the CUDA-IPC buffer (2 bytes a parameter) and leaves vLLM its share + overhead
    split = learner_need_gib(
        N_7B, 1, False, kl=False, master_weights="host", reference="device", params_in_buffer=False
    )
    shared = learner_need_gib(
        N_7B, 1, True, kl=False, master_weights="host", reference="device", params_in_buffer=False
    )
    assert shared - split == pytest.approx(2 * N_7B / 2**30)
    assert learner_room_gib(80.0, 24.0, shared=True) == pytest.approx(80.0 - 24.0 - 4.7)
    assert learner_room_gib(80.0, 24.0, shared=False) == 80.0
    # packs: the largest power of two beside the no-grad margin; the config's size when it fits
    assert largest_pack(4.0 + 3 * 2**10 / 2**30 * 1e6, 1e6) == 2048
    assert fit_pack(16384, 1e6, 100.0, "fix") == 16384 and fit_pack(16384, 0.0, 1.0, "fix") == 16384
    with pytest.raises(LayoutError, match="1024-token training pack .*: fix it"):
        fit_pack(16384, 1e6, 4.5, "fix it")


def _auto(
    n_params,
    shape,
    gpus,
    learner="0",
    generator="0",
    pack_tokens=16384,
    checkpointing=True,
    in_buffer=False,
    reference="device",
):
    return plan_recompute(
        "auto",
        shape,
        checkpointing,
        pack_tokens,
        32768,
        learner_gpus=learner,
        generator_gpus=generator,
        visible=gpus,
        n_params=n_params,
        kl=True,
        master_weights="auto",
        gpu_memory_utilization=0.3,
        params_in_buffer=in_buffer,
        reference=reference,
    )


def test_auto_recomputation_is_selective_where_the_packs_fit_and_full_where_they_would_be_capped():
    h100 = [GpuInfo(0, 0, 79.6, "NVIDIA H100 80GB HBM3")]
    # 3B beside vLLM: selective fits the config's 16k on an H200; on an H100 it would be capped at 8k, and
    # full recomputation runs the no-grad packs' 32k instead
    plan = _auto(N_3B, QWEN_3B, h200s(1))
    assert (plan.checkpoint_mode, plan.pack_tokens, plan.pack_capped_from) == ("selective", 16384, 0)
    plan = _auto(N_3B, QWEN_3B, h100)
    assert (plan.checkpoint_mode, plan.pack_tokens, plan.pack_capped_from) == ("full", 32768, 0)
    assert "full recomputation at 32768-token training packs (checkpoint_mode auto)" in plan.describe()
    # 7B beside vLLM on an H200: selective would be capped at 8k (16k ran out of memory, 2026-12-05)
    assert _auto(N_7B, QWEN_7B, h200s(1)).checkpoint_mode == "full"
    # a learner on GPUs of its own keeps selective at the config's packs
    plan = _auto(N_7B, QWEN_7B, h200s(2), learner="0", generator="1")
    assert (plan.checkpoint_mode, plan.pack_tokens) == ("selective", 16384)
    # an explicit mode is the config's own, planned as before
    explicit = plan_recompute(
        "selective", QWEN_3B, True, 16384, 32768, learner_gpus="0", generator_gpus="0", visible=h100,
        n_params=N_3B, kl=True, master_weights="auto", gpu_memory_utilization=0.3,
    )  # fmt: skip
    assert (explicit.checkpoint_mode, explicit.pack_tokens, explicit.pack_capped_from) == ("", 8192, 16384)
    # on CPU nothing is planned: the learner runs selective at its config's packs
    assert _auto(N_3B, QWEN_3B, [], learner="", generator="").checkpoint_mode == "selective"


def test_parameters_in_the_weight_buffer_leave_the_learner_a_copy_of_the_weights_more():
    h100 = [GpuInfo(0, 0, 79.6, "NVIDIA H100 80GB HBM3")]
    apart, inside = _auto(N_7B, QWEN_7B, h200s(1)), _auto(N_7B, QWEN_7B, h200s(1), in_buffer=True)
    assert apart.learner_gib - inside.learner_gib == pytest.approx(2 * N_7B / 2**30)
    # 7B on an H200: still full recomputation at 32k (selective's 16k would need 45.8 GiB of the 41.4 left)
    assert (inside.checkpoint_mode, inside.pack_tokens) == ("full", 32768)
    # 7B on an 80 GB GPU beside vLLM at 0.3 (and its engine's 4.7 GiB beyond that): the states fit now, but
    # no training pack does (out of memory at 8k packs before the engine's overhead was counted, 2026-12-06)
    with pytest.raises(LayoutError, match="the learner needs at least 63.3 GiB per GPU"):
        _auto(N_7B, QWEN_7B, h100)
    with pytest.raises(LayoutError, match="too little for the activations of a 1024-token training pack"):
        _auto(N_7B, QWEN_7B, h100, in_buffer=True)
    # fp32 parameters on the device (master weights "device") cannot live in a bf16 buffer: no saving
    kwargs = dict(n_params=N_7B, kl=True, master_weights="device", gpu_memory_utilization=0.3)
    device = [plan_gpus("0", "0", h200s(1, 400.0), params_in_buffer=b, **kwargs) for b in (False, True)]
    assert device[0].learner_gib == device[1].learner_gib
    # and a split layout has no buffer on the learner's GPUs to begin with
    split = [plan_gpus("0", "1", h200s(2), params_in_buffer=b, n_params=N_7B) for b in (False, True)]
    assert split[0].learner_gib == split[1].learner_gib


def test_auto_puts_the_reference_model_in_host_memory_only_where_the_learner_does_not_fit_otherwise():
    h100 = [GpuInfo(0, 0, 79.6, "NVIDIA H100 80GB HBM3")]

    def layout(gpus):
        return lambda reference: _auto(N_7B, QWEN_7B, gpus, in_buffer=True, reference=reference)

    # 7B beside vLLM on an 80 GB card: with the reference on the GPU no training pack fits (out of memory,
    # 2026-12-06); in host memory the GPU keeps its embeddings, lm_head and the blocks in flight
    host = plan_reference("auto", True, layout(h100))
    on_device = _auto(N_7B, QWEN_7B, h200s(1), in_buffer=True)
    assert host.reference_location == "host"
    assert on_device.learner_gib - host.learner_gib == pytest.approx(0.8 * 2 * N_7B / 2**30)
    assert (host.checkpoint_mode, host.pack_tokens) == ("full", 16384)  # 32k would not fit beside vLLM
    assert "the KL reference model in host memory (reference_location auto)" in host.describe()
    # where it fits (an H200), it stays on the GPU; an explicit location is the config's own
    assert plan_reference("auto", True, layout(h200s(1))).reference_location == "device"
    assert plan_reference("host", True, layout(h200s(1))).reference_location == ""
    with pytest.raises(
        LayoutError, match=r"the KL reference model too \(--learner.parallel.reference-location"
    ):
        plan_reference("device", True, layout(h100))
    # without a KL term there is no reference model to place
    assert plan_reference("auto", False, layout(h200s(1))).reference_location == ""


def test_role_configs_run_the_layouts_reference_location():
    cfg = LaunchConfig()
    plan = GpuPlan("shared", "0", "0", ((0,),), "cuda-ipc", reference_location="host")
    learner = role_configs(cfg, _p("/r"), _p("/m"), _p("/d"), "zmq://x:1", "ns", gpus=plan)["learner"]
    assert learner.parallel.reference_location == "host"
    plan = dataclasses.replace(plan, reference_location="")
    kept = role_configs(cfg, _p("/r"), _p("/m"), _p("/d"), "zmq://x:1", "ns", gpus=plan)
    assert kept["learner"].parallel.reference_location == cfg.learner.parallel.reference_location == "auto"


def test_role_configs_run_the_layouts_recomputation_and_packs():
    cfg = LaunchConfig()
    cfg.learner.parallel.checkpoint_mode = "auto"
    cfg.learner.batching.max_tokens_per_microbatch = 16384
    plan = GpuPlan("shared", "0", "0", ((0,),), "cuda-ipc", pack_tokens=32768, checkpoint_mode="full")
    learner = role_configs(cfg, _p("/r"), _p("/m"), _p("/d"), "zmq://x:1", "ns", gpus=plan)["learner"]
    assert learner.parallel.checkpoint_mode == "full" and learner.batching.max_tokens_per_microbatch == 32768
    learner.validate()
    cpu = role_configs(cfg, _p("/r"), _p("/m"), _p("/d"), "zmq://x:1", "ns", gpus=_auto(0, None, [], "", ""))
    assert cpu["learner"].parallel.checkpoint_mode == "selective"
    assert cpu["learner"].batching.max_tokens_per_microbatch == 16384


def test_the_host_adamw_leaves_the_other_roles_their_cpus(monkeypatch):
    # 16 CPUs, 4 reward workers, one vLLM engine: 16 - 4 - 2 - 2 (broker, the learner's own thread)
    assert host_adamw_threads(4, 1, cpus=16) == 8
    assert host_adamw_threads(4, 2, cpus=8) == 1  # never fewer than one
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    cfg = LaunchConfig()
    cfg.reward.workers = 4
    plan = GpuPlan("shared", "0", "0", ((0,),), "cuda-ipc")
    assert (
        role_configs(cfg, _p("/r"), _p("/m"), _p("/d"), "zmq://x:1", "ns", gpus=plan)[
            "learner"
        ].optim.host_threads
        == 8
    )
    cfg.learner.optim.host_threads = 12  # the config's own count stands
    assert (
        role_configs(cfg, _p("/r"), _p("/m"), _p("/d"), "zmq://x:1", "ns", gpus=plan)[
            "learner"
        ].optim.host_threads
        == 12
    )
    cfg.learner.optim.host_threads = 0  # on CPU the update shares the model's memory: nothing to plan
    cpu = role_configs(cfg, _p("/r"), _p("/m"), _p("/d"), "zmq://x:1", "ns", gpus=_auto(0, None, [], "", ""))
    assert cpu["learner"].optim.host_threads == 0


def test_role_configs_run_the_capped_pack_size():
    cfg = LaunchConfig()
    cfg.learner.batching.max_tokens_per_microbatch = 16384
    plan = _shared_h200(N_7B, QWEN_7B, 16384)
    configs = role_configs(cfg, _p("/r"), _p("/m"), _p("/d"), "zmq://x:1", "ns", gpus=plan)
    assert configs["learner"].batching.max_tokens_per_microbatch == 8192
    uncapped = GpuPlan("shared", "0", "0", ((0,),), "cuda-ipc", pack_tokens=16384)
    configs = role_configs(cfg, _p("/r"), _p("/m"), _p("/d"), "zmq://x:1", "ns", gpus=uncapped)
    assert configs["learner"].batching.max_tokens_per_microbatch == 16384


def test_role_configs_take_the_plan():
    cfg = LaunchConfig()
    plan = GpuPlan("shared", "0", "0", ((0,),), "cuda-ipc")
    configs = role_configs(
        cfg, _p("/r"), _p("/m"), _p("/d/train"), "zmq://x:1", "ns", test_dir=_p("/d/test"), gpus=plan
    )
    learner, generator = configs["learner"], configs["generator"]
    assert learner.gpus == generator.gpus == "0"
    assert _transport(learner) == "cuda-ipc"
    assert learner.feeder.train_data == "/d/train" and learner.feeder.test_data == "/d/test"
    cfg.learner = _with_transport(cfg.learner, "cuda-ipc")
    with pytest.raises(LayoutError, match="needs the learner and the generator on one shared GPU"):
        role_configs(
            cfg,
            _p("/r"),
            _p("/m"),
            _p("/d"),
            "zmq://x:1",
            "ns",
            gpus=GpuPlan("split", "0", "1", ((1,),), "broadcast"),
        )


def test_gpu_env_keeps_what_the_user_set():
    env = gpu_env({"NCCL_NVLS_ENABLE": "1"})
    assert "NCCL_NVLS_ENABLE" not in env and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


def test_task_shorthand():
    assert task_shorthand(["--task", "geometry3k", "--task.data-dir", "D"]) == [
        "--task.task",
        "geometry3k",
        "--task.data-dir",
        "D",
    ]
    assert task_shorthand(["--task=count"]) == ["--task.task=count"]


def _p(s):
    from pathlib import Path

    return Path(s)


def _transport(learner):
    from deploy.plan import weight_transport_of

    return weight_transport_of(learner)


def _with_transport(learner, name):
    import dataclasses

    from weights.config import SENDER_TRANSPORTS

    section = getattr(learner, "weight_sync", None)
    if dataclasses.is_dataclass(section):
        transport = SENDER_TRANSPORTS[name]()
        return dataclasses.replace(learner, weight_sync=dataclasses.replace(section, transport=transport))
    return dataclasses.replace(learner, weight_transport=name)


def test_the_kv_cache_is_cpu_sized_only_on_cpu():
    """The demo's 0.25 GiB KV cache leaked into GPU runs (the reference config does not set it): vLLM
    then held 7,280 tokens, 8 of the reference workload's sequences at once. A GPU layout derives it
    from gpu_memory_utilization; a size the config sets is kept."""
    gpu = GpuPlan("shared", "0", "0", ((0,),), "cuda-ipc")
    engines = {}
    for name, plan in (("cpu", GpuPlan("cpu", "", "", (), "broadcast")), ("gpu", gpu)):
        configs = role_configs(LaunchConfig(), _p("/r"), _p("/m"), _p("/d"), "zmq://x:1", "ns", gpus=plan)
        engines[name] = configs["generator"].engine
    assert engines["cpu"].kv_cache_gb == CPU_KV_CACHE_GB and engines["gpu"].kv_cache_gb == 0.0
    reference = load_config(LaunchConfig, ["--config", "deploy/configs/qwen2_5_vl_7b_geometry3k.toml"])
    configs = role_configs(reference, _p("/r"), _p("/m"), _p("/d"), "redis://x:1", "ns", gpus=gpu)
    assert configs["generator"].engine.kv_cache_gb == 0.0
    reference.generator.engine.kv_cache_gb = 4.0
    configs = role_configs(reference, _p("/r"), _p("/m"), _p("/d"), "redis://x:1", "ns", gpus=gpu)
    assert configs["generator"].engine.kv_cache_gb == 4.0


def test_the_lora_config_fits_7b_beside_vllm_on_one_80gb_gpu():
    """With LoRA the base is bf16 and frozen: the one-GPU LoRA config plans where the full fine-tune at that
    share of the GPU would not fit its states."""
    from deploy.plan import gpu_plan

    h100 = [GpuInfo(0, 0, 79.6, "NVIDIA H100 80GB HBM3")]
    lora = load_config(LaunchConfig, ["--config", "deploy/configs/qwen2_5_vl_7b_geometry3k_lora.toml"])
    plan = gpu_plan(lora, h100, n_params=N_7B, shape=QWEN_7B)
    assert plan.kind == "shared" and plan.weight_transport == "cuda-ipc"
    full = dataclasses.replace(
        lora, learner=dataclasses.replace(lora.learner, lora=type(lora.learner.lora)())
    )
    full.learner.optim.master_weights = "params"
    with pytest.raises(LayoutError):
        gpu_plan(full, h100, n_params=N_7B, shape=QWEN_7B)
