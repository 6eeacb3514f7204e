"""AdamW for bf16 parameters with fp32 master weights and moments, on the device or in host memory.

    optimizer = MasterAdamW(model.parameters(), lr=1e-6, location="host")   # bf16 params on the GPU
    loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)

The model's parameters and gradients are bf16 (what the forward and backward use); the optimizer
owns an fp32 copy of every parameter (the master weights) and fp32 AdamW moments, and applies
each update to the master copy, then rounds it into the bf16 parameter. That keeps updates far
below bf16's resolution (lr 1e-6 on weights of ~0.02 is ~2^-14 relative; bf16 keeps 8 bits)
from being rounded away, as they are when AdamW runs on bf16 parameters directly.

`location` = "device": master weights and moments beside the parameters (12 bytes/parameter on
the GPU). "host": in host memory (pageable), so the GPU holds only bf16 parameters and gradients
(4 bytes/parameter); a step streams the parameters in chunks of `chunk` elements through a ring
of pinned bf16 staging buffers: gradient chunk to host (one CUDA stream), torch's fused AdamW
on the CPU's fp32 chunk (on `host_threads` threads, default every usable CPU, whatever the
process's own thread count), the rounded bf16 chunk back to the GPU (a second stream), so both
copy directions overlap the CPU's work on the neighbouring chunks. On a CPU model both locations
are the same memory. Only the staging ring is pinned (a few hundred MB):
torch's pinned allocator rounds every block up to a power of two, which would turn ~100 GB of
fp32 states for 7B into far more pinned memory than the host has.

`step_beside(optimizer, work)` runs a host-memory step in a thread while `work` (GPU work that reads none
of the parameters, e.g. the KL reference pass of the next mini-batch) runs in the calling thread on the
same stream: the GPU computes while the CPU updates. The step's copies wait for an event recorded before
`work` starts, not for the stream's tail, so they do not wait for `work`.

State per parameter (what checkpoints hold): "step", "master", "exp_avg", "exp_avg_sq", fp32,
shaped like the parameter. `load_state_dict` keeps them fp32 on their location (torch's default
would cast them to the parameter's bf16); a checkpoint without "master" (saved by fp32-parameter
training) starts the master copy from the loaded parameters.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch

from runtime.hostmem import check_host_memory

LOCATIONS = ("device", "host")
_FP32_KEYS = ("master", "exp_avg", "exp_avg_sq")


class MasterAdamW(torch.optim.Optimizer):
    """See the module docstring. Parameters must be contiguous; DTensors update their local shard."""

    def __init__(
        self,
        params,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        location: str = "host",
        chunk: int = 1 << 25,
        staging: int = 4,
        host_threads: int = 0,
    ):
        if location not in LOCATIONS:
            raise ValueError(f"location must be one of {LOCATIONS}, not {location!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.location = location
        self.chunk = int(chunk)
        self._ring = None
        self._ring_size = max(int(staging), 2)
        self.host_threads = int(host_threads) or len(os.sched_getaffinity(0))
        self._pending: dict = {}
        self.grads_ready: torch.cuda.Event | None = None
        """Set by step_beside: the streamed copies wait for this event instead of the compute stream."""
        self.copy_wait_s = 0.0
        """Seconds the last step's host-memory update waited for its copies (the rest of it is CPU work)."""
        params = [p for group in self.param_groups for p in group["params"]]
        host = sum(_local(p).numel() for p in params if self._state_device(p).type == "cpu")
        if host:  # before allocating: ~100 GB for 7B, which a smaller machine's OOM killer takes later
            check_host_memory(
                12 * host,
                "the fp32 master weights and AdamW moments in host memory (12 bytes a parameter)",
                "use a machine with more memory, or shard the states over more GPUs (optim.master_weights = "
                "params with --gpus 0-3, say)",
            )
        for p in params:
            self._init_state(p)
        self.register_load_state_dict_pre_hook(_stash_fp32_states)
        self.register_load_state_dict_post_hook(_restore_fp32_states)

    # ------------------------------------------------------------------ state
    def _state_device(self, p: torch.Tensor) -> torch.device:
        local = _local(p)
        return torch.device("cpu") if self.location == "host" else local.device

    def _init_state(self, p: torch.Tensor, master: torch.Tensor | None = None) -> None:
        local = _local(p)
        device = self._state_device(p)
        source = local.detach() if master is None else master
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.float32, device="cpu" if device.type == "cpu" else device)
        state["master"] = (
            source.reshape(local.shape).to(device=device, dtype=torch.float32, copy=True).contiguous()
        )
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = torch.zeros(local.shape, dtype=torch.float32, device=device)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of fp32 state by where it lives ("cpu" / "cuda"), for the memory report."""
        out: dict[str, int] = {}
        for state in self.state.values():
            for key in _FP32_KEYS:
                t = state[key]
                out[t.device.type] = out.get(t.device.type, 0) + t.numel() * t.element_size()
        return out

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ready, self.grads_ready = self.grads_ready, None
        self.copy_wait_s = 0.0
        for group in self.param_groups:
            items = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                items.append((p, state))
            if not items:
                continue
            streamed = [it for it in items if it[1]["master"].device != _local(it[0]).device]
            local = [it for it in items if it[1]["master"].device == _local(it[0]).device]
            for p, state in local:
                self._update_in_place(p, state, group)
            if streamed:
                previous = torch.get_num_threads()
                torch.set_num_threads(self.host_threads)  # the process may run with fewer (OMP_NUM_THREADS)
                try:
                    self._update_streamed(streamed, group, ready)
                finally:
                    torch.set_num_threads(previous)
        return loss

    def _adamw(self, master, grad, state, group, a: int, b: int) -> None:
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(
            [master.view(-1)[a:b]],
            [grad],
            [state["exp_avg"].view(-1)[a:b]],
            [state["exp_avg_sq"].view(-1)[a:b]],
            [],
            [state["step"]],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=False,
            maximize=False,
        )

    def _update_in_place(self, p, state, group) -> None:
        """Master weights on the parameter's own device: chunk by chunk (bounded fp32 temporaries)."""
        param, grad = _flat(_local(p)), _flat(_local(p.grad))
        master = state["master"]
        for a in range(0, param.numel(), self.chunk):
            b = min(a + self.chunk, param.numel())
            self._adamw(master, grad[a:b].float(), state, group, a, b)
            param[a:b].copy_(master.view(-1)[a:b])

    def _update_streamed(self, items, group, ready: torch.cuda.Event | None = None) -> None:
        """Master weights in host memory: a pipeline of pinned chunks (see the module docstring)."""
        work = [
            (p, state, a, min(a + self.chunk, p.numel()))
            for p, state in items
            for a in range(0, p.numel(), self.chunk)
        ]
        device = _local(items[0][0]).device
        ring = self._staging(device)
        n_ring = len(ring["buf"])
        compute = torch.cuda.current_stream(device)
        if ready is not None:  # gradients are final (step_beside: later work on the stream is not waited for)
            ring["d2h"].wait_event(ready)
        else:
            ring["d2h"].wait_stream(compute)  # gradients are final
        copied: list = [None] * n_ring
        written: list = [None] * n_ring
        fp32 = ring["fp32"]

        def fetch(i: int) -> None:
            p, _, a, b = work[i]
            s = i % n_ring
            stream = ring["d2h"]
            if written[s] is not None:
                stream.wait_event(written[s])  # the buffer's previous chunk has reached the GPU
            with torch.cuda.stream(stream):
                ring["buf"][s][: b - a].copy_(_flat(_local(p.grad))[a:b], non_blocking=True)
                copied[s] = torch.cuda.Event()
                copied[s].record(stream)

        for i in range(min(n_ring - 1, len(work))):
            fetch(i)
        for i, (p, state, a, b) in enumerate(work):
            if i + n_ring - 1 < len(work):
                fetch(i + n_ring - 1)
            s = i % n_ring
            t0 = time.perf_counter()
            copied[s].synchronize()
            self.copy_wait_s += time.perf_counter() - t0
            buf = ring["buf"][s][: b - a]
            grad = fp32[: b - a]
            grad.copy_(buf)
            self._adamw(state["master"], grad, state, group, a, b)
            buf.copy_(state["master"].view(-1)[a:b])
            stream = ring["h2d"]
            with torch.cuda.stream(stream):
                _flat(_local(p))[a:b].copy_(buf, non_blocking=True)
                written[s] = torch.cuda.Event()
                written[s].record(stream)
        compute.wait_stream(ring["h2d"])
        t0 = time.perf_counter()
        for event in written:
            if event is not None:
                event.synchronize()  # the staging ring is free again before the next step
        self.copy_wait_s += time.perf_counter() - t0

    def _staging(self, device: torch.device) -> dict:
        if self._ring is None:
            self._ring = {
                "buf": [
                    torch.empty(self.chunk, dtype=torch.bfloat16, pin_memory=True)
                    for _ in range(self._ring_size)
                ],
                "fp32": torch.empty(self.chunk, dtype=torch.float32),
                "d2h": torch.cuda.Stream(device),
                "h2d": torch.cuda.Stream(device),
            }
        return self._ring


def step_beside(optimizer, work: Callable[[], None] | None = None) -> tuple[float, float]:
    """optimizer.step() with `work` running meanwhile (module docstring); returns the seconds of each.
    `work` must not read or write the optimizer's parameters or gradients."""
    if work is None:
        t0 = time.perf_counter()
        optimizer.step()
        return time.perf_counter() - t0, 0.0
    device = _local(optimizer.param_groups[0]["params"][0]).device
    if device.type == "cuda" and isinstance(optimizer, MasterAdamW):
        optimizer.grads_ready = torch.cuda.Event()
        optimizer.grads_ready.record(torch.cuda.current_stream(device))
    result: dict = {}

    def update() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            t0 = time.perf_counter()
            optimizer.step()
            result["seconds"] = time.perf_counter() - t0
        except BaseException as exc:  # re-raised in the calling thread
            result["error"] = exc

    thread = threading.Thread(target=update, name="optimizer-step", daemon=True)
    thread.start()
    t0 = time.perf_counter()
    try:
        work()
    finally:
        work_s = time.perf_counter() - t0
        thread.join()
    if "error" in result:
        raise result["error"]
    return result["seconds"], work_s


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, the tensor itself otherwise."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("MasterAdamW needs contiguous parameters and gradients")
    return t.view(-1)


def _stash_fp32_states(optimizer: MasterAdamW, state_dict: dict):
    """Before torch's load casts the states to the parameters' dtype: keep the fp32 ones aside."""
    saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    optimizer._pending = {"ids": saved_ids, "states": {}}
    states = {}
    for pid, state in state_dict["state"].items():
        optimizer._pending["states"][pid] = {k: v for k, v in state.items() if k in _FP32_KEYS}
        states[pid] = {k: v for k, v in state.items() if k not in _FP32_KEYS}
    return {**state_dict, "state": states}


def _restore_fp32_states(optimizer: MasterAdamW) -> None:
    """After the load: rebuild every parameter's fp32 states on their location from the saved values."""
    pending, optimizer._pending = optimizer._pending, {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for pid, p in zip(pending.get("ids", []), params):
        saved = pending["states"].get(pid, {})
        step = optimizer.state[p].get("step")
        optimizer._init_state(p, master=saved.get("master"))
        state = optimizer.state[p]
        if step is not None:
            state["step"].copy_(torch.as_tensor(step, dtype=torch.float32))
        for key in ("exp_avg", "exp_avg_sq"):
            if key in saved:
                state[key].copy_(saved[key].reshape(state[key].shape))
