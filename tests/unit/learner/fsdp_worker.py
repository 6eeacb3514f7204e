"""One training step of the tiny model on packed batches, with or without FSDP2; run by test_parallel.py.

Usage: python fsdp_worker.py MODEL_DIR OUT.safetensors [CKPT_DIR]         (one process, plain module)
       python -m torch.distributed.run --nproc-per-node 2 fsdp_worker.py MODEL_DIR OUT [CKPT_DIR]  (FSDP2)
Micro-batch 0 packs two samples with images, micro-batch 1 one text-only sample. One process
runs both, accumulating gradients; with two ranks, rank r runs micro-batch r (rank 1 runs the
vision tower on a dummy image). The loss is the summed response-token NLL over the global
token count. Rank 0 writes the updated full parameters. With CKPT_DIR it also saves a
checkpoint, scrambles weights and optimizer, loads it back and stores `__restored_ok__` = 1
when every shard matches.
"""

import io
import sys

import torch
from PIL import Image
from safetensors.torch import save_file

from learner.checkpoint import Checkpointer, TrainerState
from learner.config import OptimConfig, ParallelConfig
from learner.parallel import apply_parallelism, build_optimizer, clip_grad_norm, distributed, init_distributed
from policy.loading import load_model, load_processor
from policy.packing import PixelCache, make_sample, pack


def _png(colour):
    buf = io.BytesIO()
    Image.new("RGB", (56, 84), colour).save(buf, format="PNG")
    return buf.getvalue()


def micro_batches(processor, image_token_id):
    tok = processor.tokenizer
    cache = PixelCache(processor.image_processor)
    merge = processor.image_processor.merge_size

    def prompt(text, images):
        content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
        return tok.encode(
            processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        )

    resp = tok.encode("one two three four")
    a = make_sample(prompt("colour?", 1), resp, [("red", _png((200, 30, 30)))], cache, image_token_id)
    b = make_sample(prompt("colour?", 1), resp[:3], [("blue", _png((30, 30, 200)))], cache, image_token_id)
    c = make_sample(prompt("count to three", 0), resp[:2], [], cache, image_token_id)
    return [pack([a, b], image_token_id, merge), pack([c], image_token_id, merge)]


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
    hf = load_model(model_dir, device=info.device).train()
    batches = micro_batches(processor, hf.config.image_token_id)
    root = apply_parallelism(hf, ParallelConfig(activation_checkpointing=True), info.device)
    optimizer, scheduler = build_optimizer(root, OptimConfig(lr=1e-4, weight_decay=0.1, grad_clip=0.5))
    total_tokens = sum(len(b.target_index) for b in batches)
    mine = [batches[info.rank]] if distributed() else batches
    for packed in mine:
        logprobs, _ = root(packed, run_vision_always=distributed())
        loss = -logprobs.sum() / total_tokens * info.world_size
        loss.backward()
    norm = clip_grad_norm(root, 0.5)
    optimizer.step()
    restored = _round_trip(root, optimizer, scheduler, ckpt_dir, info.rank) if ckpt_dir else False
    state = {}
    for name, p in root.model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        state[name] = full.detach().cpu().clone().contiguous()
    if info.rank == 0:
        state["__grad_norm__"] = torch.tensor([norm])
        state["__restored_ok__"] = torch.tensor([float(restored)])
        save_file(state, out_path)
    if distributed():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
