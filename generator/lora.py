"""LoRA serving: the base model loaded once, each policy version's adapter loaded beside it in vLLM.

With `engine.max_lora_rank` > 0 the engine is built with vLLM's LoRA support (`enable_lora`, `max_loras` =
`lora_slots`, `max_cpu_loras` above it) and a received version of kind "adapter" (weights/adapter.py) does
not touch the base weights: `AdapterSlots.load` writes it as a PEFT directory under the run directory and
adds it to vLLM (`LLMEngine.add_lora(LoRARequest("v<version>", version + 1, dir))`). Every request is then
sampled with the newest adapter's `LoRARequest`, and stays with it to the end: a request in flight keeps the
adapter it started under while newer versions load beside it (vLLM batches requests of different adapters),
so with K + 1 slots (K: the staleness bound) every request of a version the learner still trains on finishes
under its own version, and its samples carry that version and the adapter's content digest
(`Result.adapter`, what the learner's guard checks).

Older adapters are unloaded once more than `slots` are loaded, oldest first, and only when no request in
flight uses them (`acquire` / `release` count them): nothing is removed from under a running request, so an
update never waits for one (removing an adapter a request still needs would make vLLM load it again from a
directory that is gone, or block on it). Before the first adapter arrives the engine serves the base model
without a LoRARequest (digest "": version 0's adapter, B = 0, is the base model exactly).
"""

from __future__ import annotations

import logging
import shutil
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

from weights.adapter import adapter_digest, adapter_rank, write_peft_dir

log = logging.getLogger(__name__)


class AdapterError(RuntimeError):
    """An adapter that cannot be served (rank above the engine's, or vLLM refused it)."""


@dataclass
class Adapter:
    """One loaded version: vLLM's request handle and the adapter's content digest."""

    version: int
    request: object
    """vllm.lora.request.LoRARequest."""
    digest: str
    path: Path


class AdapterSlots:
    """The adapters one vLLM engine holds (module docstring). Not thread-safe: the engine's lock guards it."""

    def __init__(self, llm, directory: str | Path, slots: int, max_rank: int):
        self.llm = llm
        self.directory = Path(directory)
        self.slots = max(slots, 1)
        self.max_rank = max_rank
        self.loaded: OrderedDict[int, Adapter] = OrderedDict()
        self.inflight: Counter[int] = Counter()
        self.current: Adapter | None = None
        shutil.rmtree(self.directory, ignore_errors=True)

    def load(self, named_tensors, config: str, version: int) -> Adapter:
        """Write and add the adapter of `version`, make it the one new requests get, unload old ones."""
        from vllm.lora.request import LoRARequest

        rank = adapter_rank(config)
        if rank > self.max_rank:
            raise AdapterError(f"adapter rank {rank} is above the engine's max_lora_rank {self.max_rank}")
        pairs = list(named_tensors)
        digest = adapter_digest(pairs)
        path = write_peft_dir(self.directory / f"v{version}", pairs, config)
        old = self.loaded.pop(version, None)
        if old is not None:  # the same version again (a learner that restarted): replace it
            self.llm.llm_engine.remove_lora(old.request.lora_int_id)
        request = LoRARequest(f"v{version}", version + 1, str(path))
        if not self.llm.llm_engine.add_lora(request):
            raise AdapterError(f"vLLM did not load the adapter of version {version}")
        adapter = Adapter(version, request, digest, path)
        self.loaded[version] = adapter
        self.current = adapter
        self._unload_old()
        return adapter

    def acquire(self) -> Adapter | None:
        """The adapter a new request samples with (None: the base model); counted until `release`."""
        if self.current is not None:
            self.inflight[self.current.version] += 1
        return self.current

    def release(self, adapter: Adapter | None) -> None:
        """A request that `acquire`d `adapter` finished."""
        if adapter is None:
            return
        self.inflight[adapter.version] -= 1
        if self.inflight[adapter.version] <= 0:
            del self.inflight[adapter.version]
        self._unload_old()

    def _unload_old(self) -> None:
        """Unload the oldest adapters beyond `slots` that no request in flight uses."""
        for version in list(self.loaded):
            if len(self.loaded) <= self.slots:
                return
            adapter = self.loaded[version]
            if adapter is self.current or self.inflight[version] > 0:
                continue
            self.llm.llm_engine.remove_lora(adapter.request.lora_int_id)
            shutil.rmtree(adapter.path, ignore_errors=True)
            del self.loaded[version]
            log.info("unloaded the adapter of version %d (%d loaded)", version, len(self.loaded))

    def vllm_ids(self) -> set[int]:
        """The adapter ids vLLM reports loaded (tests)."""
        return set(self.llm.llm_engine.list_loras())
