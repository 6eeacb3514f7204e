"""One training step of the tiny model, with or without FSDP2; run by test_parallel.py.

Usage: python fsdp_worker.py MODEL_DIR OUT.safetensors [CKPT_DIR]         (one process, plain module)
       python -m torch.distributed.run --nproc-per-node 2 fsdp_worker.py MODEL_DIR OUT [CKPT_DIR]  (FSDP2)
Sample 0 has an image, sample 1 is text-only. One process runs both as two accumulated
micro-batches; with two ranks, rank r runs sample r (rank 1 runs the vision tower on a dummy).
The loss is the summed response-token NLL over the global token count. Rank 0 writes the
updated full parameters. With CKPT_DIR it also saves a checkpoint, scrambles the weights and
optimizer, loads the checkpoint back and stores `__restored_ok__` = 1 when every shard matches.
"""

import sys

import torch
from PIL import Image
from safetensors.torch import save_file

from learner.checkpoint import Checkpointer, TrainerState
from learner.config import OptimConfig, ParallelConfig
from learner.parallel import apply_parallelism, build_optimizer, clip_grad_norm, distributed, init_distributed
from policy.loading import load_model, load_processor


def _samples(processor):
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    msgs = [
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour?"}]}],
        [{"role": "user", "content": [{"type": "text", "text": "count to three"}]}],
    ]
    out = []
    for i, msg in enumerate(msgs):
        text = processor.apply_chat_template(msg, add_generation_prompt=True) + "one two three"
        enc = processor(text=[text], images=[image] if i == 0 else None, return_tensors="pt")
        enc["n_resp"] = 4
        out.append(enc)
    return out


def _forward(hf, enc):
    kwargs = {k: v for k, v in enc.items() if k != "n_resp"}
    logits = hf(**kwargs).logits[0].float()
    ids = enc["input_ids"][0]
    n = enc["n_resp"]
    logp = torch.log_softmax(logits[-n - 1 : -1], dim=-1)
    return -logp.gather(-1, ids[-n:, None]).sum()


def _local_state(root, optimizer):
    tensors = {n: p.detach().clone() for n, p in root.named_parameters()}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{id(p)}/{k}"] = v.detach().clone()
    return {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in tensors.items()}


def _round_trip(root, optimizer, scheduler, ckpt_dir, rank) -> bool:
    before = _local_state(root, optimizer)
    ckpt = Checkpointer(ckpt_dir, rank=rank)
    path = ckpt.save(root, optimizer, scheduler, TrainerState(step=1, version=1, consumed=["a"]))
    with torch.no_grad():
        for p in root.parameters():
            p.mul_(0.0)
        for st in optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    v.mul_(0.0)
    state = ckpt.load(path, root, optimizer, scheduler)
    after = _local_state(root, optimizer)
    return state.consumed == ["a"] and all(torch.equal(before[k], after[k]) for k in before)


def main(model_dir: str, out_path: str, ckpt_dir: str | None = None) -> None:
    torch.manual_seed(0)
    info = init_distributed()
    processor = load_processor(model_dir)
    hf = load_model(model_dir).train()
    root = apply_parallelism(hf, ParallelConfig(activation_checkpointing=True), info.device)
    optimizer, scheduler = build_optimizer(root, OptimConfig(lr=1e-4, weight_decay=0.1, grad_clip=0.5))
    samples = _samples(processor)
    total_tokens = sum(s["n_resp"] for s in samples)
    mine = [samples[info.rank]] if distributed() else samples
    for enc in mine:
        nll, zero = root(_forward, enc, vision_dummy="pixel_values" not in enc)
        loss = nll / total_tokens * info.world_size
        if zero is not None:
            loss = loss + zero
        loss.backward()
    norm = clip_grad_norm(root, 0.5)
    optimizer.step()
    restored = _round_trip(root, optimizer, scheduler, ckpt_dir, info.rank) if ckpt_dir else False
    state = {}
    for name, p in root.hf.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        state[name] = full.detach().clone().contiguous()
    if info.rank == 0:
        state["__grad_norm__"] = torch.tensor([norm])
        state["__restored_ok__"] = torch.tensor([float(restored)])
        save_file(state, out_path)
    if distributed():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
