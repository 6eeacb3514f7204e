"""bench.e2e's GPU runs, checked on CPU: their launcher flags parse into the launcher's config, plan a shared
H200 that fits at 3B and 7B, and the per-step metrics give the reported row.

CPU only: the GPU is described, never used.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bench.e2e import BenchConfig, gpu_args, launcher_args, main
from bench.e2e_rows import format_table, measure, reference
from deploy.gpus.estimate import DecoderShape, learner_memory_gib
from deploy.gpus.indices import GpuInfo
from deploy.plan import LaunchConfig, gpu_plan, shared_transport_of
from runtime.config import load_config

H200 = [GpuInfo(0, 0, 139.8, "NVIDIA H200")]
N_PARAMS = {"3b": 3_754_622_976, "7b": 8_292_166_656}  # Qwen2.5-VL-3B / -7B, vision tower included
SHAPES = {"3b": DecoderShape(36, 2048, 11008), "7b": DecoderShape(28, 3584, 18944)}


def launch_config(model: str, k: int, **bench) -> LaunchConfig:
    cfg = BenchConfig(device="cuda", model=model, **bench)
    return load_config(LaunchConfig, gpu_args(cfg, k, model="/models/" + model))


@pytest.mark.parametrize("model", ["3b", "7b"])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_gpu_flags_parse_into_the_reference_shapes(model, k):
    cfg = launch_config(model, k)
    assert cfg.broker == "zmq" and cfg.learner.gpus == cfg.generator.gpus == "0"
    assert cfg.learner.algo.max_staleness == k and cfg.learner.algo.groups_per_step == 128
    # the algorithm as the reference config has it (what a user runs): updates of 128 prompts (one a step
    # here; the config's 512-prompt steps make four), pi_prox recomputed after a step's first update
    assert cfg.learner.algo.mini_batches == 1 and cfg.learner.algo.proximal == "recompute"
    reference_config = load_config(LaunchConfig, ["--config", "deploy/configs/qwen2_5_vl_7b_geometry3k.toml"])
    algo = reference_config.learner.algo
    assert algo.groups_per_step // algo.mini_batches == 128
    assert launch_config(model, k, prompts=512).learner.algo.mini_batches == 4
    assert not cfg.learner.algo.dynamic_sampling and cfg.learner.loss.kl_coef > 0
    sampling = cfg.generator.sampling
    assert sampling.n == 5 and sampling.max_tokens == sampling.min_tokens == 512
    assert cfg.task.task == "colour" and cfg.task.image_size == 448
    assert cfg.task.train >= 128 * (cfg.learner.max_steps + k)  # enough prompts for every step and the lead
    assert cfg.learner.metrics.port == cfg.generator.metrics.port == cfg.reward.metrics.port == 0


def test_a_failed_process_ends_the_row_rather_than_restarting(tmp_path):
    for device in ("cuda", "cpu"):
        cfg = BenchConfig(device=device, model="3b")
        args = launcher_args(cfg, 1, Path("/models/3b"), tmp_path / "run")
        assert load_config(LaunchConfig, args).max_restarts == 0


def test_a_step_holds_whole_updates():
    with pytest.raises(SystemExit, match="multiple of --prompts-per-update"):
        main(["--device", "cuda", "--prompts", "100"])  # before anything is built


@pytest.mark.parametrize("model", ["3b", "7b"])
def test_gpu_flags_plan_one_shared_h200_that_fits(model):
    cfg = launch_config(model, 1)
    plan = gpu_plan(cfg, H200, N_PARAMS[model], SHAPES[model])
    assert plan.kind == "shared" and plan.weight_transport == "cuda-ipc"
    # the config's 16k packs and checkpoint_mode auto: selective's would be capped at 8k for the 7B beside
    # vLLM (16k ran out of memory there on an H200), so it runs full recomputation at 32k; the 3B keeps
    # selective at 16k
    assert cfg.learner.batching.max_tokens_per_microbatch == 16384
    assert cfg.learner.parallel.checkpoint_mode == "auto"
    want = {"3b": (16384, "selective"), "7b": (32768, "full")}[model]
    assert (plan.pack_tokens, plan.checkpoint_mode) == want
    # one GPU: the fp32 master weights and AdamW states live in host memory (bf16 weights + grads +
    # reference); the bf16 weights are the CUDA-IPC buffer the generator maps
    # (weight_sync.transport.params_in_buffer)
    assert shared_transport_of(cfg.learner).params_in_buffer
    assert plan.learner_gib == pytest.approx(learner_memory_gib(N_PARAMS[model], 1, True, "host"))
    assert plan.learner_gib + plan.generator_gib < 139.8


def test_gpu_flags_plan_the_7b_on_an_80_gb_card_with_its_reference_in_host_memory():
    h100 = [GpuInfo(0, 0, 79.6, "NVIDIA H100 80GB HBM3")]
    seven = gpu_plan(launch_config("7b", 1), h100, N_PARAMS["7b"], SHAPES["7b"])
    assert (seven.reference_location, seven.checkpoint_mode, seven.pack_tokens) == ("host", "full", 16384)
    # the 3B fits with its reference on the GPU (full recomputation at 32k, as measured on H100s)
    three = gpu_plan(launch_config("3b", 1), h100, N_PARAMS["3b"], SHAPES["3b"])
    assert (three.reference_location, three.checkpoint_mode, three.pack_tokens) == ("device", "full", 32768)


def test_measure_times_the_steps_after_the_warmup():
    lines = [{"step": 0, "time": 0.0}]  # a metrics line without groups (e.g. an evaluation) is not a step
    for i in range(1, 4):
        peak = 50.0 + i if i > 1 else 99.0  # the warm-up step's peak is not the measured steps'
        lines.append(
            {
                "groups": 128,
                "time": 10.0 * i,
                "tokens": 1000.0,
                "train_s": 6.0,
                "train_pass_s": 4.25,
                "optimizer_exposed_s": 0.75,
                "train_pass_mfu": 0.375,
                "wait_s": 4.0,
                "gpu_peak_gb": peak,
                "generate_s": 3.0 * i,
                "generate_calls": float(i),
                "mismatch_kl": 0.001 * i,
                "mismatch_abs_logprob_diff": 0.5 if i == 2 else 0.01,
            }
        )
    row = measure(lines, k=1, warmup=1, gpus=1)
    # the worst measured step's disagreement of vLLM's logprobs with the learner's, in the row and table
    assert (row["mismatch_kl"], row["mismatch_abs_logprob_diff"]) == (0.003, 0.5)
    assert " 0.5000" in format_table([row | {"sync_s": 0.0}])
    # generate_s adds up the calls a step's groups came from: the row says how many (steps 2 and 3: 2.5)
    assert (row["generate_s"], row["generate_calls"]) == (7.5, 2.5)
    assert row["steps"] == 2 and row["wall_s"] == pytest.approx(20.0)
    assert row["learner_gpu_peak_gb"] == pytest.approx(53.0)
    assert row["tokens_per_s_per_gpu"] == pytest.approx(100.0) and row["train_s"] == pytest.approx(6.0)
    assert (row["train_pass_s"], row["optimizer_exposed_s"], row["train_pass_mfu"]) == (4.25, 0.75, 0.375)
    assert " 4.25 " in format_table([row | {"sync_s": 0.0, "generate_s": 1.0}]).splitlines()[2]
    assert "37.5%" in format_table([row | {"sync_s": 0.0, "generate_s": 1.0}])
    flags = "--learner.optim.host-threads 16"  # rows that differ only in --extra are told apart
    assert format_table([row | {"sync_s": 0.0, "generate_s": 1.0, "extra": flags}]).endswith(f" {flags}")
    with pytest.raises(RuntimeError, match="only 0 measured steps"):
        measure(lines[:2], k=1, warmup=1)


def test_mps_runs_are_marked_and_never_the_reference():
    assert launch_config("3b", 1, mps=True).mps and not launch_config("3b", 1).mps
    rows = [
        {"k": 0, "mode": "batch", "mps": True, "steps_per_s": 2.0},
        {"k": 0, "mode": "batch", "mps": False, "steps_per_s": 1.0},
        {"k": 1, "mode": "batch", "mps": True, "steps_per_s": 3.0},
    ]
    assert reference(rows) is rows[1]
    assert "batch+mps" in format_table([{**r, "error": "cut"} | {"steps_per_s": 0} for r in rows])


def test_a_generator_cap_under_mps_reaches_the_launcher_and_the_row():
    assert launch_config("7b", 1, mps=True, mps_generator_sms=40).mps_generator_sms == 40
    assert launch_config("7b", 1, mps=True).mps_generator_sms == 100
    assert launch_config("7b", 1, mps_generator_sms=40).mps_generator_sms == 100  # without --mps: no cap
    row = {"k": 1, "mode": "batch", "mps": True, "mps_generator_sms": 40, "steps_per_s": 0, "error": "cut"}
    assert "batch+mps40" in format_table([row])


def test_a_lower_generator_priority_under_mps_reaches_the_launcher_and_the_row():
    low = {"mps_generator_priority": "below-normal"}
    assert launch_config("3b", 1, mps=True, **low).mps_generator_priority == "below-normal"
    assert launch_config("3b", 1, **low).mps_generator_priority == "normal"  # without --mps: not passed
    row = {"k": 1, "mode": "batch", "mps": True, "steps_per_s": 0, "error": "cut", **low}
    assert "batch+mps-low" in format_table([row])
    assert "batch+mps " in format_table([{**row, "mps_generator_priority": "normal"}])


def write_run(run_dir, launcher: str = "", **logs: str):
    """A run directory as the launcher leaves it: its own log (if `launcher`) and `logs/<role>.log`."""
    (run_dir / "logs").mkdir(parents=True)
    if launcher:
        run_dir.with_suffix(".log").write_text(launcher)
    for role, text in logs.items():
        (run_dir / "logs" / f"{role}.log").write_text(text)
    return run_dir


def test_a_failed_run_carries_the_tails_of_its_logs(tmp_path):
    from bench.e2e_rows import log_tails, run_logs

    run_dir = write_run(
        tmp_path / "k1-batch",
        "[launcher] learner exited with code 1\n",
        learner="".join(f"line {i}\n" for i in range(100)) + "CUDA OOM\n",
    )
    tails = log_tails(run_logs(run_dir), lines=3)
    assert tails == {
        "k1-batch.log": "[launcher] learner exited with code 1",
        "learner.log": "line 98\nline 99\nCUDA OOM",
    }
    assert log_tails(run_logs(tmp_path / "never-started")) == {}


def test_every_run_keeps_the_log_lines_an_analysis_needs(tmp_path):
    from bench.e2e_rows import log_facts, run_logs

    run_dir = write_run(
        tmp_path / "k1-batch",
        generator="INFO noise\n"
        "INFO [gpu_worker.py:1] Available KV cache memory: 33.33 GiB\n"
        "INFO [kv_cache_utils.py:2] GPU KV cache size: 970,736 tokens\n"
        "INFO generator.engine: vLLM engine for /m ready in 104.8 s (gpu)\n"
        + "INFO generator.engine: serving policy version 9 (weights loaded in 0.075 s)\n"
        * 50,
    )
    facts = log_facts(run_logs(run_dir))
    assert facts == {
        "generator.log": [
            "INFO [gpu_worker.py:1] Available KV cache memory: 33.33 GiB",
            "INFO [kv_cache_utils.py:2] GPU KV cache size: 970,736 tokens",
            "INFO generator.engine: vLLM engine for /m ready in 104.8 s (gpu)",
        ]
    }  # not the fiftieth version served


def test_a_run_out_of_gpu_memory_is_told_from_other_failures(tmp_path):
    from bench.e2e_rows import ran_out_of_memory, run_logs

    died = "[launcher] learner exited with code 1\n"
    oom = write_run(
        tmp_path / "k1-batch",
        died,
        learner="step 0\n" * 500
        + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
        + "x\n" * 100,  # far above the tail a row carries
    )
    other = write_run(tmp_path / "k0-batch", died, learner="RuntimeError: the broker went away\n")
    assert ran_out_of_memory(run_logs(oom)) and not ran_out_of_memory(run_logs(other))
    assert not ran_out_of_memory(run_logs(tmp_path / "never-started"))


def test_a_failed_row_names_the_exception_each_process_ended_with(tmp_path):
    from bench.e2e_rows import raised, run_logs

    run_dir = write_run(
        tmp_path / "k1-batch-mps40",
        learner="[rank0]: RuntimeError: the learner trained no step: (640 nonfinite)\n"
        "--- supervisor: restart 1/3\n"
        "[rank0]: RuntimeError: the learner trained no step: (1280 nonfinite)\n",
        generator="worker.EngineOutputError: vLLM returned NaN\nbye\n",
        reward="INFO all fine\n",
    )
    assert raised(run_logs(run_dir)) == (
        "generator.log: EngineOutputError: vLLM returned NaN"
        " | learner.log: RuntimeError: the learner trained no step: (1280 nonfinite)"
    )
    assert raised(run_logs(tmp_path / "never-started")) == ""


STUCK_LAUNCHER = """
import json, signal, subprocess, sys, time
child = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a role in its own session
open(sys.argv[1], "w").write(json.dumps({"generator": child.pid}))
print(child.pid, flush=True)
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a launcher that does not stop
time.sleep(60)
"""


def test_a_launcher_that_does_not_stop_is_killed_with_the_children_it_names(tmp_path, monkeypatch):
    """Past its timeout and the grace after SIGINT, the launcher and every process group of its pids.json
    are killed: an orphaned vLLM would hold the GPU memory the next run asks for."""
    import sys

    import bench.e2e as e2e

    monkeypatch.setattr(e2e, "STOP_GRACE_S", 0.5)
    pids, log = tmp_path / "pids.json", tmp_path / "launcher.log"
    argv = [sys.executable, "-c", STUCK_LAUNCHER, str(pids)]
    with pytest.raises(RuntimeError, match="timed out"):
        e2e.run(argv, log, timeout_s=3.0, pids=pids)
    child = int(log.read_text().split()[0])
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (killed, not yet reaped by its parent) is not alive
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_merge_keeps_where_the_rows_ran(tmp_path):
    """Merged files describe the GPU machine the runs had, not the machine that merged them."""
    import json

    parts = []
    for k, steps_per_s in ((0, 0.010), (1, 0.012)):
        part = tmp_path / f"k{k}.json"
        row = {"k": k, "steps_per_s": steps_per_s, "step_s": 1 / steps_per_s, "wait_s": 0.0, "train_s": 1.0}
        row |= {"sync_s": 0.0, "generate_s": 1.0, "staleness": float(k)}
        gpu = {"cpus": 16, "platform": "gpu-host", "gpu": "NVIDIA H100 80GB HBM3"}
        report = {"date": f"2026-12-0{k + 1}", "machine": gpu, "config": {"device": "cuda"}, "results": [row]}
        part.write_text(json.dumps({**report, "command": f"python -m bench.e2e --ks {k}"}))
        parts.append(str(part))
    out = tmp_path / "merged.json"
    assert main(["--merge", *parts, "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["machine"]["platform"] == "gpu-host" and merged["date"] == "2026-12-01"
    assert merged["gpu"] == "NVIDIA H100 80GB HBM3" and "GPU" in merged["note"]
    assert merged["command"][:2] == ["python -m bench.e2e --ks 0", "python -m bench.e2e --ks 1"]
    assert merged["command"][2].startswith("python -m bench.e2e --merge")
    assert merged["results"][1]["speedup_vs_k0"] == pytest.approx(1.2)


H100 = [GpuInfo(0, 0, 79.6, "NVIDIA H100 80GB HBM3")]


@pytest.mark.parametrize(
    ("mode", "asked", "runs", "planned"),
    [
        ("selective", 8192, 8192, ""),
        ("full", 32768, 32768, ""),
        ("selective", 32768, 8192, ""),
        ("auto", 0, 32768, "full"),
        ("", 0, 32768, "full"),  # the config's own: auto
        ("", 8192, 8192, "selective"),  # auto keeps selective where the packs asked for fit
    ],
)
def test_full_recomputation_lets_the_3b_run_larger_packs_beside_vllm_on_an_h100(mode, asked, runs, planned):
    """The 3B on an H100: selective recomputation fits 8k packs beside vLLM at 0.3 of the card (larger ones
    are capped), full recomputation fits 32k, and auto (the config's) picks full at 32k for its 16k."""
    cfg = launch_config("3b", 1, micro_tokens=asked, checkpoint_mode=mode)
    assert cfg.learner.parallel.checkpoint_mode == (mode or "auto")
    plan = gpu_plan(cfg, H100, N_PARAMS["3b"], SHAPES["3b"])
    assert (plan.pack_tokens, plan.checkpoint_mode) == (runs, planned)


def test_a_row_says_what_packs_and_recomputation_the_learner_ran(tmp_path):
    import json

    from bench.e2e_rows import learner_facts, learner_label

    assert learner_facts(tmp_path) == {}  # a run that never started its learner
    (tmp_path / "learner").mkdir()
    config = {
        "batching": {"max_tokens_per_microbatch": 32768},
        "parallel": {"activation_checkpointing": True, "checkpoint_mode": "full", "compile": "elementwise"},
        "optim": {"host_threads": 8},
    }
    (tmp_path / "learner" / "config.learner.json").write_text(json.dumps(config))
    facts = learner_facts(tmp_path)
    assert facts == {
        "learner_pack_tokens": 32768,
        "learner_checkpoint_mode": "full",
        "learner_compile": "elementwise",
        "learner_host_threads": 8,
        "learner_reference_location": "device",  # a config from before the field reads as the device
        "learner_defer_update": False,  # as it ran before the field
    }
    assert learner_label(facts) == "32k full"
    assert learner_label({"learner_pack_tokens": 8192, "learner_checkpoint_mode": "selective"}) == "8k sel"
    config["parallel"]["activation_checkpointing"] = False
    (tmp_path / "learner" / "config.learner.json").write_text(json.dumps(config))
    assert learner_label(learner_facts(tmp_path)) == "32k none"
    assert learner_label({}) == ""
    host = {
        "learner_pack_tokens": 16384,
        "learner_checkpoint_mode": "full",
        "learner_reference_location": "host",
    }
    assert learner_label(host) == "16k full ref@host"


def test_the_extra_flag_keeps_the_weight_copy_apart():
    # the extra flags below are the A/B against the default (e2e_3b_1gpu.json)
    extra = (
        "--learner.weight-sync.transport.type cuda-ipc --learner.weight-sync.transport.no-params-in-buffer"
    )
    cfg = BenchConfig(device="cuda", model="3b", extra=extra)
    args = launcher_args(cfg, 1, Path("/models/3b"), Path("/tmp/run"))
    assert not shared_transport_of(load_config(LaunchConfig, args).learner).params_in_buffer
    assert shared_transport_of(launch_config("3b", 1).learner).params_in_buffer


def test_sharing_is_the_work_both_did_while_they_shared_the_gpu():
    """A 7B pair on an H100 by hand (2026-12-06): K = 0 81.9 s a step (train 61.7, generate 18.9); K = 1 under
    MPS trained 74.8 s beside 32.5 s of generation: the learner lost 13.1 s, so it got 60 % of its solo speed
    in the window, the generator 58 %, 1.18 GPUs of work from one; the reference row's bound is its step
    over its train time."""
    from bench.e2e_rows import sharing

    k0 = {"k": 0, "steps_per_s": 1 / 81.9, "step_s": 81.9, "train_s": 61.7, "generate_s": 18.9}
    k1 = {"k": 1, "steps_per_s": 1 / 75.3, "step_s": 75.3, "train_s": 74.8, "generate_s": 32.5}
    assert sharing(k0, k0) == {"overlap_bound": pytest.approx(81.9 / 61.7)}
    share = sharing(k1, k0)
    assert share["learner_slowdown_s"] == pytest.approx(13.1)
    assert share["shared_gpus"] == pytest.approx((1 - 13.1 / 32.5) + 18.9 / 32.5)
    assert 1.17 < share["shared_gpus"] < 1.19
    assert sharing({**k1, "steps_per_s": 0.0}, k0) == {} and sharing({**k1, "generate_s": 0.0}, k0) == {}
    assert "1.18" in format_table(
        [
            k0 | {"wait_s": 20.2, "sync_s": 0.0, "staleness": 0.0},
            k1 | {"wait_s": 0.5, "sync_s": 0.0, "staleness": 1.0},
        ]
    )
